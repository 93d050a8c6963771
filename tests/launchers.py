"""The launchers of one process per rank, for suites parametrized by launcher: ``torchrun``
(torch.distributed, gloo) and ``mpiexec`` (MPITransport), each run in a process group of
its own with a deadline (``process_group.run_group``).

A test takes its launcher as a parameter from ``launcher_params``: the ``mpiexec``
parameters are marked ``mpi`` and skipped where mpi4py or mpiexec is missing (the torch
lane has neither), the ``torchrun`` ones where torch.distributed is missing.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from process_group import REPO, Launch, run_group

__all__ = ["LAUNCHERS", "REPO", "Launch", "find_mpiexec", "launch", "launcher_param"]

LAUNCHERS = ("torchrun", "mpiexec")


def find_mpiexec() -> str | None:
    """The environment's ``mpiexec`` (mpich's wheel puts it beside Python), else PATH's."""
    beside_python = Path(sys.executable).with_name("mpiexec")
    return str(beside_python) if beside_python.exists() else shutil.which("mpiexec")


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # a parent package is missing
        return True


def launcher_param(launcher: str, *values: Any, marks: Sequence[Any] = (), id: str) -> Any:
    """A ``pytest.param`` of ``(launcher, *values)``, with the launcher's marks and skips."""
    if launcher == "mpiexec":
        needs = [
            pytest.mark.mpi,
            pytest.mark.skipif(_missing("mpi4py"), reason="no mpi4py"),
            pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found"),
        ]
    elif launcher == "torchrun":
        needs = [pytest.mark.skipif(_missing("torch.distributed"), reason="no torch.distributed")]
    else:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    return pytest.param(launcher, *values, marks=[*needs, *marks], id=id)


def launch(launcher: str, ranks: int, script: Path, *argv: str, timeout_s: float) -> Launch:
    """Run ``script argv...`` as ``ranks`` processes under ``launcher`` from the repository
    root; the whole process group is killed at the deadline (the test then fails)."""
    if launcher == "torchrun":
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(ranks),
            str(script),
            *argv,
        ]
        env = {"OMP_NUM_THREADS": "1"}
    elif launcher == "mpiexec":
        mpiexec = find_mpiexec()
        assert mpiexec is not None
        command = [mpiexec, "-n", str(ranks), sys.executable, str(script), *argv]
        env = {}
    else:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    what = f"{launcher} with {ranks} ranks: {script.name} {' '.join(argv)}"
    return run_group(command, env=env, timeout_s=timeout_s, what=what)
