# All set-up a fresh machine needs: `make demo` and `make test` build the environment first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup demo test bench lint clean

# recorder/_hot.c is compiled by the editable install: a change to it needs a reinstall.
$(STAMP): pyproject.toml recorder/_hot.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU wheel on this disk. Installed later, a bare `torch`
	# requirement could pull a several-GB CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/tracelake demo --store demo.tl

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	-$(BIN)/python -m pip install --quiet -e ".[bench]"
	$(BIN)/python benchmarks/capture_overhead.py

lint: $(STAMP)
	$(BIN)/ruff check tracelake recorder store query tests benchmarks
	$(BIN)/mypy tracelake recorder store query

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
