"""The GPU check: ppswap's swap on a GPT-like model, every pipeline rank on one GPU,
against no swap, the plan, and ``torch.autograd.graph.save_on_cpu``.

    bash benchmarks/gpu_run.sh                  # on a CUDA machine (docs/gpu.md)
    python benchmarks/gpu_check.py --cpu        # the same code path, a tiny model, on CPU

Contract: it runs the configurations below in one process, writes every figure as JSON
(``--json``, default ``<--out>/gpu_check.json``, rewritten after each section so a run
that is cut short still leaves what it measured) and as a markdown table (printed and
written to ``<--out>/gpu_check.md``), prints one PASS / FAIL / SKIP line per target and
exits 0 unless the arguments are bad: a target missed is a figure, not an error. A section
that raises (out of memory, a bug) is recorded with its error and the rest still runs;
sections that would start after ``--budget-s`` seconds are skipped and marked so.

What runs, per model size (``--models``; GPU default ``wide,narrow``, CPU ``tiny``):

1. The pipeline: token + positional embedding, ``blocks_per_stage`` pre-norm transformer
   blocks per stage (causal ``scaled_dot_product_attention``, a 4x GELU MLP), final norm
   and LM head on the last stage, cross-entropy; pp=4 stages on the one device, GPipe,
   8 micro-batches, every block wrapped with ``swap_wrapper`` (``--select all``, the
   default, is ppswap's own selection: saved tensors the engine cannot move stay put;
   ``--select device`` adds a ``policy_fn`` selecting only tensors on the device). One
   warm-up step, then
   ``--steps`` measured steps without swap, then the same with swap (``swap=True``, the
   default gap plan), both with one persistent copy engine (``CudaCopyEngine`` on CUDA,
   ``EmulatedDevice`` on CPU), then one more swap step with copy-stream timing events
   (below). Step time: wall clock from a device synchronize before the run to one after
   it, median of the measured steps. Peak device memory: ``torch.cuda.max_memory_allocated``
   over the last measured step (peak statistics reset at its start).
2. The plan's prediction (``simulate.memory_table`` and, for one device, the per-column
   residency ``simulate.resident_by_column``) in bytes: per rank, a chunk's bytes are
   the no-swap ledger peak (``RankStats.peak_saved_bytes``) over the planned no-swap peak
   chunks, its movable bytes the swap run's ``offloaded_bytes`` over its eligible chunks
   (what is not movable, such as a stage input, stays for every live chunk, as in
   ``ppswap/demo/run.py``'s report). All ranks share the device, so the plan's peak is the
   largest per-column sum over ranks; the prediction is the measured no-swap peak minus
   the planned no-swap activation bytes plus the planned swap activation bytes.
3. The hidden share of the copies, two ways. From CUDA events on the copy stream: a
   subclass of ``CudaCopyEngine`` (``TimedCudaCopyEngine`` in ``gpu_measure.py``, not a
   change to the engine) records an event after the copy stream's wait for the forward and
   one after each copy, its copy threads enqueueing one copy at a time, in a separate
   instrumented step (so the timed steps run the engine as shipped). That gives the copy
   stream's busy time and the D2H / H2D bandwidth; the hidden share is
   ``1 - max(0, swap step - no-swap step) / copy time``. From the runtime:
   ``1 - sum(exposed_copy_wait_s) / sum(copy_busy_s)`` over ranks; on a GPU both are host
   clocks (``copy_busy_s`` includes the copy thread's wait for the forward to finish on
   the device, and compute waiting on the host is not the device idling), so the event
   figure is the one the targets quote. On CPU there are no events: copy time is
   ``copy_busy_s``.
4. The same modules chained unsplit on the whole batch (``8 x micro_batch`` sequences, one
   forward and backward) without offload and under ``save_on_cpu(pin_memory=True)``:
   peak device memory and step time.

Targets (reported, never asserted): peak device memory with swap within ``--tolerance``
(default 10%) of the predicted cut; swap step time at most 1.05x no swap; swap faster than
``save_on_cpu`` at no more peak memory than it. On CPU (``--cpu``, or no CUDA) memory is
ppswap's own ledger (sum over ranks of ``peak_saved_bytes``, the plan summed per rank
too) and the unsplit runs have no memory figure (those parts SKIP).

The code: ``gpu_model.py`` (the model, its sizes and why these), ``gpu_measure.py``
(the runs and their figures), ``gpu_report.py`` (targets, markdown, the machine); this
script runs the sections, records them and writes the report.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from gpu_measure import (
    Clock,
    Json,
    Pipeline,
    TimedCudaCopyEngine,
    allocator_figures,
    clear_engine,
    hidden_syncs,
    make_engine,
    max_rel_diff,
    measure_unsplit,
    pinned_host_bytes,
    plan_prediction,
    probe,
    release_device,
    timed,
)
from gpu_model import DTYPES, PRESETS, ModelSize, Settings
from gpu_report import evaluate_targets, machine_info, render_markdown

__all__ = ["main"]


# -- one model -----------------------------------------------------------------------------


def _section(
    entry: Json, name: str, clock: Clock, write: Callable[[], None], fn: Callable[[], None]
) -> bool:
    """Run one section of a model, recording an error or a skip in ``entry``; whether it
    ran to its end. The report is written after it either way."""
    if clock.exhausted():
        entry["skipped"].append(f"{name}: time budget of {clock.budget_s:.0f} s spent")
        write()
        return False
    started = time.perf_counter()
    print(f"[{clock.elapsed():7.1f}s] {entry['name']}: {name} ...", file=sys.stderr, flush=True)
    try:
        fn()
    except Exception as exc:  # a figure, not a crash: the rest of the check still runs
        entry["errors"].append(
            {
                "section": name,
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            }
        )
        print(f"  {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return False
    finally:
        entry["section_s"][name] = round(time.perf_counter() - started, 3)
        write()
    return True


def measure_model(
    size: ModelSize, settings: Settings, clock: Clock, entry: Json, write: Callable[[], None]
) -> None:
    """Every section for one model size, filling ``entry`` (see the module docstring)."""
    device, steps = settings.device, settings.steps
    one_device = device.type == "cuda"
    state: dict[str, Any] = {}

    def build() -> None:
        state["pipeline"] = Pipeline(size, settings)
        entry["parameters"] = sum(
            p.numel() for m in state["pipeline"].modules for p in m.parameters()
        )
        entry["memory"]["parameters_bytes"] = sum(
            p.numel() * p.element_size() for m in state["pipeline"].modules for p in m.parameters()
        )

    def no_swap() -> None:
        release_device(device)
        engine = make_engine(device)
        figures, _ = state["pipeline"].measure(swap=False, engine=engine, steps=steps)
        figures["allocator"] = allocator_figures(device)
        entry["pipeline"]["no_swap"] = figures
        entry["memory"]["peak_no_swap"] = figures["peak_bytes"]
        entry["timing"]["no_swap_s"] = figures["median_step_s"]

    def swap() -> None:
        release_device(device)
        engine = make_engine(device)
        try:
            figures, _ = state["pipeline"].measure(swap=True, engine=engine, steps=steps)
            figures["allocator"] = allocator_figures(device)
            figures["pinned_host_bytes"] = pinned_host_bytes(engine)
            entry["syncs"] = hidden_syncs(
                partial(state["pipeline"].run, swap=True, engine=engine), device
            )
        finally:
            clear_engine(engine)
        entry["pipeline"]["swap"] = figures
        entry["memory"]["peak_swap"] = figures["peak_bytes"]
        entry["timing"]["swap_s"] = figures["median_step_s"]
        base = entry["pipeline"].get("no_swap")
        if base is not None:
            entry["pipeline"]["losses_identical"] = base["losses"] == figures["losses"]
            entry["pipeline"]["grad_norm_max_rel_diff"] = max_rel_diff(
                base["grad_norms"], figures["grad_norms"]
            )

    def copies() -> None:
        release_device(device)
        engine = make_engine(device, timed_copies=True)
        pipeline: Pipeline = state["pipeline"]
        try:
            result, seconds, peak = timed(partial(pipeline.run, swap=True, engine=engine), device)
        finally:
            clear_engine(engine)
        busy = sum(r.copy_busy_s for r in result.ranks)
        exposed = sum(r.exposed_copy_wait_s for r in result.ranks)
        moved = sum(r.offloaded_bytes + r.loaded_bytes for r in result.ranks)
        out: Json = {
            "instrumented_step_s": seconds,
            "instrumented_peak_bytes": peak,
            "offloaded_bytes": sum(r.offloaded_bytes for r in result.ranks),
            "loaded_bytes": sum(r.loaded_bytes for r in result.ranks),
            "copy_busy_s": busy,
            "exposed_copy_wait_s": exposed,
            # A wait longer than the copies ran is the waiter's wake-up, not copy time
            # (as hidden_share caps the step-time difference at the copy time).
            "hidden_share_runtime": 1 - min(exposed, busy) / busy if busy > 0 else None,
            "copy_time_source": "runtime copy_busy_s (no CUDA events on CPU)",
            "copy_s": busy,
            "d2h_s": None,
            "h2d_s": None,
            "d2h_gbps": None,
            "h2d_gbps": None,
            "copy_jobs_timed": 0,
        }
        if isinstance(engine, TimedCudaCopyEngine):
            spans = engine.spans()
            d2h = [(n, s) for kind, n, s in spans if kind == "d2h"]
            h2d = [(n, s) for kind, n, s in spans if kind == "h2d"]
            d2h_s, h2d_s = sum(s for _, s in d2h), sum(s for _, s in h2d)
            out.update(
                copy_time_source="CUDA events on the copy stream",
                copy_s=d2h_s + h2d_s,
                d2h_s=d2h_s,
                h2d_s=h2d_s,
                d2h_gbps=sum(n for n, _ in d2h) / d2h_s / 1e9 if d2h_s > 0 else None,
                h2d_gbps=sum(n for n, _ in h2d) / h2d_s / 1e9 if h2d_s > 0 else None,
                copy_jobs_timed=len(spans),
            )
        t_off, t_on = entry["timing"].get("no_swap_s"), entry["timing"].get("swap_s")
        copy_s = out["copy_s"]
        if t_off is not None and t_on is not None and copy_s and copy_s > 0:
            exposed_step = min(max(t_on - t_off, 0.0), copy_s)
            out["exposed_by_step_time_s"] = exposed_step
            out["hidden_share"] = 1 - exposed_step / copy_s
        else:
            out["exposed_by_step_time_s"] = None
            out["hidden_share"] = None
        out["bytes_moved"] = moved
        entry["copies"] = out

    def plan() -> None:
        off, on = entry["pipeline"]["no_swap"], entry["pipeline"]["swap"]
        if one_device:
            measured_off, measured_on = off["peak_bytes"], on["peak_bytes"]
        else:
            measured_off = sum(r["peak_saved_bytes"] for r in off["ranks"])
            measured_on = sum(r["peak_saved_bytes"] for r in on["ranks"])
            entry["memory"]["peak_no_swap"] = measured_off
            entry["memory"]["peak_swap"] = measured_on
        prediction = plan_prediction(
            size, off["ranks"], on["ranks"], measured_off, one_device=one_device
        )
        entry["plan"] = prediction
        entry["memory"]["source"] = (
            "torch.cuda.max_memory_allocated"
            if one_device
            else "ppswap ledger: sum over ranks of RankStats.peak_saved_bytes"
        )
        entry["memory"]["predicted_peak_swap"] = prediction["predicted_peak_swap"]
        entry["memory"]["peak_swap"] = measured_on

    def release_pipeline() -> None:
        state["pipeline"].drop_stages()
        release_device(device)

    def unsplit() -> None:
        figures = measure_unsplit(state["pipeline"], offload=False, steps=steps)
        entry["unsplit"]["no_offload"] = figures
        entry["memory"]["peak_unsplit"] = figures["peak_bytes"]
        entry["timing"]["unsplit_s"] = figures["median_step_s"]
        release_device(device)

    def save_on_cpu() -> None:
        figures = measure_unsplit(state["pipeline"], offload=True, steps=steps)
        entry["unsplit"]["save_on_cpu"] = figures
        entry["memory"]["peak_save_on_cpu"] = figures["peak_bytes"]
        entry["timing"]["save_on_cpu_s"] = figures["median_step_s"]
        release_device(device)

    try:
        if not _section(entry, "build", clock, write, build):
            return
        ran_off = _section(entry, "pipeline without swap", clock, write, no_swap)
        ran_on = _section(entry, "pipeline with swap", clock, write, swap)
        if ran_on:
            _section(entry, "copies (instrumented swap step)", clock, write, copies)
        if ran_off and ran_on:
            _section(entry, "plan", clock, write, plan)
        _section(entry, "release the pipeline", clock, write, release_pipeline)
        _section(entry, "unsplit without offload", clock, write, unsplit)
        _section(entry, "unsplit under save_on_cpu", clock, write, save_on_cpu)
    finally:
        state.clear()
        release_device(device)
        t_off, t_on = entry["timing"].get("no_swap_s"), entry["timing"].get("swap_s")
        entry["timing"]["ratio_swap"] = t_on / t_off if t_off and t_on else None
        flops = size.flops_per_step()
        entry["timing"]["flops_per_step"] = flops
        entry["timing"]["achieved_tflops_no_swap"] = flops / t_off / 1e12 if t_off else None
        entry["targets"] = evaluate_targets(entry, entry["tolerance"])
        write()


def new_entry(size: ModelSize, dtype: str, tolerance: float, autocast: bool = False) -> Json:
    """A model's JSON entry with every key present (None until measured)."""
    return {
        "name": size.name,
        "size": dataclasses.asdict(size),
        "description": size.describe(),
        "dtype": dtype,
        "autocast": "bfloat16" if autocast else None,
        "tolerance": tolerance,
        "parameters": None,
        "pipeline": {
            "no_swap": None,
            "swap": None,
            "losses_identical": None,
            "grad_norm_max_rel_diff": None,
        },
        "unsplit": {"no_offload": None, "save_on_cpu": None},
        "memory": {
            "source": None,
            "parameters_bytes": None,
            "peak_no_swap": None,
            "peak_swap": None,
            "predicted_peak_swap": None,
            "peak_unsplit": None,
            "peak_save_on_cpu": None,
        },
        "timing": {
            "no_swap_s": None,
            "swap_s": None,
            "ratio_swap": None,
            "unsplit_s": None,
            "save_on_cpu_s": None,
            "flops_per_step": None,
            "achieved_tflops_no_swap": None,
        },
        "copies": None,
        "syncs": None,
        "plan": None,
        "targets": [],
        "errors": [],
        "skipped": [],
        "section_s": {},
    }


# -- main ----------------------------------------------------------------------------------


def _sizes(names: str, overrides: Sequence[str]) -> list[ModelSize]:
    sizes = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name not in PRESETS:
            raise SystemExit(f"--models: unknown size {name!r} (known: {', '.join(PRESETS)})")
        sizes.append(PRESETS[name])
    changes: dict[str, Any] = {}
    known = {f.name for f in dataclasses.fields(ModelSize)} - {"name"}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in known or not value.lstrip("-").isdigit():
            raise SystemExit(f"--set: expected KEY=INT with KEY in {sorted(known)}, got {item!r}")
        changes[key] = int(value)
    try:
        return [dataclasses.replace(size, **changes) for size in sizes]
    except ValueError as exc:
        raise SystemExit(f"--set: {exc}") from exc


def _write_json(path: Path, report: Json) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial_path = path.with_name(path.name + ".partial")
    partial_path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    partial_path.replace(path)


@contextlib.contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU (also when no CUDA)")
    parser.add_argument("--out", type=Path, default=Path("out/gpu_check"), help="output dir")
    parser.add_argument("--json", type=Path, default=None, help="default <out>/gpu_check.json")
    parser.add_argument("--models", default=None, help="sizes, comma-separated (GPU: wide,narrow)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="override a size field for every model (dim=2048)",
    )
    parser.add_argument("--steps", type=int, default=3, help="measured steps after a warm-up")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--autocast",
        action="store_true",
        help="float32 weights, every step under torch.autocast to bfloat16",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.10,
        help="memory target: share of the planned cut the peak may miss by",
    )
    parser.add_argument(
        "--select",
        choices=("device", "all"),
        default="all",
        help="saved tensors swap may select: all (the default: ppswap's own selection, which "
        "leaves a saved tensor the engine cannot move where it is) or device (only those on "
        "the device)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=240.0, help="start no section after this many seconds"
    )
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    sizes = _sizes(args.models or ("wide,narrow" if cuda else "tiny"), args.set)
    if not cuda:
        # A code-path check, not a benchmark: one intra-op thread keeps the compute, copy
        # and event-loop threads from fighting torch's thread pool on a small machine.
        torch.set_num_threads(1)
    if args.autocast and args.dtype != "float32":
        parser.error(f"--autocast needs --dtype float32 (the weights), got {args.dtype}")
    settings = Settings(
        device, DTYPES[args.dtype], args.steps, args.select, args.tolerance, args.autocast
    )
    json_path = args.json or args.out / "gpu_check.json"
    md_path = args.out / "gpu_check.md"
    clock = Clock(args.budget_s)
    with _matmul_precision("highest"):
        report: Json = {
            "mode": "cuda" if cuda else "cpu",
            "machine": machine_info(device),
            "probe": None,
            "steps": args.steps,
            "select": args.select,
            "elapsed_s": 0.0,
            "models": [],
        }

        def write() -> None:
            report["elapsed_s"] = clock.elapsed()
            _write_json(json_path, report)

        try:
            report["probe"] = probe(device)
        except Exception as exc:  # the check goes on without the rates
            report["probe"] = {"error": f"{type(exc).__name__}: {exc}"}
        write()
        for size in sizes:
            entry = new_entry(size, args.dtype, args.tolerance, args.autocast)
            report["models"].append(entry)
            measure_model(size, settings, clock, entry, write)
    write()
    markdown = render_markdown(report)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown, encoding="utf-8")
    print(markdown)
    for entry in report["models"]:
        for message, count in ((entry.get("syncs") or {}).get("by_message") or {}).items():
            print(f"SYNC [{entry['name']}] x{count}: {message}")
        for target in entry["targets"]:
            print(f"{target['status']} [{entry['name']}] {target['name']}: {target['detail']}")
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
