"""``ppswap serve`` under load while it trains: response times and unchanged losses.

A real ``ppswap serve`` process on 127.0.0.1 (uvicorn, a fresh SQLite file) trains each
job of ``SCENARIOS`` twice, one after the other: first quiet, then under load:
``--clients`` concurrent clients (tasks sharing one ``httpx.AsyncClient`` with a
connection each, in this process) ask for the job's status (``GET /runs/{id}``) and the
Prometheus metrics (``GET /metrics``) in turn, from the moment the job is running until
it stops running, at most ``--requests`` requests in all and ``--limit-s`` seconds per
job. A scenario's clients either poll (one request per client every ``--interval-s``,
their starts spread over the first interval: ``clients / interval`` requests a second)
or send back to back (each client's next request as soon as its answer came: always
``clients`` requests in flight). Every request's response time is measured on the
client (``time.perf_counter`` around the request); the table gives their percentiles,
the failures (a status other than 200 or a transport error), and whether the loaded
run's losses equal the quiet run's bit for bit. Two control rows run the same polling
load, and the back-to-back load, for ``--idle-s`` seconds each against the server with
no job training: what the machine allows (the client shares the cores with the server)
without training. Only loopback is used.

    python benchmarks/bench_serve.py [--clients 100] [--interval-s 1] [--requests 3000]
                                     [--limit-s 60] [--steps 16] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx

HOST = "127.0.0.1"
P99_TARGET_MS = 50.0
_GPIPE = {"backend": "torch", "model": "demo", "schedule": "gpipe", "pp": 2, "micro_batch_num": 8}
_1F1B = _GPIPE | {"schedule": "1f1b"}
SCENARIOS: tuple[tuple[dict[str, Any], bool], ...] = ((_GPIPE, True), (_1F1B, True), (_1F1B, False))
"""(job, polling): each job with swap on, ``--steps`` steps and momentum 0.9; polling
clients, or back to back."""


@dataclass(frozen=True)
class LoadResult:
    """One job's loaded run: the requests it answered while training and their times."""

    job: str
    load: str
    steps: int
    clients: int
    requests: int
    failures: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    losses_equal: bool
    training_s: float


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


@contextmanager
def _server(folder: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    command = [sys.executable, "-m", "ppswap.cli", "serve", "--host", HOST, "--port", str(port)]
    with (folder / "server.log").open("wb") as sink:
        process = subprocess.Popen(
            [*command, "--db", str(folder / "jobs.db")], stdout=sink, stderr=sink
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)


async def _wait_up(client: httpx.AsyncClient, process: subprocess.Popen[bytes]) -> None:
    with anyio.fail_after(120):
        while True:
            if process.poll() is not None:
                raise RuntimeError("the server exited while starting (see its log)")
            try:
                if (await client.get("/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await anyio.sleep(0.2)


async def _state(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    shown: dict[str, Any] = (await client.get(f"/runs/{run_id}")).json()
    return shown


async def _train(client: httpx.AsyncClient, body: dict[str, Any], state: str) -> str:
    """Post a job; return its id once it reached ``state`` (queued, running, finished)."""
    run_id: str = (await client.post("/runs", json=body)).json()["id"]
    with anyio.fail_after(600):
        while (await _state(client, run_id))["state"] not in (state, "failed", "cancelled"):
            await anyio.sleep(0.02)
    return run_id


async def _finished(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    with anyio.fail_after(600):
        while (shown := await _state(client, run_id))["state"] in ("queued", "running"):
            await anyio.sleep(0.05)
    if shown["state"] != "finished":
        raise RuntimeError(f"job {run_id} ended {shown['state']}: {shown['error']}")
    return shown


async def _load(
    base: str,
    run_id: str,
    clients: int,
    interval_s: float,
    requests: int,
    limit_s: float,
    *,
    while_running: bool = True,
) -> tuple[list[float], int]:
    """The clients' response times (seconds) and failures while ``run_id`` is running
    (``while_running=False``: for ``limit_s``) (``interval_s``: each client's period, 0
    for back to back)."""
    times: list[float] = []
    failures = 0
    training = True
    budget = requests
    deadline = time.perf_counter() + limit_s

    async def watch(client: httpx.AsyncClient) -> None:  # not counted: the load's bound
        nonlocal training
        while training and time.perf_counter() < deadline:
            if while_running:
                training = (await _state(client, run_id))["state"] == "running"
            await anyio.sleep(0.05)
        training = False

    async def user(client: httpx.AsyncClient, index: int) -> None:
        nonlocal failures, budget
        paths = (f"/runs/{run_id}", "/metrics")
        turn = index
        due = time.perf_counter() + interval_s * index / clients
        while training and budget > 0:
            await anyio.sleep(max(0.0, due - time.perf_counter()))
            if not training or budget <= 0 or time.perf_counter() >= deadline:
                return
            budget -= 1
            started = time.perf_counter()
            try:
                answer = await client.get(paths[turn % 2])
                ok = answer.status_code == 200
            except httpx.TransportError:
                ok = False
            times.append(time.perf_counter() - started)
            failures += not ok
            turn += 1
            due += interval_s

    # (idle connections dropped before the server's keep-alive timeout of 5 s closes them)
    limits = httpx.Limits(
        max_connections=clients + 1, max_keepalive_connections=clients + 1, keepalive_expiry=2.0
    )
    client = httpx.AsyncClient(base_url=base, timeout=30, limits=limits)
    async with client, anyio.create_task_group() as tg:
        tg.start_soon(watch, client)
        for index in range(clients):
            tg.start_soon(user, client, index)
    return times, failures


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _result(
    job: str,
    load: str,
    args: argparse.Namespace,
    times: list[float],
    failures: int,
    *,
    losses_equal: bool = True,
    training_s: float = 0.0,
) -> LoadResult:
    return LoadResult(
        job=job,
        load=load,
        steps=args.steps if training_s else 0,
        clients=args.clients,
        requests=len(times),
        failures=failures,
        p50_ms=statistics.median(times) * 1e3,
        p95_ms=_percentile(times, 0.95) * 1e3,
        p99_ms=_percentile(times, 0.99) * 1e3,
        max_ms=max(times) * 1e3,
        losses_equal=losses_equal,
        training_s=training_s,
    )


async def _bench(args: argparse.Namespace) -> list[LoadResult]:
    results = []
    with tempfile.TemporaryDirectory(prefix="ppswap-bench-serve-") as scratch:
        port = _free_port()
        base = f"http://{HOST}:{port}"
        with _server(Path(scratch), port) as process:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                await _wait_up(client, process)
                first_id = ""
                for job, polling in SCENARIOS:
                    body = job | {"swap": True, "steps": args.steps, "momentum": 0.9}
                    quiet = await _finished(client, await _train(client, body, "finished"))
                    first_id = first_id or quiet["id"]
                    started = time.perf_counter()
                    loaded_id = await _train(client, body, "running")
                    interval_s = args.interval_s if polling else 0.0
                    times, failures = await _load(
                        base, loaded_id, args.clients, interval_s, args.requests, args.limit_s
                    )
                    loaded = await _finished(client, loaded_id)
                    name = f"{job['schedule']} pp{job['pp']} m{job['micro_batch_num']}"
                    results.append(
                        _result(
                            f"{name} ({job['backend']}, {job['model']} LM, swap)",
                            f"each every {interval_s:g} s" if polling else "back to back",
                            args,
                            times,
                            failures,
                            losses_equal=loaded["losses"] == quiet["losses"],
                            training_s=time.perf_counter() - started,
                        )
                    )
                for interval_s in (args.interval_s, 0.0):
                    times, failures = await _load(
                        base,
                        first_id,
                        args.clients,
                        interval_s,
                        args.requests,
                        args.idle_s,
                        while_running=False,
                    )
                    load = f"each every {interval_s:g} s" if interval_s else "back to back"
                    results.append(
                        _result("none (control: the server idle)", load, args, times, failures)
                    )
    return results


def render(
    results: list[LoadResult], args: argparse.Namespace, load: tuple[tuple[float, ...], ...]
) -> str:
    before, after = (", ".join(f"{v:.2f}" for v in avg) for avg in load)
    lines = [
        f"{args.clients} concurrent clients on loopback, status and metrics requests in "
        f"turn while the job trains (at most {args.requests} requests, {args.limit_s:.0f} s "
        f"per job); {os.cpu_count()} cores shared by the server, its training and the "
        f"clients; load average (1, 5, 15 min) before: {before}, after: {after}.",
        "",
        "| job | clients' requests | steps | requests | failed | p50 ms | p95 ms | p99 ms | "
        f"max ms | p99 < {P99_TARGET_MS:.0f} ms | losses equal the quiet run |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.job} | {r.load} | {r.steps} | {r.requests} | {r.failures} | {r.p50_ms:.1f} | "
            f"{r.p95_ms:.1f} | {r.p99_ms:.1f} | {r.max_ms:.1f} | "
            f"{'yes' if r.p99_ms < P99_TARGET_MS else 'NO'} | "
            f"{'-' if not r.steps else 'yes' if r.losses_equal else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100, help="concurrent clients")
    parser.add_argument(
        "--interval-s", type=float, default=1.0, help="a polling client's period (seconds)"
    )
    parser.add_argument("--requests", type=int, default=3000, help="requests per job at most")
    parser.add_argument("--limit-s", type=float, default=60.0, help="seconds of load per job")
    parser.add_argument("--steps", type=int, default=16, help="training steps per job")
    parser.add_argument(
        "--idle-s", type=float, default=8.0, help="seconds of the control load (no job)"
    )
    parser.add_argument("--quick", action="store_true", help="a short run (for checking)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    for name in ("clients", "requests", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be an int >= 1, got {getattr(args, name)}")
    for name in ("limit_s", "interval_s", "idle_s"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.quick:
        args.requests, args.steps = min(args.requests, 500), min(args.steps, 3)
    load_before = os.getloadavg()
    results = anyio.run(_bench, args)
    print(render(results, args, (load_before, os.getloadavg())))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if all(r.losses_equal and r.failures == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
