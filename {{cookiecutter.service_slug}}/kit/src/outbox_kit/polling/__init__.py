"""One polling core and one lease idiom, shared by the outbox and internal-command processors."""
