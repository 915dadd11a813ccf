"""Errors the domain and the persistence layer raise in business terms."""

from __future__ import annotations


class DomainError(Exception):
    """A business rule refused the operation (the API answers 409/422 with this message).

    ``field`` names the input the rule is about (``("lines", 0, "sku")``) when there is one, so
    the API reports it where request validation reports its own errors.
    """

    def __init__(
        self, message: str, *, code: str = "domain_error", field: tuple[str | int, ...] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.field = field


class NotFoundError(DomainError):
    """The aggregate does not exist, or belongs to another tenant (indistinguishable: 404)."""

    def __init__(self, kind: str, identifier: object) -> None:
        super().__init__(f"{kind} {identifier} was not found", code="not_found")


class ConcurrencyError(DomainError):
    """Another writer changed the aggregate since it was loaded (optimistic concurrency)."""

    def __init__(self, kind: str, identifier: object, expected_version: int) -> None:
        super().__init__(
            f"{kind} {identifier} was changed by someone else (expected version "
            f"{expected_version}); reload it and try again",
            code="concurrency_conflict",
        )
