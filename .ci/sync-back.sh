#!/usr/bin/env bash
# Development helper: copy files that ruff reformatted/fixed in build/bake/order-service back
# into the template, for template files that hold no Jinja (their baked copy is identical).
set -euo pipefail
cd "$(dirname "$0")/.."
tpl='{{cookiecutter.service_slug}}'
bake=build/bake/order-service
find "$tpl" -type f -name '*.py' | while read -r src; do
  rel=${src#"$tpl"/}
  rel_baked=${rel//\{\{cookiecutter.package_name\}\}/order_service}
  [ -f "$bake/$rel_baked" ] || continue
  if ! grep -q '{{\|{%' "$src"; then
    cmp -s "$src" "$bake/$rel_baked" || { cp "$bake/$rel_baked" "$src"; echo "synced $rel"; }
  fi
done
