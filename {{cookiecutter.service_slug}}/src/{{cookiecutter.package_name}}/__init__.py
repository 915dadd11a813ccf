"""The service package: bounded contexts on top of the outbox/inbox kit (``outbox_kit``).

`about` holds the answers the service was generated with; `container` is the composition root.
"""
