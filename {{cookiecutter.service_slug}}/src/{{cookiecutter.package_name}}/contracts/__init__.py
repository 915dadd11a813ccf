"""Published language: the integration events bounded contexts exchange.

Contexts never import each other; a producer and its consumers share only these classes (and, on
a broker, only their names and JSON shapes). Each event has a stable, versioned name; change a
payload incompatibly by adding a ``.v2`` class and an upcaster, never by editing ``.v1``.
"""
