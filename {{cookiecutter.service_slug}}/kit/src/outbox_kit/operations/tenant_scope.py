"""Every operation works within a :class:`TenantScope`: the admin API passes the token's tenant
(role ``outbox-admin``), so another tenant's row is exactly as unknown as a row that does not
exist; the operator role and the CLI see every tenant (:data:`EVERY_TENANT`), rows without a
tenant included."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa


@dataclass(frozen=True)
class TenantScope:
    """The rows a caller may see and replay: one tenant's, or every row (``tenant_id`` None)."""

    tenant_id: str | None

    def admits(self, table: sa.Table) -> sa.ColumnElement[bool]:
        """A WHERE clause (a row without a tenant is admitted by the every-tenant scope only)."""
        return sa.true() if self.tenant_id is None else table.c.tenant_id == self.tenant_id

    def sees(self, tenant_id: str | None) -> bool:
        return self.tenant_id is None or tenant_id == self.tenant_id


EVERY_TENANT = TenantScope(None)
