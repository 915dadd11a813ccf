#!/usr/bin/env bash
# Development helper: copy files that ruff reformatted/fixed in build/bake/order-service back
# into the template. Works for files whose only Jinja is `{{ cookiecutter.package_name }}`
# (substituted back); files with other Jinja must be edited by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 - <<'PY'
import re
from pathlib import Path

template = Path("{{cookiecutter.service_slug}}")
bake = Path("build/bake/order-service")
PACKAGE_VAR = "{{ cookiecutter.package_name }}"
for source in template.rglob("*.py"):
    relative = str(source.relative_to(template)).replace("{{cookiecutter.package_name}}", "order_service")
    baked = bake / relative
    if not baked.exists():
        continue
    text = source.read_text()
    other_jinja = re.sub(re.escape(PACKAGE_VAR), "", text)
    if "{{" in other_jinja or "{%" in other_jinja:
        continue
    restored = baked.read_text()
    if PACKAGE_VAR in text:
        restored = restored.replace("order_service", PACKAGE_VAR)
    if restored != text:
        source.write_text(restored)
        print(f"synced {source.relative_to(template)}")
PY
