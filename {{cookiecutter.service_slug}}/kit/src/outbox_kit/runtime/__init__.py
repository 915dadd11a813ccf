"""The entry points' parts: the HTTP edge (authentication, context, errors) and the worker."""
