"""The bounded contexts, found under contexts/, and what they register: messages, upcasters, handlers."""

from __future__ import annotations

import importlib
from types import ModuleType

from outbox_kit.application.handlers import HandlerRegistry, Module, discover_modules, import_table_modules
from outbox_kit.application.messages import MessageRegistry


def _contexts() -> ModuleType:
    return importlib.import_module("..contexts", __package__)


def build_modules() -> list[Module]:
    modules = discover_modules(_contexts())
    import_table_modules(modules)
    return modules


def build_registry(modules: list[Module]) -> MessageRegistry:
    registry = MessageRegistry()
    for module in modules:
        registry.register(*module.messages)
        for spec in module.upcasters:
            registry.add_upcaster(spec.source, spec.target, spec.upcast)
    registry.validate()
    return registry


def build_handlers(modules: list[Module]) -> HandlerRegistry:
    handlers = HandlerRegistry()
    for module in modules:
        if module.register_handlers is not None:
            module.register_handlers(handlers)
    return handlers
