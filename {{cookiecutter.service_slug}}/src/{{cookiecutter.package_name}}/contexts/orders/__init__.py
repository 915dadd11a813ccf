"""Example bounded context: orders. Copy its shape for your own contexts."""
