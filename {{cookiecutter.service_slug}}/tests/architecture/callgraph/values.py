"""What the call graph reasons about: a value is an instance of a class, a class, a module, a
function of the scanned source (lambdas and nested functions included), an external callable or
a dependency-injector provider; and the names of the library types it recognises."""

from __future__ import annotations

import ast
from collections import abc
from dataclasses import dataclass
from typing import Any

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda

SCOPE_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)

TYPING_MODULES = frozenset({"typing", "typing_extensions", "collections.abc", "builtins"})

PROTOCOL_TYPES = frozenset({"typing.Protocol", "typing_extensions.Protocol"})

CONTEXT_MANAGERS = frozenset({"contextmanager", "asynccontextmanager"})

PROPERTIES = frozenset({"property", "cached_property"})

ITERATORS = frozenset({"Iterator", "AsyncIterator", "Generator", "AsyncGenerator"})

WRAPPERS = frozenset({"Annotated", "ClassVar", "Final", "Required", "NotRequired", "ReadOnly"})

# Calling a session factory gives a session (``Database.sessions()``).
SESSION_FACTORIES = {
    "sqlalchemy.orm.session.sessionmaker": "sqlalchemy.orm.session.Session",
    "sqlalchemy.ext.asyncio.session.async_sessionmaker": "sqlalchemy.ext.asyncio.session.AsyncSession",
}

# dependency-injector providers that build by calling their first argument.
BUILDING_PROVIDERS = frozenset(
    f"dependency_injector.providers.{name}"
    for name in (
        "Factory",
        "Singleton",
        "ThreadSafeSingleton",
        "ThreadLocalSingleton",
        "ContextLocalSingleton",
        "Callable",
        "Coroutine",
        "Resource",
    )
)

ITERATOR_ORIGINS = (abc.Iterator, abc.AsyncIterator, abc.Generator, abc.AsyncGenerator)

MISSING = object()


@dataclass(frozen=True)
class Instance:
    type: str


@dataclass(frozen=True)
class ClassRef:
    type: str


@dataclass(frozen=True)
class ModuleRef:
    name: str


@dataclass(frozen=True)
class FunctionRef:
    key: str


@dataclass(frozen=True)
class External:
    """A callable outside the scanned packages, by its canonical dotted name."""

    name: str


@dataclass(frozen=True)
class Provider:
    """A dependency-injector provider (``providers.Factory(X, ...)``) and what calling it
    builds: a class (its constructor runs, an instance comes back) or a function."""

    provides: frozenset[Value]


Value = Instance | ClassRef | ModuleRef | FunctionRef | External | Provider


def type_name(cls: type[Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
