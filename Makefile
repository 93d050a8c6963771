# Two commands do everything on a fresh machine:
#   make demo   - set up, then run the main job (the training demo)
#   make check  - set up, then lint, type-check and run every test (then the torch-only lane)
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo check lint typecheck test test-torch test-torch-oldest test-fast bench plan clean

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

# The torch backend alone: no MindSpore and NumPy 2 (the numpy<2 pin is MindSpore's, not
# the core's or the torch backend's), in a second environment of its own.
TORCH_VENV := .venv-torch
TORCH_PIN := 2.13.0
TORCH_STAMP := $(TORCH_VENV)/.installed
$(TORCH_STAMP): pyproject.toml
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/pip install --quiet --upgrade pip
	PYTHONWARNINGS='ignore:Editable installation' $(TORCH_VENV)/bin/pip install --quiet \
		-e '.[torch,plot,test]' 'torch==$(TORCH_PIN)' 'numpy>=2'
	touch $(TORCH_STAMP)

demo: $(STAMP)
	$(BIN)/ppswap demo

check: lint typecheck test test-torch

lint: $(STAMP)
	$(BIN)/ruff check ppswap tests benchmarks examples
	$(BIN)/ruff format --check ppswap tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

# pytest exits 5 when it collected no tests: a broken suite here, so say so and fail.
test: $(STAMP)
	@$(BIN)/pytest -q -p no:cacheprovider; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

# The torch backend's tests, and those of the parts that need no tensor framework, where
# MindSpore is not installed and NumPy is 2.x.
TORCH_TESTS := tests/torch_backend tests/torch_dist tests/scheduler tests/docs \
	tests/runtime/test_demo.py tests/runtime/test_examples.py
test-torch: $(TORCH_STAMP)
	@$(TORCH_VENV)/bin/python -c "import importlib.util, numpy, sys; \
	major = int(numpy.__version__.split('.')[0]); \
	mindspore = importlib.util.find_spec('mindspore') is not None; \
	sys.exit(None if major >= 2 and not mindspore else \
	f'$(TORCH_VENV) must have numpy 2 and no MindSpore: numpy {numpy.__version__}, MindSpore {mindspore}')"
	@$(TORCH_VENV)/bin/pytest -q -p no:cacheprovider $(TORCH_TESTS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

# The same lane on the oldest torch ppswap supports, the GPU machine's (2.11.0: from PyPI, a
# CUDA build of several GB, which runs on the CPU here). Not part of check: run it before
# a session on the GPU machine (docs/gpu.md).
TORCH_OLDEST_VENV := .venv-torch-2.11
test-torch-oldest:
	$(MAKE) test-torch TORCH_VENV=$(TORCH_OLDEST_VENV) TORCH_PIN=2.11.0

# The development lane: every test not marked slow (tests/conftest.py says which are).
test-fast: $(STAMP)
	@$(BIN)/pytest -q -p no:cacheprovider -m "not slow"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

plan: $(STAMP)
	$(BIN)/ppswap plan --schedule gpipe --pp 4 --micro 8 --swap

# Everything a CUDA machine without internet needs beyond its own torch and numpy: pinned
# wheels of ppswap's other dependencies in .gpu_wheels/ (docs/gpu.md); then, there,
# bash benchmarks/gpu_run.sh
.PHONY: gpu-wheels
gpu-wheels: $(STAMP)
	PYTHON=$(BIN)/python bash benchmarks/gpu_wheels.sh

clean:
	rm -rf $(VENV) $(TORCH_VENV) $(TORCH_OLDEST_VENV) .mypy_cache .ruff_cache .pytest_cache
