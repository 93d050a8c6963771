"""The report of ``gpu_check.py``: PASS / FAIL / SKIP per target from one model's
figures, the markdown of the whole run, and where it ran (``machine_info``).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from gpu_measure import Json

__all__ = [
    "GIB",
    "STEP_TIME_TARGET",
    "evaluate_targets",
    "gib",
    "machine_info",
    "pct",
    "render_markdown",
]

GIB = 2**30
STEP_TIME_TARGET = 1.05


# -- targets -------------------------------------------------------------------------------


def _target(name: str, status: str, detail: str) -> Json:
    return {"name": name, "status": status, "detail": detail}


def evaluate_targets(figures: Json, tolerance: float) -> list[Json]:
    """PASS / FAIL / SKIP per target from one model's figures (``measure_model``'s)."""
    memory = figures.get("memory", {})
    off, on, predicted = (
        memory.get("peak_no_swap"),
        memory.get("peak_swap"),
        memory.get("predicted_peak_swap"),
    )
    out: list[Json] = []
    if off is None or on is None or predicted is None:
        out.append(_target("memory cut as planned", "SKIP", "no memory figures"))
    else:
        predicted_cut = off - predicted
        miss = abs(on - predicted)
        ok = predicted_cut > 0 and miss <= tolerance * predicted_cut
        out.append(
            _target(
                "memory cut as planned",
                "PASS" if ok else "FAIL",
                f"peak {gib(off)} -> {gib(on)} with swap, planned {gib(predicted)} "
                f"(cut {pct(off - on, off)} measured, {pct(predicted_cut, off)} planned; "
                f"tolerance {tolerance:.0%} of the planned cut = {gib(tolerance * predicted_cut)})",
            )
        )
    timing = figures.get("timing", {})
    t_off, t_on = timing.get("no_swap_s"), timing.get("swap_s")
    if t_off is None or t_on is None:
        out.append(_target(f"step time <= {STEP_TIME_TARGET}x", "SKIP", "no step times"))
    else:
        ratio = t_on / t_off
        out.append(
            _target(
                f"step time <= {STEP_TIME_TARGET}x",
                "PASS" if ratio <= STEP_TIME_TARGET else "FAIL",
                f"swap {t_on:.3f} s / no swap {t_off:.3f} s = {ratio:.3f}x",
            )
        )
    t_save = timing.get("save_on_cpu_s")
    m_save = memory.get("peak_save_on_cpu")
    if t_on is None or t_save is None:
        out.append(_target("faster than save_on_cpu at no more memory", "SKIP", "no step times"))
    else:
        faster = t_on < t_save
        detail = f"swap {t_on:.3f} s vs save_on_cpu {t_save:.3f} s"
        if on is None or m_save is None:
            status = "SKIP" if faster else "FAIL"
            detail += "; no device memory figures to compare"
        else:
            status = "PASS" if faster and on <= m_save else "FAIL"
            detail += f"; peak {gib(on)} vs {gib(m_save)}"
        out.append(_target("faster than save_on_cpu at no more memory", status, detail))
    return out


# -- the machine ---------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        found = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None


def machine_info(device: torch.device) -> Json:
    """Where the check ran: host, Python, packages, the device."""
    info: Json = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": np.__version__,
        "anyio": _version("anyio"),
        "structlog": _version("structlog"),
        "ppswap_commit": _git_commit(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "device": str(device),
        "device_name": "cpu",
        "device_memory_bytes": None,
        "device_capability": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            device_memory_bytes=int(props.total_memory),
            device_capability=f"{props.major}.{props.minor}",
        )
    return info


# -- the report ----------------------------------------------------------------------------


def gib(nbytes: float | None) -> str:
    """Bytes for people: GiB from a tenth of one, MiB below."""
    if nbytes is None:
        return "-"
    if abs(nbytes) >= GIB / 10:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB"


def pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_markdown(report: Json) -> str:
    """The report as markdown: machine, then per model its tables and target lines."""
    machine, rates = report["machine"], report["probe"] or {}
    lines = [
        "# ppswap GPU check",
        "",
        f"- mode: {report['mode']}; device: {machine['device']} ({machine['device_name']}"
        + (f", {gib(machine['device_memory_bytes'])}" if machine["device_memory_bytes"] else "")
        + ")",
        f"- host {machine['host']}, {machine['platform']}, {machine['cpu_count']} CPUs",
        f"- Python {machine['python']}, torch {machine['torch']} (CUDA {machine['torch_cuda']}), "
        f"numpy {machine['numpy']}, anyio {machine['anyio']}, structlog {machine['structlog']}; "
        f"ppswap {machine['ppswap_commit'] or 'commit unknown'}",
        f"- float32 matmul precision: {machine['float32_matmul_precision']}; probe: "
        f"{'pinned ' if rates.get('pinned') else ''}D2H {_num(rates.get('d2h_gbps'))} GB/s, "
        f"H2D {_num(rates.get('h2d_gbps'))} GB/s, fp32 matmul "
        f"{_num(rates.get('matmul_fp32_tflops'), 3)} TFLOPS",
        f"- swap selects saved tensors: {report['select']}; "
        f"{report['steps']} measured steps after a warm-up step, median; "
        f"elapsed {report['elapsed_s']:.1f} s",
    ]
    for entry in report["models"]:
        lines += ["", *_model_markdown(entry)]
    return "\n".join(lines) + "\n"


def _allocator(entry: Json, run: str, key: str) -> str:
    figures = (entry["pipeline"].get(run) or {}).get("allocator") or {}
    value = figures.get(key)
    return "-" if value is None else str(value)


def _model_markdown(entry: Json) -> list[str]:
    memory, timing = entry["memory"], entry["timing"]
    off = memory.get("peak_no_swap")
    t_off = timing.get("no_swap_s")
    lines = [
        f"## {entry['description']}, {entry['dtype']}"
        + (f" under autocast to {entry['autocast']}" if entry.get("autocast") else ""),
        "",
        f"Memory: {memory.get('source') or '-'}; parameters "
        f"{entry['parameters'] or '-'} ({gib(memory.get('parameters_bytes'))}).",
        "",
        "| configuration | peak memory | vs pipeline no swap | step s (median) "
        "| vs pipeline no swap |",
        "|---|---:|---:|---:|---:|",
    ]
    rows = [
        ("pipeline, no swap", off, t_off),
        ("pipeline, ppswap swap", memory.get("peak_swap"), timing.get("swap_s")),
        ("plan: predicted with swap", memory.get("predicted_peak_swap"), None),
        ("unsplit, no offload", memory.get("peak_unsplit"), timing.get("unsplit_s")),
        (
            "unsplit, save_on_cpu(pin_memory=True)",
            memory.get("peak_save_on_cpu"),
            timing.get("save_on_cpu_s"),
        ),
    ]
    for label, peak, seconds in rows:
        lines.append(
            f"| {label} | {gib(peak)} | "
            f"{_x(peak / off) if peak is not None and off else '-'} | {_s(seconds)} | "
            f"{_x(seconds / t_off) if seconds is not None and t_off else '-'} |"
        )
    copies = entry.get("copies") or {}
    lines += [
        "",
        "| copies | value |",
        "|---|---:|",
        f"| offloaded / loaded | {gib(copies.get('offloaded_bytes'))} / "
        f"{gib(copies.get('loaded_bytes'))} |",
        f"| copy time s ({copies.get('copy_time_source', '-')}) | {_s(copies.get('copy_s'))} |",
        f"| D2H / H2D GB/s (events) | {_num(copies.get('d2h_gbps'))} / "
        f"{_num(copies.get('h2d_gbps'))} |",
        f"| step time added by swap s | {_s(copies.get('exposed_by_step_time_s'))} |",
        f"| copy time hidden (1 - added step time / copy time) | "
        f"{_share(copies.get('hidden_share'))} |",
        f"| runtime: copy busy s / exposed wait s | {_s(copies.get('copy_busy_s'))} / "
        f"{_s(copies.get('exposed_copy_wait_s'))} |",
        f"| runtime: copy time hidden (1 - exposed wait / copy busy) | "
        f"{_share(copies.get('hidden_share_runtime'))} |",
        f"| achieved TFLOPS without swap | {_num(timing.get('achieved_tflops_no_swap'), 3)} |",
        f"| peak reserved no swap / swap (allocator) | "
        f"{gib((entry['pipeline'].get('no_swap') or {}).get('peak_reserved_bytes'))} / "
        f"{gib((entry['pipeline'].get('swap') or {}).get('peak_reserved_bytes'))} |",
        f"| allocator retries no swap / swap | "
        f"{_allocator(entry, 'no_swap', 'alloc_retries')} / "
        f"{_allocator(entry, 'swap', 'alloc_retries')} |",
        f"| page-locked host bytes of the swap engine | "
        f"{gib((entry['pipeline'].get('swap') or {}).get('pinned_host_bytes'))} |",
        f"| syncs in one swap step (set_sync_debug_mode) | "
        f"{(entry.get('syncs') or {}).get('syncs', '-')} |",
        f"| swap losses identical / grad norms max rel diff | "
        f"{entry['pipeline'].get('losses_identical')} / "
        f"{_num(entry['pipeline'].get('grad_norm_max_rel_diff'), 9)} |",
    ]
    plan = entry.get("plan")
    if plan:
        lines += [
            "",
            f"Plan ({_plan_scope(plan['one_device'])}): "
            f"peak chunks {plan['peak_chunks_no_swap']} -> {plan['peak_chunks_swap']}, "
            f"planned activation bytes {gib(plan['planned_saved_no_swap'])} -> "
            f"{gib(plan['planned_saved_swap'])}.",
            "",
            "| rank | chunks no swap -> swap (plan) | eligible | chunk MiB | movable MiB "
            "| saved peak no swap MiB | with swap MiB | predicted with swap MiB |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in plan["ranks"]:
            lines.append(
                f"| {row['rank']} | {row['chunks_no_swap']} -> {row['chunks_swap']} | "
                f"{row['eligible']} | {_mib(row['chunk_bytes'])} | "
                f"{_mib(row['movable_chunk_bytes'])} | {_mib(row['measured_saved_no_swap'])} | "
                f"{_mib(row['measured_saved_swap'])} | {_mib(row['predicted_saved_swap'])} |"
            )
    lines += ["", "Targets:", ""]
    lines += [f"- {t['status']} {t['name']}: {t['detail']}" for t in entry["targets"]]
    for error in entry["errors"]:
        lines.append(f"- ERROR in {error['section']}: {error['error']}")
    for skipped in entry["skipped"]:
        lines.append(f"- skipped {skipped}")
    return lines


def _plan_scope(one_device: bool) -> str:
    return "all ranks on one device: largest per-column sum" if one_device else "per rank, summed"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"
