"""``ppswap demo``: train a small transformer LM with pp ranks in one process, swap off and on.

The corpus ships with the package (``ppswap/data/corpus.txt``). The two trainings (swap off,
swap on) take their steps in turn; both start from the same weights and see the same
batches, so their losses must agree bit for bit; the demo checks that and prints, per rank,
the measured peak of saved activation bytes without and with swap next to what the planner
predicted, the step time and the exposed copy wait. It writes the schedule diagram (when
matplotlib is installed) and a Chrome trace.

The LM is written once per tensor framework (``DemoOptions.backend``): MindSpore
(``ppswap.demo.model``, the default) or torch (``ppswap.demo.model_torch``). Importing this
module imports neither; ``load_demo_model(backend)`` imports the chosen one (and with it
its framework: ``ModuleNotFoundError`` naming the framework when it is not installed).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ppswap.cli_args import install_hint
from ppswap.core.messages import HostArray
from ppswap.core.transport import Transport
from ppswap.demo.progress import Progress
from ppswap.demo.report import DemoReport, format_report
from ppswap.pipeline import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from ppswap.results import RunResult
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.diagram import load_plotter
from ppswap.scheduler.simulate import memory_table
from ppswap.stage import LossFn, PipelineStage
from ppswap.swap import EmulatedDevice, swap_wrapper

__all__ = [
    "DEMO_LM_SIZES",
    "DEMO_MODELS",
    "SCHEDULE_CLASSES",
    "DemoConfigError",
    "DemoModel",
    "DemoOptions",
    "LMShape",
    "TrainingPass",
    "lm_batches",
    "load_corpus",
    "load_demo_model",
    "run_demo",
    "train_in_turn",
]

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}
"""The schedule class of each ``--schedule`` name (both demos)."""

DEMO_MODELS: Mapping[str, str] = {
    "mindspore": "ppswap.demo.model",
    "torch": "ppswap.demo.model_torch",
}
"""``DemoOptions.backend`` -> the module of the demo LM written in that framework (each
has ``LMConfig``, ``build_lm_stages(cfg, stage_num)`` and ``cross_entropy_loss``)."""

DEMO_LM_SIZES: Mapping[str, int] = {"seq": 64, "dim": 128, "heads": 4, "layers_per_stage": 2}
"""The demo LM's sizes (its vocabulary is the corpus's characters): with the default batch
of 32 sequences in 8 micro-batches, the LM ``benchmarks/bench_memory.py`` and
``bench_cost.py`` measure, so what the demo prints can be read against
docs/benchmarks.md. Smaller chunks would show swap's fixed cost per saved tensor as a
larger share of the step than a real model's."""


class LMShape(Protocol):
    """The LM configuration the demo reads (each model module's ``LMConfig``)."""

    @property
    def vocab(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def layers_per_stage(self) -> int: ...
    @property
    def seed(self) -> int: ...


SgdStep = Callable[[Sequence[Any], Sequence[Any], float], None]
"""``sgd_step(parameters, grads, lr)``: ``p -= lr * g`` in place, for aligned sequences."""


@dataclass(frozen=True, slots=True)
class DemoModel:
    """The framework-specific parts of the demo, for one backend (``load_demo_model``).

    ``config(**sizes)`` makes the LM configuration; ``build_stages(cfg, stage_num)``
    returns the stage modules (each with a mutable ``layers`` list) with deterministic
    weights; ``loss_fn`` is the next-token cross entropy; ``sgd_step`` updates the
    parameters in place; ``prepare()`` sets the framework up for a run (MindSpore:
    PyNative mode on the CPU).
    """

    backend: str
    config: Callable[..., LMShape]
    build_stages: Callable[[Any, int], Sequence[Any]]
    loss_fn: LossFn
    sgd_step: SgdStep
    prepare: Callable[[], None]


def _set_data_sgd_step(parameters: Sequence[Any], grads: Sequence[Any], lr: float) -> None:
    """SGD on MindSpore parameters: ``set_data(p - lr * g)``."""
    for param, grad in zip(parameters, grads, strict=True):
        param.set_data(param - lr * grad)


def _mindspore_on_cpu(mindspore: Any) -> None:
    """PyNative mode on CPU (``set_device``: ``set_context(device_target=...)`` logs a
    deprecation warning in MindSpore 2.10)."""
    if mindspore.get_context("device_target") != "CPU":  # set_device raises once a kernel ran
        mindspore.set_device("CPU")
    mindspore.set_context(mode=mindspore.PYNATIVE_MODE)


def _nothing_to_prepare() -> None:
    return None


@functools.cache
def load_demo_model(backend: str) -> DemoModel:
    """The demo LM of ``backend`` (a key of ``DEMO_MODELS``); imports its framework.

    ValueError naming ``backend`` when it is not one of ``DEMO_MODELS``;
    ``ModuleNotFoundError`` (its ``name`` the framework's) when the framework is missing.
    """
    if backend not in DEMO_MODELS:
        raise ValueError(f"backend must be one of {', '.join(DEMO_MODELS)}, got {backend!r}")
    module = importlib.import_module(DEMO_MODELS[backend])
    if backend == "mindspore":
        mindspore = importlib.import_module("mindspore")
        return DemoModel(
            backend=backend,
            config=module.LMConfig,
            build_stages=module.build_lm_stages,
            loss_fn=module.cross_entropy_loss,
            sgd_step=_set_data_sgd_step,
            prepare=functools.partial(_mindspore_on_cpu, mindspore),
        )
    return DemoModel(
        backend=backend,
        config=module.LMConfig,
        build_stages=module.build_lm_stages,
        loss_fn=module.cross_entropy_loss,
        sgd_step=module.sgd_step,
        prepare=_nothing_to_prepare,
    )


class DemoConfigError(ValueError):
    """An option that does not fit where the demo runs, found when it starts, before any
    training (under MPI: ``pp`` other than the world size)."""


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What the demo runs; a bad size, batch or transport raises ValueError (naming it) on
    construction (a bad schedule configuration does when ``run_demo`` starts, before any
    training; ``ppswap demo`` checks it first)."""

    schedule: str = "gpipe"
    pp: int = 4
    vpp: int = 1
    micro: int = 8
    batch: int = 32
    steps: int = 3
    lr: float = 0.05
    out_dir: Path = Path("out")
    plot: bool = True
    fsdp: bool = False
    transport: str = "inprocess"
    backend: str = "mindspore"

    def __post_init__(self) -> None:
        if self.backend not in DEMO_MODELS:
            raise ValueError(
                f"backend must be one of {', '.join(DEMO_MODELS)}, got {self.backend!r}"
            )
        if self.schedule not in SCHEDULE_CLASSES:
            raise ValueError(
                f"schedule must be one of {', '.join(SCHEDULE_CLASSES)}, got {self.schedule!r}"
            )
        for name in ("pp", "vpp", "micro", "batch", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.batch % self.micro:
            raise ValueError(
                f"batch must be divisible by micro={self.micro}, got batch={self.batch}"
            )
        if self.transport not in LAUNCHERS and self.transport != "inprocess":
            raise ValueError(
                f"transport must be 'inprocess', 'mpi' or 'torch', got {self.transport!r}"
            )


def load_corpus() -> str:
    return resources.files("ppswap").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def lm_batches(
    text: str, cfg: LMShape, batch: int, steps: int
) -> list[tuple[HostArray, HostArray]]:
    """``steps`` batches of (tokens, next tokens) drawn from ``text`` (seeded by cfg.seed)."""
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = np.array([index[ch] for ch in text], dtype=np.int32)
    rng = np.random.default_rng(cfg.seed)
    out: list[tuple[HostArray, HostArray]] = []
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - cfg.seq - 1, size=batch)
        x = np.stack([ids[s : s + cfg.seq] for s in starts])
        y = np.stack([ids[s + 1 : s + cfg.seq + 1] for s in starts])
        out.append((x, y))
    return out


LAUNCHERS: Mapping[str, str] = {"mpi": "mpiexec -n", "torch": "torchrun --nproc-per-node"}
"""The transports of one process per rank -> the launcher option that sets the world size."""
TORCH_DEMO_TIMEOUT_S = 300.0
"""The deadline of every torch.distributed operation of the demo (a step takes seconds)."""


def mpi_transport() -> Transport:
    """An MPITransport for this process (``mpiexec -n PP ppswap demo --transport mpi``).

    Its module is looked up by name here, not imported at the top: importing mpi4py's MPI
    initializes MPI, which only an MPI run should do.
    """
    transport: Transport = importlib.import_module("ppswap.transports.mpi").MPITransport()
    return transport


class ClosingTransport(Transport, Protocol):
    """A transport the demo closes when it ends (``TorchDistTransport``)."""

    def close(self) -> None: ...


def torch_transport() -> ClosingTransport:
    """A TorchDistTransport for this process (``torchrun --nproc-per-node PP -m ppswap.cli
    demo --transport torch``), over gloo; it initializes torch.distributed from
    torchrun's environment. Looked up by name, as ``mpi_transport``: only such a run
    imports torch.distributed."""
    module = importlib.import_module("ppswap.backends.torch.distributed")
    transport: ClosingTransport = module.TorchDistTransport(timeout_s=TORCH_DEMO_TIMEOUT_S)
    return transport


class _Schedule(Protocol):
    def run(
        self, inputs: Any, targets: Any = None, *, trace: str | Path | None = None
    ) -> RunResult: ...


@dataclass
class TrainingPass:
    """One of a demo's two trainings (swap off or on): its own stages, schedule and
    record. Both start from the same weights and see the same batches."""

    swap: bool
    stages: list[PipelineStage]
    schedule: _Schedule
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    result: RunResult | None = None

    @property
    def label(self) -> str:
        return "swap on" if self.swap else "swap off"


def train_in_turn(
    passes: Sequence[TrainingPass],
    data: Sequence[tuple[HostArray, HostArray]],
    *,
    trace_of: Callable[[TrainingPass], Path],
    update: Callable[[PipelineStage], None],
    report: Callable[[int], None],
) -> None:
    """Train every pass on ``data``, step by step in turn (which goes first alternates),
    so their step times are taken side by side rather than minutes apart. After each of
    a pass's steps ``update`` runs on each of its stages (the optimizer step); after each
    step of all of them, ``report(steps_done)``. The last step writes ``trace_of(pass)``."""
    last = len(data) - 1
    for step, (x, y) in enumerate(data):
        for run in passes if step % 2 == 0 else passes[::-1]:
            result = run.schedule.run(x, targets=y, trace=trace_of(run) if step == last else None)
            run.losses.append(result.loss)
            run.step_times.append(result.step_time_s)
            run.result = result
            for stage in run.stages:
                update(stage)
        report(step + 1)


def _build_pass(
    opts: DemoOptions, model: DemoModel, cfg: LMShape, swap: bool, transport: Transport | None
) -> TrainingPass:
    stage_num = opts.pp * opts.vpp
    modules = model.build_stages(cfg, stage_num)
    for module in modules:
        for index, layer in enumerate(module.layers):
            module.layers[index] = swap_wrapper(layer)
    rank = getattr(transport, "rank", None)
    stages = [
        PipelineStage(m, i, stage_num)
        for i, m in enumerate(modules)
        if rank is None or i % opts.pp == rank  # under MPI: this process's stages only
    ]
    schedule = SCHEDULE_CLASSES[opts.schedule](
        stages,
        opts.micro,
        loss_fn=model.loss_fn,
        swap=swap,
        pp=opts.pp if opts.vpp > 1 or transport is not None else None,
        device=EmulatedDevice(),
        transport=transport,
    )
    return TrainingPass(swap, stages, schedule)


def _train(
    opts: DemoOptions,
    model: DemoModel,
    cfg: LMShape,
    data: list[tuple[HostArray, HostArray]],
    transport: Transport | None,
) -> tuple[TrainingPass, TrainingPass]:
    """Both trainings, step by step in turn (``train_in_turn``)."""
    passes = (
        _build_pass(opts, model, cfg, False, transport),
        _build_pass(opts, model, cfg, True, transport),
    )
    rank = getattr(transport, "rank", None)
    suffix = "" if rank is None else f"_rank{rank}"
    reports = not rank  # under MPI only rank 0 reports

    progress = Progress(sys.stderr, len(data))

    def report(done: int) -> None:
        if not reports:
            return
        times = ", ".join(f"{run.label} {run.step_times[-1]:.2f}s" for run in passes)
        progress.show(done, f"loss {passes[0].losses[-1]:.4f} ({times})")

    if reports:
        progress.show(0, "running...")
    train_in_turn(
        passes,
        data,
        trace_of=lambda run: (
            opts.out_dir / f"trace_{'swap' if run.swap else 'noswap'}{suffix}.json"
        ),
        update=lambda stage: model.sgd_step(stage.parameters, stage.grads, opts.lr),
        report=report,
    )
    if reports:
        progress.close()
    return passes


def run_demo(opts: DemoOptions, transport: Transport | None = None) -> DemoReport:
    """Train without and with swap, step by step in turn. With an MPI ``transport`` this
    process runs its own rank's stages; every process gets the whole report back. The LM
    is written in ``opts.backend``'s framework (``load_demo_model``)."""
    model = load_demo_model(opts.backend)
    model.prepare()
    world = getattr(transport, "world_size", opts.pp)
    if world != opts.pp:
        launcher = LAUNCHERS[opts.transport]
        raise DemoConfigError(
            f"pp={opts.pp} must equal the world size {world} ({launcher} {world}): launch "
            f"with {launcher} {opts.pp}, or pass --pp {world}"
        )
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    text = load_corpus()
    cfg = model.config(vocab=len(set(text)), **DEMO_LM_SIZES)
    data = lm_batches(text, cfg, opts.batch, opts.steps)
    config = ScheduleConfig(
        schedule=opts.schedule,  # type: ignore[arg-type]
        pp=opts.pp,
        vpp=opts.vpp,
        micro=opts.micro,
        swap=True,
    )
    quiet = bool(getattr(transport, "rank", 0))  # under MPI only rank 0 reports
    if not quiet:
        print(
            f"ppswap demo: {opts.schedule} pp={opts.pp} vpp={opts.vpp} micro={opts.micro}, "
            f"{opts.backend} char LM ({cfg.layers_per_stage} blocks/stage, dim {cfg.dim}), "
            f"{opts.steps} steps",
            file=sys.stderr,
        )
        print(
            f"  {opts.pp * opts.vpp} stages, {opts.steps} steps, each trained with swap off "
            "and with swap on in turn (the first step warms up)",
            file=sys.stderr,
        )
    off, on = _train(opts, model, cfg, data, transport)
    assert off.result is not None and on.result is not None
    predicted = memory_table(config)
    if opts.plot and not quiet:
        _plot(config, opts.out_dir / f"schedule_{opts.schedule}.png")
    return DemoReport(
        off.losses, on.losses, off.result, on.result, predicted, off.step_times, on.step_times
    )


def _plot(config: ScheduleConfig, path: Path) -> None:
    plot_schedule = load_plotter()
    if plot_schedule is None:
        print(f"  (matplotlib not installed: no diagram; {install_hint('plot')})")
        return
    plot_schedule(config, path)
    print(f"  schedule diagram: {path}")


def main_demo(opts: DemoOptions) -> int:
    """Run the demo of ``opts`` and print its report (under MPI or torchrun, rank 0 does);
    0 when swap on and off gave the same losses, else 1. A torch.distributed transport is
    closed at the end, whatever happened."""
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        transport: Transport | None = None
        if opts.transport == "mpi":
            transport = mpi_transport()
        elif opts.transport == "torch":
            closing = torch_transport()
            stack.callback(closing.close)
            transport = closing
        report = run_demo(opts, transport)
    if getattr(transport, "rank", 0):
        return 0 if report.losses_no_swap == report.losses_swap else 1
    print(format_report(report))
    suffix = "" if transport is None else "_rank*"
    print(
        f"traces: {opts.out_dir}/trace_noswap{suffix}.json, {opts.out_dir}/trace_swap{suffix}.json"
    )
    print(f"done in {time.perf_counter() - started:.1f}s")
    return 0 if report.losses_no_swap == report.losses_swap else 1
