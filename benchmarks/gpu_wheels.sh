#!/usr/bin/env bash
# Wheels of ppswap's dependencies other than torch and numpy, pinned to the versions this
# repository's environment runs, for a CUDA machine without internet (Python 3.12, which
# has torch and numpy), into .gpu_wheels/ (ignored by git; copy it there with the
# checkout). `make gpu-wheels` runs this.
#
#     bash benchmarks/gpu_wheels.sh
#
# structlog: ppswap's core imports it (with numpy and anyio). anyio, idna,
# typing_extensions: a fallback, which gpu_run.sh installs when the machine's own anyio is
# missing or outside ppswap's range (>=4.4,<5). Every wheel is py3-none-any. No
# dependencies are resolved (--no-deps): the list above is all of them on Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
dest=.gpu_wheels
mkdir -p "$dest"
"$python" -m pip download --quiet --only-binary=:all: --python-version 3.12 --no-deps \
    --dest "$dest" structlog==26.1.0 anyio==4.16.0 idna==3.20 typing_extensions==4.16.0
ls -1 "$dest"
