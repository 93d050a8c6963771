"""An async training service: trains in the background, keeps answering, cancels on request.

Needs MindSpore (``pip install -e '.[mindspore]'``); without it, it exits with one line
saying so.

A tiny HTTP server on loopback (anyio, no framework):

    GET  /status   -> JSON: state, runs finished/cancelled/failed, last loss and error,
                      heartbeat lag (how long the event loop was kept from answering)
    POST /train    -> start training runs (they go on until cancelled)
    POST /cancel   -> cancel the run in flight (the runtime cleans up; the next run works)

    python examples/async_service.py --port 8765          # serve until Ctrl-C
    python examples/async_service.py --self-test          # start, drive it, check, stop

Every task lives in the service's task group; each training run sits in its own cancel
scope, which /cancel cancels. ``run_schedule`` never blocks the event loop (MindSpore runs
on ppswap's compute thread), a cancelled run leaves no thread, copy or swap group behind,
and a failed run (a ``PipelineError`` naming rank, actor and step) is reported on
/status while the service keeps serving. There is no optimizer step here, so every run
of the same batch gives the same loss: the self-test checks that the run after a
cancellation gives exactly the loss of the runs before it.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field

import anyio
import numpy as np
from anyio.abc import SocketStream, TaskGroup

from ppswap import PipelineError, PipelineStage, run_schedule
from ppswap.swap import swap_wrapper

try:
    from ppswap.demo.model import build_mlp_stages, mse_loss
except ModuleNotFoundError as missing:
    if missing.name != "mindspore":
        raise
    sys.exit(
        "examples/async_service.py runs on MindSpore, which is not installed: "
        "pip install -e '.[mindspore]' in the ppswap checkout"
    )

REQUEST_TIMEOUT_S = 10.0


@dataclass
class ServiceState:
    state: str = "idle"
    runs_finished: int = 0
    runs_cancelled: int = 0
    runs_failed: int = 0
    losses: list[float] = field(default_factory=list)
    last_error: str | None = None
    max_lag_ms: float = 0.0
    requests_served: int = 0
    train_requested: anyio.Event = field(default_factory=anyio.Event)
    run_scope: anyio.CancelScope | None = None

    def status(self) -> dict[str, object]:
        return {
            "state": self.state,
            "runs_finished": self.runs_finished,
            "runs_cancelled": self.runs_cancelled,
            "runs_failed": self.runs_failed,
            "last_loss": self.losses[-1] if self.losses else None,
            "last_error": self.last_error,
            "max_heartbeat_lag_ms": round(self.max_lag_ms, 3),
            "requests_served": self.requests_served,
        }


async def trainer(state: ServiceState, stop: anyio.Event) -> None:
    stages = [
        PipelineStage(m, i, 4) for i, m in enumerate(build_mlp_stages(4, dim=32, wrap=swap_wrapper))
    ]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    y = rng.standard_normal((16, 32)).astype(np.float32)
    await state.train_requested.wait()
    while not stop.is_set():
        state.state = "training"
        with anyio.CancelScope() as scope:
            state.run_scope = scope
            try:
                result = await run_schedule(
                    stages,
                    "1f1b",
                    micro_batch_num=8,
                    inputs=x,
                    targets=y,
                    loss_fn=mse_loss,
                    swap=True,
                    step_timeout=60.0,
                )
            except PipelineError as error:
                state.runs_failed += 1
                state.last_error = str(error).splitlines()[0]
            else:
                state.runs_finished += 1
                state.losses.append(result.loss)
        state.run_scope = None
        if scope.cancelled_caught:
            state.runs_cancelled += 1
            state.state = "cancelled"
            state.train_requested = anyio.Event()
            await state.train_requested.wait()


async def heartbeat(state: ServiceState) -> None:
    while True:
        started = time.perf_counter()
        await anyio.sleep(0.005)
        lag_ms = (time.perf_counter() - started - 0.005) * 1e3
        state.max_lag_ms = max(state.max_lag_ms, lag_ms)


async def handle(stream: SocketStream, state: ServiceState) -> None:
    async with stream:
        with anyio.move_on_after(REQUEST_TIMEOUT_S):  # a silent client cannot hold a task
            text = (await stream.receive(4096)).decode(errors="replace")
            method, path = [*text.split(" "), "", ""][:2]
            if method == "GET" and path == "/status":
                body, status = state.status(), "200 OK"
            elif method == "POST" and path == "/train":
                state.train_requested.set()
                body, status = {"ok": True}, "202 Accepted"
            elif method == "POST" and path == "/cancel":
                if state.run_scope is not None:
                    state.run_scope.cancel()
                body, status = {"ok": True}, "202 Accepted"
            else:
                body, status = {"error": f"no route {method} {path}"}, "404 Not Found"
            state.requests_served += 1
            payload = json.dumps(body).encode()
            head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            head += f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
            await stream.send(head.encode() + payload)


async def request(port: int, method: str, path: str) -> dict[str, object]:
    with anyio.fail_after(REQUEST_TIMEOUT_S):
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
            data = b""
            while True:
                try:
                    data += await stream.receive()
                except anyio.EndOfStream:
                    break
    return json.loads(data.split(b"\r\n\r\n", 1)[1])  # type: ignore[no-any-return]


async def serve(port: int, state: ServiceState, tg: TaskGroup, stop: anyio.Event) -> int:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    bound: int = listener.extra(anyio.abc.SocketAttribute.local_port)
    tg.start_soon(listener.serve, lambda s: handle(s, state))
    tg.start_soon(trainer, state, stop)
    tg.start_soon(heartbeat, state)
    return bound


def _ppswap_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ppswap-")]


async def self_test() -> None:
    """Drive the service over HTTP and check what this module promises; raises if not."""
    state = ServiceState()
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await serve(0, state, tg, stop)
        print("status:", await request(port, "GET", "/status"))
        await request(port, "POST", "/train")
        answered_while_training = 0
        with anyio.fail_after(120):
            while state.runs_finished < 2:
                reply = await request(port, "GET", "/status")
                answered_while_training += reply["state"] == "training"
                await anyio.sleep(0.05)
        print("status while training:", await request(port, "GET", "/status"))
        assert answered_while_training >= 1, "the service did not answer while training"
        with anyio.fail_after(60):
            while state.run_scope is None:
                await anyio.sleep(0.001)
        await anyio.sleep(0.02)  # somewhere inside the run
        await request(port, "POST", "/cancel")
        with anyio.fail_after(60):
            while state.state != "cancelled":
                await anyio.sleep(0.01)
        assert _ppswap_threads() == [], f"threads left by the cancelled run: {_ppswap_threads()}"
        finished = state.runs_finished
        await request(port, "POST", "/train")
        with anyio.fail_after(120):
            while state.runs_finished <= finished:
                await anyio.sleep(0.05)
        final = await request(port, "GET", "/status")
        print("final:", final)
        stop.set()
        tg.cancel_scope.cancel()
    assert state.runs_cancelled == 1 and state.runs_failed == 0, state.status()
    # No optimizer step: the run after the cancellation gives exactly the same loss.
    assert len(set(state.losses)) == 1, f"losses differ across runs: {state.losses}"
    assert _ppswap_threads() == [], _ppswap_threads()
    print("self-test passed:", json.dumps(state.status()))


async def main_async(port: int) -> None:
    state = ServiceState()
    async with anyio.create_task_group() as tg:
        bound = await serve(port, state, tg, anyio.Event())
        print(f"serving on http://127.0.0.1:{bound}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        anyio.run(self_test)
    else:
        anyio.run(main_async, args.port)


if __name__ == "__main__":
    main()
