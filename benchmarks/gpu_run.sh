#!/usr/bin/env bash
# The GPU check on a CUDA machine (docs/gpu.md), from the repository root:
#
#     bash benchmarks/gpu_run.sh [gpu_check.py options]
#
# Needs .gpu_wheels/ (`make gpu-wheels` on a machine with internet, copied with the
# checkout) where the machine's Python lacks structlog or a suitable anyio. Picks $PYTHON
# or the first python3 / python that imports torch; installs from the wheels only what
# that Python lacks into a scratch folder put first on PYTHONPATH, with the repository
# (ppswap is pure Python and is not installed); runs benchmarks/gpu_check.py writing into
# $OUT or out/gpu_check, and a copy of its output into gpu_check.log there. Bounded: the
# check starts no section after 240 s, and the command is stopped at GPU_CHECK_TIMEOUT_S
# (default 290 s). Exits with the check's status.
#
# GPU_RUN_PEER=1: afterwards, benchmarks/bench_torch_peer.py on the machine's CPUs (gloo,
# no GPU), once on every core and once held to two (--cores 2), into torch_peer_all.* and
# torch_peer_2cpu.* there, each stopped at 90 s, with GPU_RUN_PEER_OPTIONS added (say
# "--model wide"): how ppswap's step over torch.distributed.pipelining's depends on the
# cores a rank has.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-$repo/out/gpu_check}"
wheels="$repo/.gpu_wheels"
mkdir -p "$out"

py=""
for candidate in ${PYTHON:-} python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
        py="$candidate"
        break
    fi
done
if [ -z "$py" ]; then
    echo "gpu_run: no python that imports torch (set PYTHON)" >&2
    exit 1
fi

need=()
"$py" -c "import structlog" >/dev/null 2>&1 || need+=(structlog)
if ! "$py" -c '
import importlib.metadata as m, sys
major, minor = (int(p) for p in m.version("anyio").split(".")[:2])
sys.exit(0 if (4, 4) <= (major, minor) < (5, 0) else 1)' >/dev/null 2>&1; then
    need+=(anyio idna typing_extensions)
fi

deps="$(mktemp -d)"
trap 'rm -rf "$deps"' EXIT
for name in ${need[@]+"${need[@]}"}; do
    wheel="$(ls "$wheels/$name"-*.whl 2>/dev/null | head -n 1)"
    if [ -z "$wheel" ]; then
        echo "gpu_run: $py lacks $name and $wheels has no wheel of it:" \
            "run make gpu-wheels on a machine with internet and copy .gpu_wheels here" >&2
        exit 1
    fi
    if ! "$py" -m pip install --quiet --no-index --no-deps --target "$deps" "$wheel" \
        >/dev/null 2>&1; then
        "$py" -m zipfile -e "$wheel" "$deps"  # no pip: a pure-Python wheel is a zip
    fi
    echo "gpu_run: installed $(basename "$wheel")"
done

"$py" -c 'import sys, torch, numpy
print("gpu_run:", sys.executable, sys.version.split()[0], "torch", torch.__version__,
      "cuda", torch.cuda.is_available(), "numpy", numpy.__version__)'
limit=()
command -v timeout >/dev/null 2>&1 && limit=(timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-290}")
PYTHONPATH="$deps:$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    ${limit[@]+"${limit[@]}"} "$py" "$repo/benchmarks/gpu_check.py" --out "$out" "$@" 2>&1 \
    | tee "$out/gpu_check.log"
status="${PIPESTATUS[0]}"

if [ "${GPU_RUN_PEER:-0}" = "1" ]; then
    for run in "all:" "2cpu:--cores 2"; do
        name="${run%%:*}"
        # shellcheck disable=SC2086  # the options split into words on purpose
        PYTHONPATH="$deps:$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
            "$py" "$repo/benchmarks/bench_torch_peer.py" ${run#*:} ${GPU_RUN_PEER_OPTIONS:-} \
            --timeout-s 90 --json "$out/torch_peer_$name.json" >"$out/torch_peer_$name.md" 2>&1
        echo "gpu_run: bench_torch_peer ($name) exited $?: $(tail -n 3 "$out/torch_peer_$name.md" | head -n 1)"
    done
fi
exit "$status"
