"""The one place the analysis looks at live objects: a name that leads outside the scanned packages
(sqlalchemy's ``AsyncSession``, ``functools.partial``) is looked up on the imported library, to
learn its canonical name, its base classes and what it returns."""

from __future__ import annotations

import inspect
import sys
import types
import typing
from types import ModuleType

from .values import ITERATOR_ORIGINS, MISSING, ClassRef, External, Instance, ModuleRef, Value, type_name


def _import(name: str) -> ModuleType | None:
    """Only what is already imported: reading the source never imports a library (no side
    effects, no seconds spent loading a broker client the service imports lazily)."""
    return sys.modules.get(name)


def runtime_object(qualified: str) -> object:
    """The object a dotted name denotes in an imported library, or ``MISSING``."""
    parts = qualified.split(".")
    for cut in range(len(parts), 0, -1):
        module = _import(".".join(parts[:cut]))
        if module is None:
            continue
        found: object = module
        for attr in parts[cut:]:
            found = getattr(found, attr, MISSING)
            if found is MISSING:
                return MISSING
        return found
    return MISSING


def classify(obj: object) -> set[Value]:
    if obj is MISSING or obj is None:
        return set()
    if inspect.ismodule(obj):
        return {ModuleRef(obj.__name__)}
    if inspect.isclass(obj):
        return {ClassRef(type_name(obj))}
    qualname = getattr(obj, "__qualname__", None)
    if callable(obj) and isinstance(qualname, str):
        return {External(f"{getattr(obj, '__module__', None) or '?'}.{qualname}")}
    return {Instance(type_name(type(obj)))}


def _runtime_return(func: object) -> set[Value]:
    """A library callable's return type; a decorated one returning ``AsyncIterator[T]``
    (``@asynccontextmanager``) gives ``T``."""
    try:
        annotation = inspect.signature(func).return_annotation  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return set()
    if isinstance(annotation, str):
        namespace = dict(getattr(inspect.unwrap(func), "__globals__", {}))  # type: ignore[arg-type]
        try:
            annotation = eval(annotation, namespace)  # noqa: S307 (the library's own annotation, in its module)
        except (NameError, AttributeError, SyntaxError, TypeError):
            return set()  # an unresolvable annotation leaves the type unknown
    if hasattr(func, "__wrapped__") and typing.get_origin(annotation) in ITERATOR_ORIGINS:
        annotation = typing.get_args(annotation)[0]
    return _instances_of(annotation)


def _instances_of(annotation: object) -> set[Value]:
    if inspect.isclass(annotation):
        return {Instance(type_name(annotation))}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {v for arg in typing.get_args(annotation) for v in _instances_of(arg)}
    return set()
