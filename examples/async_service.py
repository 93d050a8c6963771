"""An async training service: trains in the background, keeps answering, cancels on request.

A tiny HTTP server on loopback (anyio, no framework):

    GET  /status   -> JSON: state, runs finished, last loss, heartbeat lag
    POST /train    -> start training runs (runs until stopped)
    POST /cancel   -> cancel the run in flight (the runtime cleans up; the next run works)

    python examples/async_service.py --port 8765          # serve until Ctrl-C
    python examples/async_service.py --self-test          # start, drive it, stop

Every task lives in the service's task group; the training run sits in its own cancel
scope, which /cancel cancels.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

import anyio
import numpy as np
from anyio.abc import SocketStream, TaskGroup

from ppswap import PipelineStage, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.swap import swap_wrapper


@dataclass
class ServiceState:
    state: str = "idle"
    runs_finished: int = 0
    runs_cancelled: int = 0
    last_loss: float | None = None
    max_lag_ms: float = 0.0
    train_requested: anyio.Event = field(default_factory=anyio.Event)
    run_scope: anyio.CancelScope | None = None


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
            result = await run_schedule(
                stages,
                "1f1b",
                micro_batch_num=8,
                inputs=x,
                targets=y,
                loss_fn=mse_loss,
                swap=True,
            )
            state.runs_finished += 1
            state.last_loss = result.loss
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
        request = (await stream.receive(4096)).decode(errors="replace")
        method, path = [*request.split(" "), "", ""][:2]
        if method == "GET" and path == "/status":
            body = {
                "state": state.state,
                "runs_finished": state.runs_finished,
                "runs_cancelled": state.runs_cancelled,
                "last_loss": state.last_loss,
                "max_heartbeat_lag_ms": round(state.max_lag_ms, 3),
            }
            status = "200 OK"
        elif method == "POST" and path == "/train":
            state.train_requested.set()
            body, status = {"ok": True}, "202 Accepted"
        elif method == "POST" and path == "/cancel":
            if state.run_scope is not None:
                state.run_scope.cancel()
            body, status = {"ok": True}, "202 Accepted"
        else:
            body, status = {"error": f"no route {method} {path}"}, "404 Not Found"
        payload = json.dumps(body).encode()
        head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        await stream.send(head.encode() + payload)


async def request(port: int, method: str, path: str) -> dict[str, object]:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        data = b""
        with anyio.fail_after(10):
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


async def self_test() -> None:
    state = ServiceState()
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await serve(0, state, tg, stop)
        print("status:", await request(port, "GET", "/status"))
        await request(port, "POST", "/train")
        with anyio.fail_after(120):
            while state.runs_finished < 2:
                print("status while training:", await request(port, "GET", "/status"))
                await anyio.sleep(0.2)
        with anyio.fail_after(60):
            while state.run_scope is None:
                await anyio.sleep(0.001)
        await request(port, "POST", "/cancel")
        with anyio.fail_after(60):
            while state.state != "cancelled":
                await anyio.sleep(0.01)
        finished = state.runs_finished
        await request(port, "POST", "/train")
        with anyio.fail_after(120):
            while state.runs_finished <= finished:
                await anyio.sleep(0.05)
        print("final:", await request(port, "GET", "/status"))
        stop.set()
        tg.cancel_scope.cancel()


async def main_async(port: int) -> None:
    state = ServiceState()
    async with anyio.create_task_group() as tg:
        bound = await serve(port, state, tg, anyio.Event())
        print(f"serving on http://127.0.0.1:{bound}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    anyio.run(self_test if args.self_test else (lambda: main_async(args.port)))


if __name__ == "__main__":
    main()
