"""The database: tables, the unit of work and repositories, the relay rows' guarded writes, and
idempotency keys."""
