"""``POST /orders`` behind a lock answers 503 with a clear body within the database's time limit
(PostgreSQL: ``DATABASE__STATEMENT_TIMEOUT_SECONDS``; SQLite: its busy timeout, after
``uow.run``'s retries), instead of hanging as long as the lock is held or answering 500.
A real ``api`` process; the lock is the test's own (``LOCK TABLE``, ``BEGIN IMMEDIATE``)."""

from __future__ import annotations

import sqlite3

import asyncpg
import httpx
import pytest
from outbox_kit.testing.fixtures import (
    free_port,
    make_settings,
    plain_dsn,
    service_process,
    token_for,
    until_answering,
)
from sqlalchemy.engine import make_url

from {{ cookiecutter.package_name }}.container import (
    build_container,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PACKAGE = "{{ cookiecutter.package_name }}"
JWT_SECRET = "lock-wait-test-secret-0123456789abcdef0123"
MARGIN = 15.0  # for a loaded machine: the answer must come, it is not a timing claim
ORDER = {"customer_id": "c-1", "lines": [{"sku": "BOOK", "quantity": 2, "unit_price": "9.99"}]}
UNAVAILABLE = {
    "detail": (
        "the database did not answer in time (a lock held elsewhere, or the database is "
        "overloaded or unreachable): nothing was changed, try again"
    ),
    "code": "database_unavailable",
}


@pytest.mark.postgres
async def test_an_order_behind_a_table_lock_answers_503_within_the_statement_timeout(
    postgres_url: str,
) -> None:
    statement_timeout = 1.0
    port = free_port()
    token = token_for(build_container(make_settings(postgres_url, auth={"jwt_secret": JWT_SECRET})))
    headers = {"Authorization": f"Bearer {token}"}
    admin = await asyncpg.connect(plain_dsn(postgres_url))
    try:
        with service_process(
            postgres_url,
            "api",
            "--port",
            str(port),
            package=PACKAGE,
            AUTH__JWT_SECRET=JWT_SECRET,
            DATABASE__STATEMENT_TIMEOUT_SECONDS=str(statement_timeout),
        ) as process:
            base = f"http://127.0.0.1:{port}"
            await until_answering(f"{base}/readyz", process)
            async with admin.transaction():
                await admin.execute("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
                async with httpx.AsyncClient(base_url=base, timeout=statement_timeout + MARGIN) as client:
                    response = await client.post("/orders", json=ORDER, headers=headers)
            # the lock is gone: the same order goes through (nothing was left half written)
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                placed = await client.post("/orders", json=ORDER, headers=headers)
            orders = await admin.fetchval("SELECT count(*) FROM orders")
    finally:
        await admin.close()
    assert response.status_code == 503, response.text
    assert response.json() == UNAVAILABLE
    assert response.headers["Retry-After"] == "1"
    assert placed.status_code == 201, placed.text
    assert orders == 1


async def test_an_order_behind_a_sqlite_write_lock_answers_503_after_the_busy_timeout(
    sqlite_url: str,
) -> None:
    busy_ms = 200
    port = free_port()
    token = token_for(build_container(make_settings(sqlite_url, auth={"jwt_secret": JWT_SECRET})))
    headers = {"Authorization": f"Bearer {token}"}
    with service_process(
        sqlite_url,
        "api",
        "--port",
        str(port),
        package=PACKAGE,
        AUTH__JWT_SECRET=JWT_SECRET,
        DATABASE__SQLITE_BUSY_TIMEOUT_MS=str(busy_ms),
    ) as process:
        base = f"http://127.0.0.1:{port}"
        await until_answering(f"{base}/readyz", process)
        holder = sqlite3.connect(make_url(sqlite_url).database or "", isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")  # the write lock, held across the request
            async with httpx.AsyncClient(base_url=base, timeout=MARGIN) as client:
                response = await client.post("/orders", json=ORDER, headers=headers)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            placed = await client.post("/orders", json=ORDER, headers=headers)
    assert response.status_code == 503, response.text
    assert response.json() == UNAVAILABLE
    assert placed.status_code == 201, placed.text
