"""Claim guard: an index of the keys that have a row in flight.

The claim refuses a key's head while another row of that key holds a live lease (a replayed
dead letter must not run beside the key-mate that overtook it). This partial index holds only
leased, pending, keyed rows, so the check is one small index probe per head. It is built
CONCURRENTLY on PostgreSQL: building it reads the whole table, and a busy outbox must keep
accepting writes meanwhile.

Revision ID: 0003
Revises: {{ '0002' if cookiecutter.include_example else '0001' }}
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
# The core chain continues after the example contexts when they were generated.
down_revision: str | None = "{{ '0002' if cookiecutter.include_example else '0001' }}"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("outbox_messages", "internal_commands")
PENDING = "processed_on IS NULL AND dead_lettered_on IS NULL"
WHERE = f"{PENDING} AND ordering_key IS NOT NULL AND lock_token IS NOT NULL"


def upgrade() -> None:
    with op.get_context().autocommit_block():
        for table in TABLES:
            op.create_index(
                f"ix_{table}_pending_leased_key",
                table,
                ["ordering_key"],
                unique=False,
                postgresql_where=sa.text(WHERE),
                sqlite_where=sa.text(WHERE),
                postgresql_concurrently=True,
            )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for table in TABLES:
            op.drop_index(f"ix_{table}_pending_leased_key", table_name=table, postgresql_concurrently=True)
