#!/usr/bin/env bash
# Development helper: re-render the template into build/bake/order-service without touching its .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
.venv/bin/cookiecutter --no-input --output-dir "$tmp" . "$@" >/dev/null
mkdir -p build/bake/order-service
rsync -a --delete --exclude .venv --exclude '*.db*' --exclude .mypy_cache --exclude .ruff_cache --exclude .pytest_cache "$tmp/order-service/" build/bake/order-service/
rm -rf "$tmp"
