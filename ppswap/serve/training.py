"""What a job trains: the demo LM (``ppswap.demo``) with an SGD step after every run.

``parse_job(body)`` checks a request's JSON object before anything starts: the keys are
``RunOptions``' own field names (``schedule``, ``pp``, ``micro_batch_num``, ``swap`` ...,
checked by ``RunOptions`` itself and, for the sizes, by the schedule's own checks) and the
job's (``JOB_FIELDS``: ``steps``, ``backend``, ``model``, ``lr``, ``momentum``, ``batch``,
``vpp``). A bad one is a ``JobInputError`` naming the field and the reason. ``Training``
builds the stages, the batch stream and the optimizer of a ``JobSpec`` and runs one
training step at a time; everything a step depends on (weights, momentum buffers, the
batch stream's generator) is state a checkpoint can take and give back
(``ppswap.serve.checkpoint``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import anyio
import numpy as np

from ppswap.actors.runtime import run_schedule
from ppswap.demo.run import (
    DEMO_LM_SIZES,
    DEMO_MODELS,
    DemoModel,
    LMShape,
    load_corpus,
    load_demo_model,
)
from ppswap.events import RunEvents
from ppswap.options import RunOptions
from ppswap.results import RunResult
from ppswap.stage import PipelineStage
from ppswap.swap import EmulatedDevice, swap_wrapper

__all__ = [
    "JOB_FIELDS",
    "MODEL_SIZES",
    "BatchStream",
    "JobInputError",
    "JobSpec",
    "Training",
    "parse_job",
    "saved_bytes_without_swap",
]

MODEL_SIZES: Mapping[str, Mapping[str, int]] = {
    "demo": DEMO_LM_SIZES,
    "tiny": {"seq": 8, "dim": 16, "heads": 2, "layers_per_stage": 1},
}
"""``model``: the demo LM's sizes, or a tiny one (tests, trying the service out)."""

JOB_FIELDS: Mapping[str, str] = {
    "steps": "training steps (runs), an int from 1 to 10000 (default 3)",
    "backend": f"the framework, one of {', '.join(DEMO_MODELS)} (default torch)",
    "model": f"the LM's size, one of {', '.join(MODEL_SIZES)} (default demo)",
    "lr": "the SGD learning rate, a number > 0 (default 0.05)",
    "momentum": "the SGD momentum, a number in [0, 1) (default 0: plain SGD)",
    "batch": "sequences per step, a multiple of micro_batch_num (default 4 per micro-batch)",
    "vpp": "stages per rank, an int >= 1 (default 2 for interleaved_1f1b, else 1)",
}
"""The job's own fields of a request, beside ``RunOptions``' (with what each allows)."""

# Options that are objects, not values: a service cannot take them from JSON.
_NOT_FROM_JSON = frozenset({"transport", "device", "mesh", "faults", "cost_model"})
_RUN_OPTIONS = frozenset(f.name for f in fields(RunOptions)) - _NOT_FROM_JSON
_DEFAULT_PP = 2
_MAX_STEPS = 10_000


class JobInputError(ValueError):
    """A request's field was refused: ``field`` names it, ``reason`` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A checked request: the run's options and the job's own fields; ``request``: the
    JSON object as given (what the job record keeps)."""

    options: RunOptions
    steps: int
    backend: str
    model: str
    lr: float
    momentum: float
    batch: int
    vpp: int
    request: Mapping[str, Any]

    @property
    def stage_num(self) -> int:
        return (self.options.pp or _DEFAULT_PP) * self.vpp


def _int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise JobInputError(name, f"{name} must be an int >= {low}, got {value!r}")
    if high is not None and value > high:
        raise JobInputError(name, f"{name} must be an int <= {high}, got {value!r}")
    return value


def _one_of(name: str, value: object, allowed: Mapping[str, Any]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise JobInputError(name, f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _field_of(message: str, given: Mapping[str, Any]) -> str:
    """The option a library error names: its first word, or the first given option its
    message mentions."""
    first = re.split(r"[\s=:,]", message, maxsplit=1)[0]
    if first in _RUN_OPTIONS or first in JOB_FIELDS:
        return first
    for name in sorted(given, key=len, reverse=True):
        if re.search(rf"\b{re.escape(name)}\b", message):
            return name
    return "options"


def parse_job(body: object) -> JobSpec:
    """The ``JobSpec`` of a request body (module docstring); ``JobInputError`` if not."""
    if not isinstance(body, dict):
        raise JobInputError("body", f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _RUN_OPTIONS - set(JOB_FIELDS))
    if unknown:
        name = unknown[0]
        if name in _NOT_FROM_JSON:
            raise JobInputError(name, f"{name} is an object, which a request cannot give")
        known = ", ".join(sorted(_RUN_OPTIONS | set(JOB_FIELDS)))
        raise JobInputError(name, f"{name} is not an option; the options are {known}")
    options_given = {k: v for k, v in body.items() if k in _RUN_OPTIONS}
    options_given.setdefault("micro_batch_num", 4)
    options_given.setdefault("pp", _DEFAULT_PP)
    try:
        options = RunOptions.of(**options_given)
    except (TypeError, ValueError) as exc:
        raise JobInputError(_field_of(str(exc), options_given), str(exc)) from exc
    steps = _int("steps", body.get("steps", 3), 1, _MAX_STEPS)
    backend = _one_of("backend", body.get("backend", "torch"), DEMO_MODELS)
    model = _one_of("model", body.get("model", "demo"), MODEL_SIZES)
    lr = body.get("lr", 0.05)
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr < float("inf"):
        raise JobInputError("lr", f"lr must be a number > 0, got {lr!r}")
    momentum = body.get("momentum", 0.0)
    if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0 <= momentum < 1:
        raise JobInputError("momentum", f"momentum must be a number in [0, 1), got {momentum!r}")
    micro = options.micro_batch_num
    batch = _int("batch", body.get("batch", 4 * micro), 1)
    if batch % micro:
        reason = f"batch must be a multiple of micro_batch_num={micro}, got {batch}"
        raise JobInputError("batch", reason)
    vpp = _int("vpp", body.get("vpp", 2 if options.schedule == "interleaved_1f1b" else 1), 1)
    pp = options.pp or _DEFAULT_PP
    try:  # the rules that depend on the sizes, before anything starts
        options.schedule_config(pp=pp, vpp=vpp, fsdp=False)
    except (TypeError, ValueError) as exc:
        raise JobInputError(_field_of(str(exc), {**options_given, "vpp": vpp}), str(exc)) from exc
    return JobSpec(
        options, steps, backend, model, float(lr), float(momentum), batch, vpp, dict(body)
    )


class BatchStream:
    """The job's batches of (tokens, next tokens), drawn one step at a time from ``text``
    by a numpy generator seeded with ``cfg.seed`` (the draws of ``ppswap.demo``'s
    ``lm_batches``). ``state`` is the generator's state (JSON-ready); setting it makes
    the next batch the one an uninterrupted stream would draw next."""

    def __init__(self, text: str, cfg: LMShape, batch: int) -> None:
        vocab = {ch: i for i, ch in enumerate(sorted(set(text)))}
        self._ids = np.array([vocab[ch] for ch in text], dtype=np.int32)
        self._seq = cfg.seq
        self._batch = batch
        self._rng = np.random.default_rng(cfg.seed)

    def next(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        starts = self._rng.integers(0, len(self._ids) - self._seq - 1, size=self._batch)
        x = np.stack([self._ids[s : s + self._seq] for s in starts])
        y = np.stack([self._ids[s + 1 : s + self._seq + 1] for s in starts])
        return x, y

    @property
    def state(self) -> dict[str, Any]:
        return dict(self._rng.bit_generator.state)

    @state.setter
    def state(self, value: Mapping[str, Any]) -> None:
        self._rng.bit_generator.state = dict(value)


class Training:
    """The stages, batches and optimizer of one job (built on a worker thread: it draws
    the weights). ``step(events)`` runs the next training step (``steps_done`` of them
    ran) on the stream's next batch, then the optimizer step of every stage: SGD with
    ``spec.momentum`` (``b = momentum * b + g``, ``p -= lr * b``; the buffers ``b``, one
    per parameter, are the optimizer's state, made at the first step; plain SGD keeps
    none). Returns the run's ``RunResult``."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.model: DemoModel = load_demo_model(spec.backend)
        self.model.prepare()
        text = load_corpus()
        cfg = self.model.config(vocab=len(set(text)), **MODEL_SIZES[spec.model])
        modules = self.model.build_stages(cfg, spec.stage_num)
        for module in modules:
            for index, layer in enumerate(module.layers):
                module.layers[index] = swap_wrapper(layer)
        self.stages = [PipelineStage(m, i, spec.stage_num) for i, m in enumerate(modules)]
        self.data = BatchStream(text, cfg, spec.batch)
        self.momentum_buffers: list[list[Any]] | None = None
        self.steps_done = 0

    async def step(self, events: RunEvents | None = None) -> RunResult:
        x, y = self.data.next()
        options = self.spec.options
        if options.swap and options.device is None:  # copies through the host, as the demo
            options = RunOptions.of(options, device=EmulatedDevice())
        result = await run_schedule(
            self.stages,
            inputs=x,
            targets=y,
            loss_fn=self.model.loss_fn,
            options=options,
            events=events,
        )
        if not options.forward_only:
            self._optimizer_step()
        self.steps_done += 1
        return result

    def _optimizer_step(self) -> None:
        momentum, lr = self.spec.momentum, self.spec.lr
        if momentum == 0:
            for stage in self.stages:
                self.model.sgd_step(stage.parameters, stage.grads, lr)
            return
        if self.momentum_buffers is None:  # b = g at the first step, as torch.optim.SGD
            # (g * 1.0: a tensor of the buffer's own, exactly g)
            self.momentum_buffers = [[g * 1.0 for g in stage.grads] for stage in self.stages]
        else:
            self.momentum_buffers = [
                [b * momentum + g for b, g in zip(buffers, stage.grads, strict=True)]
                for buffers, stage in zip(self.momentum_buffers, self.stages, strict=True)
            ]
        for buffers, stage in zip(self.momentum_buffers, self.stages, strict=True):
            self.model.sgd_step(stage.parameters, buffers, lr)


async def saved_bytes_without_swap(spec: JobSpec) -> list[int]:
    """Each rank's measured peak of saved activation bytes when the job's first step runs
    without swap: a twin of the job's stages (the same weights) runs it, forward and
    backward, and is dropped (the job's own stages are not touched). The sizes of saved
    activations depend on shapes, not values: the figure holds for every step."""
    twin_spec = replace(spec, options=RunOptions.of(spec.options, swap=False))
    twin = await anyio.to_thread.run_sync(Training, twin_spec)
    x, y = twin.data.next()
    result = await run_schedule(
        twin.stages, inputs=x, targets=y, loss_fn=twin.model.loss_fn, options=twin_spec.options
    )
    return [rank.peak_saved_bytes for rank in result.ranks]
