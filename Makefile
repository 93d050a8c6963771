# Two commands do everything on a fresh machine:
#   make demo   - set up, then run the main job (the training demo)
#   make check  - set up, then lint, type-check and run every test once, in the lane that
#                 gives it meaning (the main lane in .venv, the torch-only lane in .venv-torch)
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo check check-jobs lint typecheck test test-main test-torch test-torch-oldest \
	test-fast bench plan clean

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
# After .venv's: both editable installs write ppswap.egg-info in the checkout, so under
# make -j they must not run at once.
$(TORCH_STAMP): pyproject.toml | $(STAMP)
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/pip install --quiet --upgrade pip
	PYTHONWARNINGS='ignore:Editable installation' $(TORCH_VENV)/bin/pip install --quiet \
		-e '.[torch,plot,test]' 'torch==$(TORCH_PIN)' 'numpy>=2'
	touch $(TORCH_STAMP)

demo: $(STAMP)
	$(BIN)/ppswap demo

# Two jobs at a time (CI has 2 cores): .venv-torch is set up while the lint, the type check
# and the main lane run, then the two lanes share the cores; each job's output is printed
# whole when it ends.
check:
	@$(MAKE) --no-print-directory --jobs=2 --output-sync=target check-jobs

# In this order, so that .venv-torch's set-up starts as soon as .venv is there.
check-jobs: test-torch lint typecheck test-main

lint: $(STAMP)
	$(BIN)/ruff check ppswap tests benchmarks examples
	$(BIN)/ruff format --check ppswap tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

# Every test in .venv. pytest exits 5 when it collected no tests: a broken suite here, so
# say so and fail.
test: $(STAMP)
	@$(BIN)/pytest -q -p no:cacheprovider; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

# The lanes of make check (tests/conftest.py's --lane). The main lane: every test the torch
# lane does not run.
test-main: $(STAMP)
	@$(BIN)/pytest -q -p no:cacheprovider --lane main; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

# The torch lane: the torch backend's tests, and those of the parts that need no tensor
# framework (tests/conftest.py's TORCH_LANE), where MindSpore is not installed and NumPy
# is 2.x.
test-torch: $(TORCH_STAMP)
	@$(TORCH_VENV)/bin/python -c "import importlib.util, numpy, sys; \
	major = int(numpy.__version__.split('.')[0]); \
	mindspore = importlib.util.find_spec('mindspore') is not None; \
	sys.exit(None if major >= 2 and not mindspore else \
	f'$(TORCH_VENV) must have numpy 2 and no MindSpore: numpy {numpy.__version__}, MindSpore {mindspore}')"
	@$(TORCH_VENV)/bin/pytest -q -p no:cacheprovider --lane torch; rc=$$?; \
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
