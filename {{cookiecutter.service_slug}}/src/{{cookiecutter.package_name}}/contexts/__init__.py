"""Your bounded contexts, one folder each (the room you copy from is ``orders``).

A folder here with a ``module.py`` defining ``module() -> Module`` is a bounded context: the
composition root discovers it, registers its messages, handlers, routes and adapters, and the
architecture tests check it like the others. Contexts never import each other; they share
integration events through ``contracts/`` and may import from the kit only
``outbox_kit.domain`` (in their domain layer) and ``outbox_kit.public``.
"""
