"""The service package: bounded contexts on top of the outbox/inbox building blocks.

`about` holds the answers the service was generated with; `container` is the composition root.
"""
