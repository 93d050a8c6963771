"""The service's ASGI app through httpx.AsyncClient (the app's lifespan run as the server
runs it): real training jobs of the tiny demo LM on torch, events, cancel, metrics, bad
input, and a restarted service that finds its jobs."""

from __future__ import annotations

import gc
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from ppswap.serve.app import create_app
from ppswap.serve.store import JobRecord, JobStore

TINY = {"model": "tiny", "backend": "torch", "micro_batch_num": 4, "pp": 2, "swap": True}


@asynccontextmanager
async def service(db: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(db)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            yield client


async def wait_state(client: httpx.AsyncClient, run_id: str, states: set[str]) -> dict[str, Any]:
    with anyio.fail_after(120):
        while True:
            shown = (await client.get(f"/runs/{run_id}")).json()
            if shown["state"] in states:
                return dict(shown)
            await anyio.sleep(0.02)


async def read_events(client: httpx.AsyncClient, run_id: str) -> list[dict[str, Any]]:
    """Every server-sent event of a run, until the stream ends (the run ended; httpx's
    ASGI transport returns the response once it is complete)."""
    events: list[dict[str, Any]] = []
    with anyio.fail_after(120):
        async with client.stream("GET", f"/runs/{run_id}/events") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
    return events


@pytest.mark.asyncio
async def test_a_job_trains_with_an_optimizer_step_and_reports_as_it_goes(tmp_path: Path) -> None:
    async with service(tmp_path / "jobs.db") as client:
        posted = await client.post("/runs", json=TINY | {"steps": 3})
        assert posted.status_code == 202, posted.text
        run_id = posted.json()["id"]
        events = await read_events(client, run_id)
        shown = await wait_state(client, run_id, {"finished"})
        metrics = (await client.get("/metrics")).text
        health = (await client.get("/healthz")).json()
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["JobState", "JobState"] and kinds[-1] == "JobState"
    assert [e["state"] for e in events if e["type"] == "JobState"] == [
        "queued",
        "running",
        "finished",
    ]
    assert kinds.count("RunStarted") == kinds.count("RunFinished") == 3
    assert kinds.count("ChunkOffloaded") == kinds.count("ChunkLoaded") > 0
    steps = [e for e in events if e["type"] == "StepFinished"]
    assert [e["loss"] for e in steps] == shown["losses"] and shown["steps_done"] == 3
    # the optimizer stepped: each step's batch differs, but so would the loss of one batch
    assert len(set(shown["losses"])) == 3 and shown["loss"] == shown["losses"][-1]
    assert [m["rank"] for m in shown["ranks"]] == [0, 1]
    offloaded = sum(m["offloaded_bytes"] for m in shown["ranks"])
    assert offloaded == sum(e["bytes"] for e in events if e["type"] == "ChunkOffloaded") // 3
    assert 'ppswap_jobs{state="finished"} 1.0' in metrics
    assert "ppswap_steps_total 3.0" in metrics
    assert f'ppswap_rank_offloaded_bytes{{rank="0"}} {shown["ranks"][0]["offloaded_bytes"]}' in (
        metrics.replace(".0\n", "\n")
    )
    assert health == {"status": "ok", "running": None, "queued": 0}


@pytest.mark.asyncio
async def test_the_losses_equal_the_library_run_with_the_same_sgd(tmp_path: Path) -> None:
    from ppswap.serve.training import Training, parse_job

    training = Training(parse_job(TINY | {"steps": 2}))
    expected = [(await training.step()).loss for _ in range(2)]
    async with service(tmp_path / "jobs.db") as client:
        run_id = (await client.post("/runs", json=TINY | {"steps": 2})).json()["id"]
        shown = await wait_state(client, run_id, {"finished"})
    assert shown["losses"] == expected


@pytest.mark.asyncio
async def test_cancel_mid_run_then_the_next_job_finishes(tmp_path: Path) -> None:
    async with service(tmp_path / "jobs.db") as client:
        first = (await client.post("/runs", json=TINY | {"steps": 50})).json()["id"]
        queued = (await client.post("/runs", json=TINY | {"steps": 1})).json()["id"]
        third = (await client.post("/runs", json=TINY | {"steps": 2})).json()["id"]
        cancelled_queued = await client.delete(f"/runs/{queued}")
        assert cancelled_queued.status_code == 202
        # (httpx's ASGI transport hands a response over whole: the uvicorn test cancels
        # from the event stream, inside a step)
        with anyio.fail_after(120):
            while (await client.get(f"/runs/{first}")).json()["steps_done"] < 2:
                await anyio.sleep(0.005)
        assert (await client.delete(f"/runs/{first}")).status_code == 202
        shown = await wait_state(client, first, {"cancelled"})
        assert shown["steps_done"] < 50
        finished = await wait_state(client, third, {"finished"})
        assert (await client.get(f"/runs/{queued}")).json()["state"] == "cancelled"
        again = await client.delete(f"/runs/{third}")
    assert finished["steps_done"] == 2
    assert again.status_code == 409
    assert again.json() == {
        "error": {
            "field": "id",
            "reason": f"run {third} is finished; only a queued or running run can be cancelled",
        }
    }


@pytest.mark.parametrize(
    ("body", "status", "field", "reason"),
    [
        (b"{not json", 400, "body", "not JSON"),
        (b"[1, 2]", 422, "body", "must be a JSON object, got list"),
        (b'{"micro_batch_num": 4, "warp": 9}', 422, "warp", "warp is not an option"),
        (b'{"micro_batch_num": 0}', 422, "micro_batch_num", "micro_batch_num must be"),
        (b'{"schedule": "zigzag"}', 422, "schedule", "zigzag"),
        (b'{"swap_check": "always"}', 422, "swap_check", "swap_check"),
        (b'{"transport": "tcp"}', 422, "transport", "is an object"),
        (b'{"steps": 0}', 422, "steps", "must be an int >= 1, got 0"),
        (b'{"backend": "jax"}', 422, "backend", "must be one of"),
        (b'{"micro_batch_num": 4, "batch": 6}', 422, "batch", "multiple of micro_batch_num=4"),
        (b'{"lr": -1}', 422, "lr", "must be a number > 0, got -1"),
    ],
)
@pytest.mark.asyncio
async def test_bad_input_is_one_json_error_and_starts_nothing(
    tmp_path: Path, body: bytes, status: int, field: str, reason: str
) -> None:
    async with service(tmp_path / "jobs.db") as client:
        answer = await client.post("/runs", content=body)
        listed = (await client.get("/runs")).json()["runs"]
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["field"] == field and reason in error["reason"], error
    assert listed == []


@pytest.mark.asyncio
async def test_unknown_ids_are_404(tmp_path: Path) -> None:
    async with service(tmp_path / "jobs.db") as client:
        for method, path in (("GET", "/runs/nope"), ("DELETE", "/runs/nope")):
            answer = await client.request(method, path)
            assert answer.status_code == 404
            assert answer.json() == {"error": {"field": "id", "reason": "no run 'nope'"}}
        assert (await client.get("/runs/nope/events")).status_code == 404


@pytest.mark.asyncio
async def test_a_restarted_service_lists_its_jobs_and_marks_the_one_in_flight(
    tmp_path: Path,
) -> None:
    db = tmp_path / "jobs.db"
    async with service(db) as client:
        done = (await client.post("/runs", json=TINY | {"steps": 1})).json()["id"]
        await wait_state(client, done, {"finished"})
    # A service that stopped without a goodbye (a crash): its job was running.
    crashed = JobStore(db)
    await crashed.insert(JobRecord(id="inflight", state="queued", options=TINY, steps=5))
    await crashed.update("inflight", state="running", losses=[4.5])
    crashed.close()
    async with service(db) as client:
        runs = {r["id"]: r for r in (await client.get("/runs")).json()["runs"]}
        stream = await client.get("/runs/inflight/events")
        cancel = await client.delete("/runs/inflight")
    assert runs[done]["state"] == "finished" and runs[done]["steps_done"] == 1
    assert runs["inflight"]["state"] == "interrupted" and runs["inflight"]["losses"] == [4.5]
    assert '"state": "interrupted"' in stream.text
    assert cancel.status_code == 409 and "interrupted" in cancel.json()["error"]["reason"]


async def crash_with_a_checkpoint(db: Path, body: dict[str, Any], steps_before: int) -> str:
    """A job that trained ``steps_before`` steps or more (each checkpointed) in a service
    that then stopped without a goodbye: its record is left running, as a killed
    process leaves it (the uvicorn test kills a real one)."""
    async with service(db) as client:
        run_id = (await client.post("/runs", json=body)).json()["id"]
        with anyio.fail_after(120):
            while (await client.get(f"/runs/{run_id}")).json()["steps_done"] < steps_before:
                await anyio.sleep(0.005)
        await client.delete(f"/runs/{run_id}")
        shown = await wait_state(client, run_id, {"cancelled"})
    assert steps_before <= shown["steps_done"] < body["steps"]
    crashed = JobStore(db)
    await crashed.update(run_id, state="running")
    crashed.close()
    return run_id


@pytest.mark.parametrize(
    "backend", [pytest.param("mindspore", marks=pytest.mark.mindspore), "torch"]
)
@pytest.mark.asyncio
async def test_a_restarted_service_resumes_an_interrupted_run_bit_identically(
    tmp_path: Path, backend: str
) -> None:
    from ppswap.serve.training import Training, parse_job

    body = TINY | {"backend": backend, "steps": 8, "momentum": 0.9}
    uninterrupted = Training(parse_job(body))
    expected = [(await uninterrupted.step()).loss for _ in range(8)]
    db = tmp_path / "jobs.db"
    run_id = await crash_with_a_checkpoint(db, body, steps_before=2)
    checkpoints = sorted(p.name for p in (tmp_path / "jobs.db.checkpoints" / run_id).iterdir())
    async with service(db) as client:
        before = (await client.get(f"/runs/{run_id}")).json()
        answer = await client.post(f"/runs/{run_id}/resume")
        assert answer.status_code == 202, answer.text
        resumed_from = answer.json()["steps_done"]
        events = await read_events(client, run_id)
        shown = await wait_state(client, run_id, {"finished"})
        again = await client.post(f"/runs/{run_id}/resume")
    assert before["state"] == "interrupted"
    assert checkpoints == [f"step-{resumed_from:06d}"]  # only the last one is kept
    assert 2 <= resumed_from < 8
    assert shown["losses"] == expected and shown["steps_done"] == 8
    steps = [e["step"] for e in events if e["type"] == "StepFinished"]
    assert steps == list(range(resumed_from, 8))  # only the steps left ran
    assert events[0] == {"type": "JobState", "state": "queued", "resumed_from": resumed_from}
    assert again.status_code == 409
    assert again.json()["error"] == {
        "field": "id",
        "reason": f"run {run_id} is finished; only an interrupted run can be resumed",
    }


@pytest.mark.asyncio
async def test_a_resume_without_a_checkpoint_or_of_a_run_not_interrupted_is_refused(
    tmp_path: Path,
) -> None:
    db = tmp_path / "jobs.db"
    crashed = JobStore(db)
    await crashed.insert(JobRecord(id="early", state="running", options=TINY, steps=5))
    crashed.close()
    async with service(db) as client:
        unknown = await client.post("/runs/nope/resume")
        early = await client.post("/runs/early/resume")
        running = (await client.post("/runs", json=TINY | {"steps": 200})).json()["id"]
        await wait_state(client, running, {"running"})
        busy = await client.post(f"/runs/{running}/resume")
        await client.delete(f"/runs/{running}")
        await wait_state(client, running, {"cancelled"})
        runs = {r["id"]: r for r in (await client.get("/runs")).json()["runs"]}
    assert unknown.status_code == 404
    assert unknown.json() == {"error": {"field": "id", "reason": "no run 'nope'"}}
    assert early.status_code == 409
    assert early.json() == {
        "error": {
            "field": "id",
            "reason": "run early has no checkpoint: it stopped before its first step ended",
        }
    }
    assert busy.status_code == 409
    assert busy.json()["error"]["reason"] == (
        f"run {running} is running; only an interrupted run can be resumed"
    )
    assert runs["early"]["state"] == "interrupted"  # nothing started, nothing changed
    assert len(runs) == 2


@pytest.mark.asyncio
async def test_the_live_page_and_its_script_come_from_the_package(tmp_path: Path) -> None:
    async with service(tmp_path / "jobs.db") as client:
        page = await client.get("/")
        script = await client.get("/static/live.js")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/live.js">' in page.text and "http" not in page.text.replace(
        "http://www.w3.org", ""
    )
    assert script.status_code == 200 and "EventSource" in script.text


@pytest.mark.asyncio
async def test_status_and_metrics_requests_while_training_leave_the_losses_unchanged(
    tmp_path: Path,
) -> None:
    body = TINY | {"steps": 6, "momentum": 0.9}
    async with service(tmp_path / "jobs.db") as client:
        quiet = (await client.post("/runs", json=body)).json()["id"]
        quiet_losses = (await wait_state(client, quiet, {"finished"}))["losses"]
        loaded = (await client.post("/runs", json=body)).json()["id"]
        await wait_state(client, loaded, {"running"})
        answers: list[tuple[int, str | None]] = []

        async def poll(index: int) -> None:  # 20 clients, 300 requests at most
            path = (f"/runs/{loaded}", "/metrics")[index % 2]
            while len(answers) < 300:
                answer = await client.get(path)
                state = answer.json()["state"] if path != "/metrics" else None
                answers.append((answer.status_code, state))
                if state not in (None, "running"):
                    return
                await anyio.sleep(0)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for index in range(20):
                    tg.start_soon(poll, index)
        shown = await wait_state(client, loaded, {"finished"})
    assert {status for status, _ in answers} == {200}
    assert sum(state == "running" for _, state in answers) > 20  # the load met the training
    assert shown["losses"] == quiet_losses and len(set(quiet_losses)) == 6


@pytest.mark.asyncio
async def test_a_job_steps_on_a_frozen_heap_handed_back_when_it_ends(tmp_path: Path) -> None:
    """The objects alive when a job's steps begin stay out of the full collections
    (ppswap.serve.heap) while they run, finished or cancelled, and are handed back after,
    as in the server's process, where nothing else freezes (this session's freeze is
    lifted for the test and made again after it)."""
    gc.unfreeze()
    try:
        await _frozen_heap_per_job(tmp_path)
    finally:
        gc.collect()
        gc.freeze()


async def _frozen_heap_per_job(tmp_path: Path) -> None:
    frozen_before = gc.get_freeze_count()
    frozen_at_steps: list[int] = []
    app = create_app(tmp_path / "jobs.db")
    async with app.router.lifespan_context(app):
        manager = app.state.manager
        export = manager.on_step

        def on_step(*args: Any) -> None:
            frozen_at_steps.append(gc.get_freeze_count())
            export(*args)

        manager.on_step = on_step
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            done = (await client.post("/runs", json=TINY | {"steps": 2})).json()["id"]
            await wait_state(client, done, {"finished"})
            assert gc.get_freeze_count() == frozen_before
            long = (await client.post("/runs", json=TINY | {"steps": 500})).json()["id"]
            with anyio.fail_after(120):
                while (await client.get(f"/runs/{long}")).json()["steps_done"] < 1:
                    await anyio.sleep(0.02)
            assert (await client.delete(f"/runs/{long}")).status_code == 202
            await wait_state(client, long, {"cancelled"})
            assert gc.get_freeze_count() == frozen_before
    # the framework's modules and the model are many thousands of objects
    assert len(frozen_at_steps) >= 3 and min(frozen_at_steps) > frozen_before + 10_000
