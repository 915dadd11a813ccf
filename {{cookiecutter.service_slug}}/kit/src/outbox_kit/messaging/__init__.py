"""The message bus port, its transports, and the signed context headers."""
