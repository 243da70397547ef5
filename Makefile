# One command to set up and run the demo, one to set up and run every test.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint setup clean bench proto soak image

# Under a lock: `make demo` and `make test` may run at once in a fresh clone.
$(BIN)/router: pyproject.toml
	$(PYTHON) scripts/setup-venv $(PYTHON) $(VENV) test

setup: $(BIN)/router

demo: setup
	$(BIN)/router demo

lint: setup
	$(BIN)/ruff check router tests bench
	$(BIN)/ruff format --check router tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

# With coverage, the `router serve` processes the tests start included; below
# the floor in pyproject.toml ([tool.coverage.report] fail_under) it fails.
# Then the same tests on the compiled build (setup.py, scripts/compiled): what
# `pip install` gives wherever a C compiler is.
test: lint
	ROUTER_EXPECT_COMPILED=0 $(BIN)/pytest --cov --cov-report=term
	$(BIN)/python scripts/compiled test -q

# The peers (bench/peers: LiteLLM, SGLang's and vLLM's routers, nginx, wrk) go
# into .cache/peers and need root for Debian's packages; the run needs wrk.
# The bench extras into the development venv, pure as scripts/setup-venv makes it
# (an editable install would otherwise compile the tree in place, and an edited
# module would no longer be what runs); bench/compare.py builds the compiled copy.
bench: setup
	ROUTER_COMPILE=0 $(BIN)/pip install --quiet -e '.[test,bench]'
	bench/peers
	$(BIN)/python bench/run.py

# 30 minutes of mixed load with replicas killed and hostile clients; checks that
# nothing grows or leaks (docs/performance.md). CI runs its 2-minute version.
soak: setup
	$(BIN)/python bench/soak.py

# The image (Containerfile) for router serve, scaler and ctl, with podman or
# docker; on a machine that reaches no registry, on a base made from Debian's
# packages (scripts/build-image says how). Prints the tag, router:<version>.
image:
	PYTHON=$(PYTHON) scripts/build-image

# router scaler's gRPC modules from router/scaler/externalscaler.proto (committed).
proto: setup
	PYTHON=$(BIN)/python scripts/gen-proto

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
