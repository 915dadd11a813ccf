"""Idempotency keys: a create command a client retries runs once (see ``keys``)."""
