"""The kit suite's fixtures live in ``kit_support`` (tests import its helpers too)."""

pytest_plugins = ["kit_support"]
