"""A job's checkpoints: after each completed step, everything its next step depends on.

``JobCheckpoints(root, job_id)`` keeps one folder per job, ``root/<job_id>/``, and in it
the checkpoint of the job's last completed step, ``step-<n>/`` (``n`` steps done):

- the tensors, in the backend's own format: every stage's parameters
  (``stage<i>.param<j>``), the optimizer's momentum buffers (``stage<i>.momentum<j>``,
  when it keeps them) and the framework's RNG state (``rng``): ``tensors.safetensors``
  (safetensors) for torch, ``tensors.ckpt`` (``mindspore.save_checkpoint``) for MindSpore;
- ``state.json``: the steps done, their losses and times, the batch stream's generator
  state (where the data order continues), the backend.

A checkpoint is written into ``step-<n>.partial/`` and renamed to ``step-<n>/`` once
complete (a rename is atomic), then the older ones are removed: a process killed at any
moment leaves its last complete checkpoint whole. ``latest()`` is the newest complete
one; ``restore`` puts it into a freshly built ``Training``, after which its next step
is the step an uninterrupted job would run next, bit for bit. The functions touch the
disk: call them on a worker thread.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ppswap.serve.training import Training

__all__ = ["Checkpoint", "JobCheckpoints"]

_STEP_DIR = re.compile(r"step-(\d+)")
_STATE_FILE = "state.json"
_FORMAT_VERSION = 1


class _TensorFormat(Protocol):
    """A backend's tensor file: save and load named tensors, its RNG state, copies."""

    file_name: str

    def save(self, tensors: Mapping[str, Any], path: Path) -> None: ...
    def load(self, path: Path) -> dict[str, Any]: ...
    def assign(self, param: Any, value: Any) -> None: ...
    def tensor(self, value: Any) -> Any: ...
    def rng_state(self) -> Any: ...
    def set_rng_state(self, value: Any) -> None: ...


class _Safetensors:
    """torch tensors in a safetensors file."""

    file_name = "tensors.safetensors"

    def __init__(self) -> None:
        self._torch: Any = importlib.import_module("torch")
        self._files: Any = importlib.import_module("safetensors.torch")

    def save(self, tensors: Mapping[str, Any], path: Path) -> None:
        self._files.save_file({k: v.detach().contiguous() for k, v in tensors.items()}, path)

    def load(self, path: Path) -> dict[str, Any]:
        return dict(self._files.load_file(path))

    def assign(self, param: Any, value: Any) -> None:
        with self._torch.no_grad():
            param.copy_(value)

    def tensor(self, value: Any) -> Any:
        return value

    def rng_state(self) -> Any:
        return self._torch.get_rng_state()

    def set_rng_state(self, value: Any) -> None:
        self._torch.set_rng_state(value)


class _MindSporeCheckpoint:
    """MindSpore tensors in MindSpore's own checkpoint file."""

    file_name = "tensors.ckpt"

    def __init__(self) -> None:
        self._ms: Any = importlib.import_module("mindspore")

    def save(self, tensors: Mapping[str, Any], path: Path) -> None:
        self._ms.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()], str(path))

    def load(self, path: Path) -> dict[str, Any]:
        return dict(self._ms.load_checkpoint(str(path)))

    def assign(self, param: Any, value: Any) -> None:
        param.set_data(self.tensor(value))

    def tensor(self, value: Any) -> Any:  # a Parameter as loaded -> a plain Tensor, same bits
        return self._ms.Tensor(value.asnumpy())

    def rng_state(self) -> Any:
        return self._ms.get_rng_state()

    def set_rng_state(self, value: Any) -> None:
        self._ms.set_rng_state(self.tensor(value))


def _tensor_format(backend: str) -> _TensorFormat:
    if backend == "torch":
        return _Safetensors()
    if backend == "mindspore":
        return _MindSporeCheckpoint()
    raise ValueError(f"backend must be torch or mindspore, got {backend!r}")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A complete checkpoint on disk: ``steps_done`` steps, their ``losses`` and
    ``step_times`` (one per step)."""

    path: Path
    steps_done: int
    losses: list[float]
    step_times: list[float]


class JobCheckpoints:
    """The checkpoints of job ``job_id`` under ``root`` (module docstring)."""

    def __init__(self, root: str | Path, job_id: str) -> None:
        self.folder = Path(root) / job_id

    def save(self, training: Training, losses: list[float], step_times: list[float]) -> Path:
        """Checkpoint ``training`` after its ``steps_done`` steps (``losses`` and
        ``step_times`` of those steps); removes the older checkpoints. Its folder."""
        steps = training.steps_done
        if len(losses) != steps or len(step_times) != steps:
            raise ValueError(
                f"losses and step_times must have one entry per step done ({steps}), "
                f"got {len(losses)} and {len(step_times)}"
            )
        files = _tensor_format(training.spec.backend)
        tensors: dict[str, Any] = {"rng": files.rng_state()}
        for i, stage in enumerate(training.stages):
            for j, param in enumerate(stage.parameters):
                tensors[f"stage{i}.param{j}"] = param
        for i, buffers in enumerate(training.momentum_buffers or []):
            for j, buffer in enumerate(buffers):
                tensors[f"stage{i}.momentum{j}"] = buffer
        state = {
            "format": _FORMAT_VERSION,
            "backend": training.spec.backend,
            "steps_done": steps,
            "losses": losses,
            "step_times": step_times,
            "data_rng": training.data.state,
        }
        final = self.folder / f"step-{steps:06d}"
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        files.save(tensors, partial / files.file_name)
        (partial / _STATE_FILE).write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in self.folder.iterdir():
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint, or None (no step completed, or none kept)."""
        if not self.folder.is_dir():
            return None
        complete = [
            (int(match.group(1)), path)
            for path in self.folder.iterdir()
            if (match := _STEP_DIR.fullmatch(path.name)) and (path / _STATE_FILE).is_file()
        ]
        if not complete:
            return None
        path = max(complete)[1]
        state = json.loads((path / _STATE_FILE).read_text())
        return Checkpoint(path, state["steps_done"], state["losses"], state["step_times"])

    def restore(self, training: Training, checkpoint: Checkpoint) -> None:
        """Put ``checkpoint`` into ``training`` (built from the same spec, no step run):
        weights, momentum buffers, the framework's RNG, the batch stream, steps done.
        ValueError if the checkpoint does not fit the training's stages."""
        state = json.loads((checkpoint.path / _STATE_FILE).read_text())
        backend = training.spec.backend
        if state["format"] != _FORMAT_VERSION or state["backend"] != backend:
            raise ValueError(
                f"checkpoint {checkpoint.path}: format {state['format']} of backend "
                f"{state['backend']!r}, expected format {_FORMAT_VERSION} of {backend!r}"
            )
        files = _tensor_format(backend)
        tensors = files.load(checkpoint.path / files.file_name)
        expected = {"rng"}
        for i, stage in enumerate(training.stages):
            expected |= {f"stage{i}.param{j}" for j in range(len(stage.parameters))}
        with_momentum = any(name.startswith("stage0.momentum") for name in tensors)
        if with_momentum:
            for i, stage in enumerate(training.stages):
                expected |= {f"stage{i}.momentum{j}" for j in range(len(stage.parameters))}
        if set(tensors) != expected:
            raise ValueError(
                f"checkpoint {checkpoint.path} holds {len(tensors)} tensors that do not fit "
                f"this job's {len(training.stages)} stages"
            )
        for i, stage in enumerate(training.stages):
            for j, param in enumerate(stage.parameters):
                value = tensors[f"stage{i}.param{j}"]
                if tuple(np.shape(value)) != tuple(np.shape(param)):
                    raise ValueError(
                        f"checkpoint {checkpoint.path}: stage{i}.param{j} has shape "
                        f"{tuple(np.shape(value))}, the job's {tuple(np.shape(param))}"
                    )
                files.assign(param, value)
        if with_momentum:
            training.momentum_buffers = [
                [files.tensor(tensors[f"stage{i}.momentum{j}"]) for j in range(len(s.parameters))]
                for i, s in enumerate(training.stages)
            ]
        files.set_rng_state(tensors["rng"])
        training.data.state = state["data_rng"]
        training.steps_done = state["steps_done"]
