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

.PHONY: all demo test test-slow test-browser lint bench clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/isthmus demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The dashboard in a real browser: Debian's chromium (installed here with apt, as root, when it is
# missing), driven by Playwright. `make test` runs the same test when chromium is present.
test-browser: $(STAMP)
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)
	$(BIN)/python -m pytest tests/integration/test_dashboard.py $(PYTEST_ARGS)

test-slow: $(STAMP)
	ISTHMUS_SLOW=1 $(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs build *.egg-info src/*.egg-info
