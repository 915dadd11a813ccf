"""The vocabulary every part of the kit speaks: messages and their registry, handlers and
modules, the unit-of-work port, the caller's context, tracing and metrics, time and text."""
