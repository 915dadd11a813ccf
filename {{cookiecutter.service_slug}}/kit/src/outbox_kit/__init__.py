"""outbox-kit: the transactional outbox and inbox a generated service is built on.

It knows no service: a service composes its settings models, registers its messages and
handlers, and imports what its contexts use from :mod:`outbox_kit.public` (and
:mod:`outbox_kit.domain` in a domain layer). Everything else is internal and may change between
versions; ``CHANGELOG.md`` says what did."""

from __future__ import annotations

__version__ = "0.12.0"
