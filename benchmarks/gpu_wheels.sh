#!/usr/bin/env bash
# Fetch here, for the lent GPU machine's Python 3.12, the pure-Python wheels it lacks, into
# .gpu_wheels/ (ignored by git; the device call carries it: carry [".gpu_wheels"]).
#
#     bash benchmarks/gpu_wheels.sh
#
# structlog: ppswap's core imports it (with numpy and anyio) and that machine has none.
# anyio, idna, typing_extensions: a fallback only, which gpu_run.sh installs when the
# machine's own anyio is missing or outside ppswap's range (>=4.4,<5). Every wheel is
# py3-none-any, pinned to the version this project's .venv runs. No dependencies are
# resolved (--no-deps): the list above is all of them on Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
dest=.gpu_wheels
mkdir -p "$dest"
"$python" -m pip download --quiet --only-binary=:all: --python-version 3.12 --no-deps \
    --dest "$dest" structlog==26.1.0 anyio==4.16.0 idna==3.20 typing_extensions==4.16.0
ls -1 "$dest"
