"""The builders the composition root (``container.py``) wires: like it, the only code outside the
entrypoints that names concrete adapters. Each module builds one part of the service."""
