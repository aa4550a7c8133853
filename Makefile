# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# The virtual environment is built once and reused; torch is pinned to 2.13.0, the CPU build here
# (an unpinned torch would pull gigabytes of CUDA packages).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.isthmus-installed
TORCH  ?= torch==2.13.0
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-k parity -x"`.
PYTEST_ARGS ?=
# Test workers (pytest-xdist) for make test and test-integration. Most multi-process tests wait
# on sockets, heartbeats and timeouts rather than compute (a serial run keeps 2 cores about 40%
# busy), so 4 workers on 2 cores finish in about half the time; worksteal lets an idle worker
# take tests queued behind a long run on another. TEST_WORKERS=0 runs in one
# process (what -x, --pdb or reading one test's output in order want).
TEST_WORKERS ?= 4

.PHONY: all demo test test-deps test-unit test-integration test-slow test-browser lint bench bench-peers-env clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/isthmus demo

test: $(STAMP) test-deps
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# chromium, ping and nftables for the browser and lab tests, with apt where this runs as root
# (tools/test_deps.sh); without them those tests skip with their reason.
test-deps:
	@bash tools/test_deps.sh

# One process, no sockets or subprocesses (tests/unit/conftest.py refuses them): under a minute.
test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

# Gloo groups, servers, peer processes, network namespaces.
test-integration: $(STAMP) test-deps
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal tests/integration $(PYTEST_ARGS)

# The dashboard in a real browser: Debian's chromium (installed here with apt, as root, when it is
# missing), driven by Playwright. `make test` runs the same test when chromium is present.
test-browser: $(STAMP) test-deps
	$(BIN)/python -m pytest tests/integration/test_dashboard.py $(PYTEST_ARGS)

test-slow: $(STAMP)
	ISTHMUS_SLOW=1 $(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks tools

# benchmarks/peers.py (isthmus beside torchft and hivemind, docs/BENCHMARKS.md): a second venv
# with the other systems, pinned, and isthmus from this checkout. torch first and pinned, so that
# neither of them pulls another torch (an unpinned one brings gigabytes of CUDA).
PEERS_VENV ?= .venv-peers
PEERS_PKGS ?= torchft==0.2.0 hivemind==1.1.12
PEERS_STAMP := $(PEERS_VENV)/.peers-installed

$(PEERS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install --quiet "$(TORCH)"
	$(PEERS_VENV)/bin/python -m pip install --quiet "$(TORCH)" $(PEERS_PKGS)
	$(PEERS_VENV)/bin/python -m pip install --quiet "$(TORCH)" -e .
	$(PEERS_VENV)/bin/python -m pip freeze > $(PEERS_VENV)/freeze.txt
	touch $(PEERS_STAMP)

bench-peers-env: $(PEERS_STAMP)

clean:
	rm -rf $(VENV) $(PEERS_VENV) runs build *.egg-info src/*.egg-info
