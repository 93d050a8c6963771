"""``ppswap serve`` as a real server: a uvicorn process on loopback. Start it, train, follow
a job's server-sent events as they come and cancel it inside a step, train the next job,
scrape the metrics, stop it gracefully; then kill one mid-job and restart it on the same
store: the job in flight is listed as interrupted, and resumed from its last checkpoint
it ends with the losses of an uninterrupted run. Every wait has a deadline."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import anyio
import httpx
import pytest
from server_support import HOST, TINY, free_port, server, wait_state, wait_up

pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
@pytest.mark.asyncio
async def test_a_uvicorn_server_trains_streams_cancels_and_survives_a_crash(
    tmp_path: Path,
) -> None:
    db, port, log = tmp_path / "jobs.db", free_port(), tmp_path / "server.log"
    base = f"http://{HOST}:{port}"
    with server(db, port, log) as process:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            await wait_up(client, process)
            # the demo LM's size: a step takes long enough for the cancel to land inside it
            demo = TINY | {"model": "demo", "micro_batch_num": 8, "steps": 500}
            long_job = (await client.post("/runs", json=demo)).json()["id"]
            kinds: list[str] = []
            with anyio.fail_after(120):
                async with client.stream("GET", f"/runs/{long_job}/events") as events:
                    async for line in events.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        event = json.loads(line.removeprefix("data: "))
                        kinds.append(event["type"])
                        if kinds.count("ChunkOffloaded") == 1 and event["type"] == "ChunkOffloaded":
                            # inside the first step: its chunks are on the host
                            answer = await client.delete(f"/runs/{long_job}")
                            assert answer.status_code == 202
            # the stream went on as the job happened, and ended with it
            assert kinds[:4] == ["JobState", "JobState", "SavedBytesWithoutSwap", "RunStarted"]
            # the cancel landed inside a step: the stream's last run started and was
            # cancelled, with no step finished after it (the cancel is sent at the first
            # offload; on a loaded host an earlier step may finish before it arrives)
            assert kinds[-2:] == ["RunCancelled", "JobState"]
            last_start = len(kinds) - 1 - kinds[::-1].index("RunStarted")
            assert "StepFinished" not in kinds[last_start:]
            cancelled = await wait_state(client, long_job, "cancelled")
            assert cancelled["steps_done"] == kinds.count("StepFinished")
            next_job = (await client.post("/runs", json=TINY | {"steps": 2})).json()["id"]
            finished = await wait_state(client, next_job, "finished")
            metrics = (await client.get("/metrics")).text
        process.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
        assert process.wait(timeout=60) == 0
    assert finished["steps_done"] == 2 and len(finished["ranks"]) == 2
    assert 'ppswap_jobs{state="cancelled"} 1.0' in metrics
    assert 'ppswap_jobs{state="finished"} 1.0' in metrics
    logged = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    by_run = {(entry["event"], entry.get("run_id")) for entry in logged}
    assert ("job_cancelled", long_job) in by_run and ("job_finished", next_job) in by_run
    steps_logged = [entry.get("run_id") for entry in logged if entry["event"] == "step_finished"]
    # one log line per finished step, of each job (a loaded host may finish a step of the
    # long job before its cancel lands)
    assert steps_logged.count(next_job) == 2
    assert steps_logged.count(long_job) == cancelled["steps_done"]
    assert len(steps_logged) == 2 + cancelled["steps_done"]

    # A crash mid-job (SIGKILL: no shutdown at all), then a restart on the same store and
    # the job resumed from its last checkpoint.
    body = TINY | {"steps": 40, "momentum": 0.9}
    with server(db, port, log) as process:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            await wait_up(client, process)
            doomed = (await client.post("/runs", json=body)).json()["id"]
            with anyio.fail_after(120):
                while (await client.get(f"/runs/{doomed}")).json()["steps_done"] < 2:
                    await anyio.sleep(0.02)
        process.kill()
        process.wait(timeout=30)
    with server(db, port, log) as process:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            await wait_up(client, process)
            runs = {run["id"]: run for run in (await client.get("/runs")).json()["runs"]}
            resumed = await client.post(f"/runs/{doomed}/resume")
            assert resumed.status_code == 202, resumed.text
            done = await wait_state(client, doomed, "finished")
            # the same job, uninterrupted, in the same server (a process launched from
            # here may load other kernels than this one: MindSpore's import sets its
            # LD_LIBRARY_PATH, which the server inherits)
            again = (await client.post("/runs", json=body)).json()["id"]
            uninterrupted = await wait_state(client, again, "finished")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    interrupted_at = runs[doomed]["steps_done"]
    assert runs[doomed]["state"] == "interrupted" and 2 <= interrupted_at < 40
    # the checkpoint is written just before the record: at most one step ahead of it
    assert resumed.json()["steps_done"] in (interrupted_at, interrupted_at + 1)
    assert runs[long_job]["state"] == "cancelled" and runs[next_job]["state"] == "finished"
    assert done["losses"] == uninterrupted["losses"] and len(set(done["losses"])) == 40
    assert done["losses"][:interrupted_at] == runs[doomed]["losses"]
