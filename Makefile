# outbox-service template: the two README commands and the development loop.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BAKE_DIR ?= build/bake
DEMO_DIR := build/demo
SLUG := order-service

.DEFAULT_GOAL := help
.PHONY: help demo test test-fast bake bake-check lock lint clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

# A virtual environment $(1) with the locked requirements file $(2) (`make lock` compiles each
# *.lock from its *.txt, which holds the floors and ceilings).
define tools_venv
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
		echo "error: the template needs Python 3.11 or newer; '$(PYTHON)' is $$($(PYTHON) --version 2>&1)." \
		"Run: make $(MAKECMDGOALS) PYTHON=python3.11" >&2; exit 1; }
	@$(PYTHON) -m venv $(1) || { echo "error: '$(PYTHON) -m venv' failed; on Debian/Ubuntu install python3-venv" >&2; exit 1; }
	$(1)/bin/python -m pip install --quiet --disable-pip-version-check -r $(2)
endef

$(BIN)/.installed: requirements-dev.lock
	$(call tools_venv,$(VENV),requirements-dev.lock)
	touch $@

# The demo needs only cookiecutter and uv, not the template's test toolchain.
DEMO_TOOLS := build/demo-tools
$(DEMO_TOOLS)/bin/.installed: requirements-demo.lock
	$(call tools_venv,$(DEMO_TOOLS),requirements-demo.lock)
	touch $@

demo: $(DEMO_TOOLS)/bin/.installed ## generate a service with the defaults and run it (SQLite + in-process bus)
	rm -rf $(DEMO_DIR)
	$(DEMO_TOOLS)/bin/cookiecutter --no-input --output-dir $(DEMO_DIR) .
	PATH="$(CURDIR)/$(DEMO_TOOLS)/bin:$$PATH" $(MAKE) -C $(DEMO_DIR)/$(SLUG) install migrate run

# Four workers on two cores: most of the suite waits on real processes and servers (the generated
# service's tiers, the kit's broker tests: a part of the kit's suite keeps 40% of a core busy), so
# more tests at once fill the waits. `.ci/run` on a quiet machine: 23.4 min with two workers,
# 19.5 with three, 18.3 with four (both cores 87% busy over the run). The long tests come first
# (tests/conftest.py) and tests are handed out one at a time (each worker holds the test it runs
# and one more), so the long ones split between the workers and all end together; by default
# pytest-xdist hands each worker a quarter of its share at once, all the long tests to one of
# them. Each worker builds the bakes it needs. WORKERS=0 runs the tests one after another.
WORKERS ?= 4

test: $(BIN)/.installed ## every tier of the template's tests (service-backed ones where services answer)
	$(BIN)/python -m pytest $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --maxschedchunk 1)

# The quick loop: lint, types and layers of the kit and of every variant, the renders, the hooks,
# the kit's unit tier and its dependency floors; not the long tests (the kit's suite against
# the services, the generated suites). About 1.5 minutes on two cores once the environments exist.
test-fast: $(BIN)/.installed ## the quick loop: the kit's checks and unit tier, render and hook tiers
	$(BIN)/python -m pytest -m "(kit or render or hooks) and not long" -n 2 --maxschedchunk 1

bake: $(BIN)/.installed ## bake the defaults into $(BAKE_DIR) (add ARGS='broker=nats' to override)
	rm -rf $(BAKE_DIR)
	$(BIN)/cookiecutter --no-input --output-dir $(BAKE_DIR) . $(ARGS)

bake-check: bake ## bake, install, then lint, type-check and test the baked service
	PATH="$(CURDIR)/$(BIN):$$PATH" $(MAKE) -C $(BAKE_DIR)/$(SLUG) install lint typecheck test

lock: $(BIN)/.installed ## refresh the locks: the service's and the kit's uv.lock, the template's tools (UPGRADE=1: newer versions)
	$(BIN)/python tools/lock_service.py --uv $(CURDIR)/$(BIN)/uv $(if $(UPGRADE),--upgrade)
	for tools in dev demo; do \
		$(BIN)/uv pip compile --quiet --universal --python-version 3.11 $(if $(UPGRADE),--upgrade) \
			requirements-$$tools.txt -o requirements-$$tools.lock; done

lint: $(BIN)/.installed ## lint the template's own Python (hooks and tests)
	$(BIN)/ruff check hooks tests
	$(BIN)/ruff format --check hooks tests

clean: ## remove the virtual environment and baked projects
	rm -rf $(VENV) build .pytest_cache
