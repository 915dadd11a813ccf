"""The processor: one polling core drains the outbox and the internal-command tables; the two
differ only in how a row is delivered."""
