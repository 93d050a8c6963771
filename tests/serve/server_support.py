"""``ppswap serve`` as a real process on loopback, for the tests that need one: a free
port, the server (killed at the end if still up), waits with deadlines."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx

TINY = {"model": "tiny", "backend": "torch", "micro_batch_num": 4, "pp": 2, "swap": True}
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


@contextmanager
def server(db: Path, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    command = [sys.executable, "-m", "ppswap.cli", "serve", "--host", HOST, "--port", str(port)]
    with log.open("wb") as sink:
        process = subprocess.Popen([*command, "--db", str(db)], stdout=sink, stderr=sink)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


async def wait_up(client: httpx.AsyncClient, process: subprocess.Popen[bytes]) -> None:
    with anyio.fail_after(90):
        while True:
            assert process.poll() is None, "the server exited while starting"
            try:
                if (await client.get("/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await anyio.sleep(0.2)


async def wait_state(client: httpx.AsyncClient, run_id: str, state: str) -> dict[str, Any]:
    with anyio.fail_after(120):
        while (shown := (await client.get(f"/runs/{run_id}")).json())["state"] != state:
            await anyio.sleep(0.05)
    return dict(shown)
