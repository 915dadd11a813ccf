"""The outbox/inbox machinery. It knows no bounded context (enforced by import-linter)."""
