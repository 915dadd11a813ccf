"""Names and what they may hold: module globals, resolved dotted names, and the flow-insensitive
environment of a function (parameters from annotations, assignments, ``with``/``async with``
targets, nested definitions): a name holds the union of every value assigned to it in its scope,
which over-approximates, never under-."""

from __future__ import annotations

import ast
import builtins

from .runtime import classify, runtime_object
from .scopes import Scope, _bind_target, own_nodes
from .sources import FunctionSource, ModuleSource
from .values import MISSING, ClassRef, External, FunctionRef, Instance, ModuleRef, Value


class Environment:
    """The names part of :class:`CallGraph` (its state lives there)."""

    def scope_of(self, fn: FunctionSource) -> Scope:
        owner: FunctionSource | None = fn
        while owner is not None and owner.owner is None:
            owner = owner.parent
        return Scope(fn.module, fn, owner.owner if owner is not None else None)

    def lookup(self, name: str, scope: Scope) -> set[Value]:
        fn = scope.function
        while fn is not None:
            env = self._env(fn)
            if name in env:
                return env[name]
            fn = fn.parent
        return self._global(scope.module, name)

    def _global(self, module: ModuleSource, name: str) -> set[Value]:
        key = (module.name, name)
        if key in self._globals:
            return self._globals[key]
        self._globals[key] = set()
        values = self._global_uncached(module, name)
        self._globals[key] = values
        return values

    def _global_uncached(self, module: ModuleSource, name: str) -> set[Value]:
        if name in module.defs:
            key = module.defs[name]
            return {ClassRef(key)} if key in self.index.classes else {FunctionRef(key)}
        if name in module.imports:
            return self.resolve(module.imports[name])
        if name in module.assigns:
            scope = Scope(module)
            return {v for value in module.assigns[name] for v in self.infer(value, scope)}
        if hasattr(builtins, name):
            return classify(getattr(builtins, name))
        return set()

    def resolve(self, qualified: str) -> set[Value]:
        """What a dotted name denotes: scanned source first, then the installed libraries."""
        if qualified in self._resolved:
            return self._resolved[qualified]
        self._resolved[qualified] = set()
        values = self._resolve_uncached(qualified)
        self._resolved[qualified] = values
        return values

    def _resolve_uncached(self, qualified: str) -> set[Value]:
        if qualified in self.index.modules:
            return {ModuleRef(qualified)}
        parts = qualified.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = self.index.modules.get(".".join(parts[:cut]))
            if module is not None:
                values = self._global(module, parts[cut])
                for attr in parts[cut + 1 :]:
                    values = {v for value in values for v in self.attribute(value, attr)}
                return values
        return classify(runtime_object(qualified)) or {External(qualified)}

    def exists(self, name: str) -> bool:
        """True when ``name`` is a module, class or function of the index, or importable."""
        prefix = f"{name}."
        if any(known == name or known.startswith(prefix) for known in self.index.names()):
            return True
        return runtime_object(name) is not MISSING

    def _env(self, fn: FunctionSource) -> dict[str, set[Value]]:
        env = self._envs.get(fn.key)
        if env is not None:
            return env
        env = {}
        self._envs[fn.key] = env  # visible while it is built: recursion sees a partial scope
        scope = self.scope_of(fn)
        self._bind_parameters(fn, env, scope)
        for node in own_nodes(fn.node):
            self._bind(node, env, scope)
        return env

    def _bind_parameters(self, fn: FunctionSource, env: dict[str, set[Value]], scope: Scope) -> None:
        args = fn.node.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        bound = fn.owner is not None and "staticmethod" not in fn.decorators
        for position, arg in enumerate(params):
            if position == 0 and bound and fn.owner is not None:
                first = ClassRef(fn.owner.key) if "classmethod" in fn.decorators else Instance(fn.owner.key)
                env[arg.arg] = {first}
            else:
                env[arg.arg] = self.annotation(arg.annotation, scope)
        for extra in (args.vararg, args.kwarg):
            if extra is not None:
                env[extra.arg] = set()

    def _bind(self, node: ast.AST, env: dict[str, set[Value]], scope: Scope) -> None:
        if isinstance(node, ast.Assign):
            values = self.infer(node.value, scope)
            for target in node.targets:
                _bind_target(target, values, env)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            values = self.annotation(node.annotation, scope)
            values |= self.infer(node.value, scope) if node.value else set()
            env.setdefault(node.target.id, set()).update(values)
        elif isinstance(node, ast.NamedExpr):
            _bind_target(node.target, self.infer(node.value, scope), env)
        elif isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                if item.optional_vars is not None:
                    entered = self._entered(
                        item.context_expr, scope, is_async=isinstance(node, ast.AsyncWith)
                    )
                    _bind_target(item.optional_vars, entered, env)
        elif isinstance(node, ast.For | ast.AsyncFor):
            _bind_target(node.target, set(), env)
        else:
            self._bind_definition(node, env)

    def _bind_definition(self, node: ast.AST, env: dict[str, set[Value]]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            env[node.name] = {FunctionRef(self.index.function_nodes[id(node)].key)}
        elif isinstance(node, ast.ClassDef):
            env[node.name] = {ClassRef(self.index.class_nodes[id(node)].key)}

    def _entered(self, expr: ast.expr, scope: Scope, *, is_async: bool) -> set[Value]:
        """What ``with expr as x`` binds: ``__(a)enter__``'s return type, else the object."""
        entered: set[Value] = set()
        for value in self.infer(expr, scope):
            method = None
            if isinstance(value, Instance) and value.type in self.index.classes:
                method = self.find_method(value.type, "__aenter__" if is_async else "__enter__")
            returned = self.returns(method) if method is not None else set()
            entered |= returned or {value}
        return entered
