"""``ppswap demo``: its options, checked before anything is built, and its run.

``demo_config`` checks every option without importing a tensor framework; the demo's
modules (``ppswap.demo.run``, ``ppswap.demo.fsdp_demo``) are looked up by name
(``importlib.import_module``) only to run one, so a refused demo never imports one.
``add_demo_parser`` registers the subcommand on ``ppswap``'s parser (``ppswap.cli``).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ppswap.cli_args import VPP_HELP, fail, install_hint, vpp_of
from ppswap.scheduler.config import SCHEDULE_NAMES, ScheduleConfig

__all__ = [
    "DEMO_BACKENDS",
    "DEMO_DEFAULTS",
    "DEMO_FSDP_DP",
    "DEMO_MOE_DP",
    "DEMO_TRANSPORTS",
    "add_demo_parser",
    "demo_backend",
    "demo_config",
    "run_demo_command",
]

DEMO_FSDP_DP = 2
"""The data-parallel degree of ``ppswap demo --fsdp``."""
DEMO_MOE_DP = 2
"""The data-parallel degree of ``ppswap demo --moe`` (one EP group of 2 replicas; a test
checks it against ``ppswap.demo.moe_demo.MOE_DP``)."""
DEMO_DEFAULTS: Mapping[str, int | str] = {
    "schedule": "gpipe",
    "pp": 4,
    "micro": 8,
    "batch": 32,
    "steps": 3,
    "out": "out",
    "transport": "inprocess",
    "backend": "mindspore",
}
"""The defaults of ``ppswap demo``'s options: ``DemoOptions``' own (a test checks that
they agree; they are repeated here so that the CLI does not import the demo, and with it
MindSpore, before it runs one)."""
DEMO_TRANSPORTS: Mapping[str, str] = {
    "inprocess": "every rank in this process",
    "mpi": "one process per rank, under mpiexec -n PP",
    "torch": "one process per rank over torch.distributed (gloo), under torchrun "
    "--nproc-per-node PP; the torch LM",
}
"""The values of ``ppswap demo --transport``, each with what it runs."""
DEMO_BACKENDS: Mapping[str, str] = {"mindspore": "MindSpore", "torch": "torch"}
"""The values of ``ppswap demo --backend`` (``ppswap.demo.run.DEMO_MODELS``' keys; a test
checks that they agree) -> the framework's name in the error when it is not installed.
The key is also the framework's top-level package."""
DEMO_MODULE = "ppswap.demo.run"
"""The demo's module, imported by name when a demo runs."""
FSDP_DEMO_MODULE = "ppswap.demo.fsdp_demo"
"""The FSDP demo's module (``--fsdp``), imported by name when it runs."""
MOE_DEMO_MODULE = "ppswap.demo.moe_demo"
"""The MoE demo's module (``--moe``), imported by name when it runs."""


def _make_out_dir(out: str) -> None:
    """Create the demo's output folder (and its parents) now, so that a bad ``--out``
    fails before anything is built; ValueError naming the option when it cannot be."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"out must be a folder that can be created, got {out!r} ({exc.strerror})"
        ) from exc


def _check_count(name: str, value: object) -> None:
    """ValueError unless ``value`` is an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def demo_backend(args: argparse.Namespace) -> str:
    """``--backend``, or its default: torch with ``--transport torch`` or ``--moe``, else
    mindspore."""
    if args.backend is not None:
        return str(args.backend)
    if args.transport == "torch" or args.moe:
        return "torch"
    return str(DEMO_DEFAULTS["backend"])


def demo_config(args: argparse.Namespace) -> ScheduleConfig:
    """Check every option of ``ppswap demo`` and return its schedule configuration.

    Imports no tensor framework and builds nothing (it only creates the ``--out``
    folder). Raises ValueError (or TypeError) naming the option, its value and what is
    allowed: ``backend`` one of ``DEMO_BACKENDS``, the schedule configuration
    (``ScheduleConfig``: sizes >= 1, vpp against the schedule, micro a multiple of pp for
    interleaved_1f1b), ``batch`` and ``steps`` >= 1, ``batch`` divisible by ``micro`` (by
    ``micro * 2`` with ``--fsdp``, whose batch is split over dp=2 replicas), ``--fsdp``
    only in one process and with the mindspore backend, ``--transport torch`` only with the
    torch backend, ``--moe`` only in one process, on torch, without ``--fsdp`` and with
    ``batch`` divisible by ``micro * 2``, ``--out`` a folder.
    """
    backend = demo_backend(args)
    if backend not in DEMO_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(DEMO_BACKENDS)}, got {backend!r}")
    if args.transport == "torch" and backend != "torch":
        raise ValueError(
            f"backend must be 'torch' with --transport torch (torch.distributed moves the "
            f"torch LM's tensors), got {backend!r}"
        )
    config = ScheduleConfig(
        schedule=args.schedule, pp=args.pp, vpp=vpp_of(args), micro=args.micro, swap=True
    )
    _check_count("batch", args.batch)
    _check_count("steps", args.steps)
    if args.moe:
        _check_moe(args, backend, config)
    if not args.fsdp and not args.moe and args.batch % config.micro:
        raise ValueError(f"batch must be divisible by micro={config.micro}, got batch={args.batch}")
    if args.fsdp and args.batch % (config.micro * DEMO_FSDP_DP):
        raise ValueError(
            f"batch must be divisible by micro * dp = {config.micro * DEMO_FSDP_DP} with "
            f"--fsdp (dp={DEMO_FSDP_DP} replicas, each split into micro-batches), "
            f"got batch={args.batch}"
        )
    if args.fsdp and args.transport != "inprocess":
        raise ValueError(
            f"transport must be 'inprocess' with --fsdp (the FSDP demo runs its ranks in one "
            f"process), got {args.transport!r}"
        )
    _make_out_dir(args.out)
    return config


def _check_moe(args: argparse.Namespace, backend: str, config: ScheduleConfig) -> None:
    """``--moe``'s own checks (``demo_config``)."""
    if backend != "torch":
        raise ValueError(
            f"backend must be 'torch' with --moe (the MoE demo runs every rank in one "
            f"process; MindSpore's expert parallelism runs one process per rank, under "
            f"mpiexec), got {backend!r}"
        )
    if args.fsdp or args.transport != "inprocess":
        raise ValueError(
            "moe takes neither --fsdp nor another transport (it runs every rank in one "
            f"process, FSDP included), got fsdp={args.fsdp}, transport={args.transport!r}"
        )
    if args.batch % (config.micro * DEMO_MOE_DP):
        raise ValueError(
            f"batch must be divisible by micro * dp = {config.micro * DEMO_MOE_DP} with "
            f"--moe (dp={DEMO_MOE_DP} replicas, each split into micro-batches), "
            f"got batch={args.batch}"
        )


def _missing_framework(exc: ModuleNotFoundError, backend: str) -> str | None:
    """The one-line error for a demo whose ``backend`` framework is not installed, or None
    when ``exc`` is about another module."""
    if (exc.name or "").partition(".")[0] != backend:
        return None
    return f"ppswap demo needs {DEMO_BACKENDS[backend]}: {install_hint(backend)}"


def _run_demo(args: argparse.Namespace, config: ScheduleConfig) -> int:
    """Run the demo of the checked ``config``: its exit status, or 2 with one error line
    when ``--backend``'s framework is missing or (under MPI) the world size is not ``--pp``.

    The demo's modules are looked up by name here (``importlib.import_module``), not
    imported at the top: they import a tensor framework (seconds; an optional extra),
    which ``ppswap plan``, ``ppswap plot`` and a refused demo never need.
    """
    backend = demo_backend(args)
    try:
        demo = importlib.import_module(DEMO_MODULE)
        demo.load_demo_model(backend)  # imports the framework: missing is one line
        fsdp_demo = importlib.import_module(FSDP_DEMO_MODULE) if args.fsdp else None
        moe_demo = importlib.import_module(MOE_DEMO_MODULE) if args.moe else None
    except ModuleNotFoundError as exc:
        message = _missing_framework(exc, backend)
        if message is None:
            raise
        return fail(message)
    options = demo.DemoOptions(
        schedule=config.schedule,
        pp=config.pp,
        vpp=config.vpp,
        micro=config.micro,
        batch=args.batch,
        steps=args.steps,
        out_dir=Path(args.out),
        plot=not args.no_plot,
        fsdp=args.fsdp,
        transport=args.transport,
        backend=backend,
    )
    status: int
    if moe_demo is not None:
        status = moe_demo.main_moe_demo(options)
        return status
    if fsdp_demo is not None:
        status = fsdp_demo.main_fsdp_demo(options, dp=DEMO_FSDP_DP)
        return status
    try:
        status = demo.main_demo(options)
    except demo.DemoConfigError as exc:
        return fail(str(exc))
    return status


def run_demo_command(args: argparse.Namespace) -> int:
    """``ppswap demo``: check every option, then train the LM without and with swap, and
    report. A bad option (or, under MPI, a world size other than ``--pp``) is one
    ``ppswap: error:`` line and exit status 2, before any training."""
    try:
        config = demo_config(args)
    except (TypeError, ValueError) as exc:
        return fail(str(exc))
    return _run_demo(args, config)


def add_demo_parser(subparsers: Any) -> None:
    defaults = DEMO_DEFAULTS
    demo = subparsers.add_parser(
        "demo",
        help="train a small transformer LM with pp ranks, swap off and on",
        description="The main job: trains, checks swap on/off agree, reports memory. Every "
        "option is checked before anything is built.",
    )
    demo.add_argument(
        "--schedule",
        choices=SCHEDULE_NAMES,
        default=defaults["schedule"],
        help=f"schedule family (default {defaults['schedule']})",
    )
    demo.add_argument(
        "--pp", type=int, default=defaults["pp"], help=f"pipeline ranks (default {defaults['pp']})"
    )
    demo.add_argument("--vpp", type=int, default=None, help=VPP_HELP)
    demo.add_argument(
        "--micro",
        type=int,
        default=defaults["micro"],
        help=f"micro-batches per step; a multiple of pp for interleaved_1f1b "
        f"(default {defaults['micro']})",
    )
    demo.add_argument(
        "--batch",
        type=int,
        default=defaults["batch"],
        help=f"sequences per step, divisible by micro (by 2 * micro with --fsdp) "
        f"(default {defaults['batch']})",
    )
    demo.add_argument(
        "--steps",
        type=int,
        default=defaults["steps"],
        help=f"training steps per pass (default {defaults['steps']})",
    )
    demo.add_argument(
        "--out",
        default=defaults["out"],
        help=f"folder for the traces and the diagram (default {defaults['out']})",
    )
    demo.add_argument("--no-plot", action="store_true", help="skip the diagram (default: draw it)")
    demo.add_argument(
        "--fsdp",
        action="store_true",
        help=f"FSDP over dp={DEMO_FSDP_DP} replicas, in one process (default: off)",
    )
    demo.add_argument(
        "--moe",
        action="store_true",
        help=f"a MoE block per stage, its experts split over ep=2 of dp={DEMO_MOE_DP} "
        "replicas (torch, every rank in one process; default: off)",
    )
    demo.add_argument(
        "--transport",
        choices=tuple(DEMO_TRANSPORTS),
        default=defaults["transport"],
        help="; ".join(f"{name}: {what}" for name, what in DEMO_TRANSPORTS.items())
        + f" (default {defaults['transport']})",
    )
    demo.add_argument(
        "--backend",
        default=None,
        help=f"tensor framework of the LM: {' or '.join(DEMO_BACKENDS)} "
        f"(default {defaults['backend']}; torch with --transport torch or --moe)",
    )
    demo.set_defaults(handler=run_demo_command)
