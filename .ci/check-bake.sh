#!/usr/bin/env bash
# Development helper, fast: re-render build/bake/order-service and lint it (ruff, format) plus
# the template's own hooks and tests. The full gate is `make test` / `.ci/run`.
set -euo pipefail
cd "$(dirname "$0")/.."
.ci/sync-bake.sh
(cd build/bake/order-service; .venv/bin/ruff check -q .; .venv/bin/ruff format --check -q .)
.venv/bin/ruff check -q hooks tests
.venv/bin/ruff format --check -q hooks tests
echo "bake and template lint clean"
