"""Validate every answer again before cookiecutter writes a single file.

The answers are normally checked right after the prompts (``hooks/validation.py``, loaded as a
Jinja extension); this hook covers the paths that skip the prompts (``--replay``). Answers are
read as data: they are rendered through ``tojson`` into a raw string literal (``tojson`` escapes
every ``'``, so the JSON text cannot close the literal) and parsed with ``json.loads``, so a
quote, a backslash or a newline in a free-text answer can never break or inject into this hook.
"""

from __future__ import annotations

import importlib.util
import json
import sys

ANSWERS = json.loads(
    r'''{{ {
        "service_name": cookiecutter.service_name,
        "service_slug": cookiecutter.service_slug,
        "package_name": cookiecutter.package_name,
        "description": cookiecutter.description,
        "author": cookiecutter.author,
        "broker": cookiecutter.broker,
        "include_example": cookiecutter.include_example,
        "python_version": cookiecutter.python_version,
    } | tojson }}'''
)
RULES = json.loads(r'''{{ answer_rules_path | tojson }}''')


def main() -> int:
    spec = importlib.util.spec_from_file_location("answer_rules", RULES)
    if spec is None or spec.loader is None:
        print(f"ERROR: cannot load the answer rules from {RULES}", file=sys.stderr)
        return 1
    rules = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rules)
    problems = rules.validate(ANSWERS)
    for problem in problems:
        print(f"ERROR: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
