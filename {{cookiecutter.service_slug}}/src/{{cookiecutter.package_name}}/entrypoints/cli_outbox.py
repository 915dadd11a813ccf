"""The outbox commands of the CLI (pending, dead-letters, replay, explain): an operator tool that
sees every tenant unless --tenant narrows it, printing JSON; a replay is recorded as cli:<login
name> by default."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import datetime
from typing import TypeVar

from outbox_kit.operations.admin import RelayAdministration
from outbox_kit.operations.requests import EVERY_TENANT, AdminError, TenantScope

from ..container import Container
from .cli_errors import CliError

T = TypeVar("T")


def _json_default(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _print_json(data: object) -> None:
    print(json.dumps(data, indent=2, default=_json_default))


async def _with_admin(container: Container, action: Callable[[RelayAdministration], Awaitable[T]]) -> T:
    try:
        return await action(container.admin())
    except AdminError as error:
        raise CliError(str(error)) from None
    finally:
        await container.database().dispose()


def run_outbox_command(args: argparse.Namespace, container: Container) -> None:
    # An operator tool: every tenant unless --tenant narrows it.
    scope = TenantScope(args.tenant) if args.tenant else EVERY_TENANT
    if args.outbox_command == "pending":
        counts = asyncio.run(_with_admin(container, lambda a: a.count_pending(args.source, scope=scope)))
        _print_json([asdict(c) for c in counts])
    elif args.outbox_command == "dead-letters":
        letters = asyncio.run(
            _with_admin(
                container,
                lambda a: a.list_dead_letters(args.source, offset=args.offset, limit=args.limit, scope=scope),
            )
        )
        _print_json([asdict(d) for d in letters])
    elif args.outbox_command == "replay":
        result = asyncio.run(
            _with_admin(container, lambda a: a.replay(args.source, args.ids, actor=args.actor, scope=scope))
        )
        _print_json(asdict(result))
    elif args.outbox_command == "explain":
        explanation = asyncio.run(
            _with_admin(container, lambda a: a.explain(args.source, args.id, scope=scope))
        )
        _print_json(asdict(explanation))


def login_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name (a container with an unnamed uid)
        return "unknown"
