# Two commands do everything on a fresh machine:
#   make demo   - set up, then run the main job (the training demo)
#   make check  - set up, then lint, type-check and run every test
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo check lint typecheck test test-fast bench plan clean

# The editable install keeps setuptools' default (lenient) mode, so modules added to ppswap/
# are importable without reinstalling; that mode always ends with an informational
# "Editable installation." warning box, which the warnings filter below silences (and only
# it). editable_mode=strict prints a box of its own and misses new files; compat is
# deprecated and prints a deprecation box.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ppswap demo

check: lint typecheck test

lint: $(STAMP)
	$(BIN)/ruff check ppswap tests benchmarks examples
	$(BIN)/ruff format --check ppswap tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

# pytest exits 5 when it collected no tests: a broken suite here, so say so and fail.
test: $(STAMP)
	@$(BIN)/pytest -q -p no:cacheprovider; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

# The development lane: every test not marked slow (tests/conftest.py says which are).
test-fast: $(STAMP)
	@$(BIN)/pytest -q -p no:cacheprovider -m "not slow"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

plan: $(STAMP)
	$(BIN)/ppswap plan --schedule gpipe --pp 4 --micro 8 --swap

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
