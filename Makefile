# All set-up a fresh machine needs: `make demo` and `make test` build the environment first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

# What lint checks; CI (.ci/run) runs `make check`, so this file is its one definition.
LINT_PATHS := tracelake recorder store query tests benchmarks
# mypy reads the package as it is installed (tracelake.recorder, tracelake.store,
# tracelake.query): through a tree of links of that shape, so that calls between rooms
# are checked rather than typed as Any (mypy does not follow setuptools' package-dir).
MYPY_TREE := .mypy-tree

.PHONY: setup demo test bench lint check clean

# recorder/_hot.c (and any header beside it) is compiled by the editable install: a change
# to it needs a reinstall.
$(STAMP): pyproject.toml recorder/_hot.c $(wildcard recorder/*.h)
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

# pytest exits 5 when it collects no tests: make fails on it like on any failure.
test: $(STAMP)
	$(BIN)/python -m pytest -q

# Every benchmark behind the performance targets, one after another (~15 minutes); each
# one's whole output and the table of verdicts in $(BENCH_OUT).
BENCH_OUT ?= bench-results
bench: $(STAMP)
	$(BIN)/python benchmarks/targets.py --out $(BENCH_OUT)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)/tracelake
	ln -s $(CURDIR)/tracelake/*.py $(MYPY_TREE)/tracelake/
	for room in recorder store query; do ln -s $(CURDIR)/$$room $(MYPY_TREE)/tracelake/$$room; done
	cd $(MYPY_TREE) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p tracelake

# Everything CI checks: lint and the tests.
check: lint test

clean:
	rm -rf $(VENV) $(MYPY_TREE) .pytest_cache .mypy_cache .ruff_cache .hypothesis
