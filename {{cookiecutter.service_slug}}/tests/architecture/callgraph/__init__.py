"""A static call graph over Python source, for the architecture rules.

Nothing here runs the code it reads. The scanned packages are parsed with ``ast``; imports,
class bases and annotations are resolved symbolically. Only a name that leads *outside* the
scanned packages (sqlalchemy's ``AsyncSession``, ``functools.partial``) is looked up on the
library (when the process has imported it), to learn its canonical name and its base classes.

A value is an instance of a class, a class, a module, a function of the scanned source (lambdas
and nested functions included) or an external callable. Types come from annotations
(parameters, returns, class attributes, ``self.x: T``, properties), from constructor injection
(``self.x = x`` with ``x: T`` in ``__init__``), from assignments (``x = T(...)``,
``x = self.y``, ``with T() as x``) and from ``uow.repository(Port)``, resolved through the
port -> adapter map the composition root uses. The analysis is flow-insensitive: a name holds the
union of every value assigned to it in its scope, which over-approximates, never under-.

``CallGraph.edges(function)`` lists what one function can reach (see ``Edge.how``); the rules
that walk it (``save_rule``) state their limits.
"""

from .environment import Environment
from .graph import CallGraph
from .hierarchy import Hierarchy
from .inference import Inference
from .runtime import classify, runtime_object
from .scopes import Callee, Edge, Scope, own_nodes
from .sources import ClassSource, FunctionSource, ModuleSource, SourceIndex, source_index
from .values import (
    BUILDING_PROVIDERS,
    CONTEXT_MANAGERS,
    ITERATOR_ORIGINS,
    ITERATORS,
    MISSING,
    PROPERTIES,
    PROTOCOL_TYPES,
    SCOPE_NODES,
    SESSION_FACTORIES,
    TYPING_MODULES,
    WRAPPERS,
    ClassRef,
    External,
    FunctionNode,
    FunctionRef,
    Instance,
    ModuleRef,
    Provider,
    Value,
    type_name,
)

__all__ = [
    "BUILDING_PROVIDERS",
    "CONTEXT_MANAGERS",
    "ITERATORS",
    "ITERATOR_ORIGINS",
    "MISSING",
    "PROPERTIES",
    "PROTOCOL_TYPES",
    "SCOPE_NODES",
    "SESSION_FACTORIES",
    "TYPING_MODULES",
    "WRAPPERS",
    "CallGraph",
    "Callee",
    "ClassRef",
    "ClassSource",
    "Edge",
    "Environment",
    "External",
    "FunctionNode",
    "FunctionRef",
    "FunctionSource",
    "Hierarchy",
    "Inference",
    "Instance",
    "ModuleRef",
    "ModuleSource",
    "Provider",
    "Scope",
    "SourceIndex",
    "Value",
    "classify",
    "own_nodes",
    "runtime_object",
    "source_index",
    "type_name",
]
