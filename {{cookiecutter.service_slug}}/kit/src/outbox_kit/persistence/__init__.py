"""Engine and sessions, the outbox/inbox/internal-command tables, and the unit of work."""
