"""The outbox: capture at commit, in-process dispatch, the processor, cleanup, administration."""
