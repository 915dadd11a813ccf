"""The consumer side: one consume pipeline that deduplicates with the inbox table."""
