"""The training service's ASGI app (Starlette): jobs over HTTP, events, metrics.

    POST   /runs              JSON object of RunOptions' field names and the job's
                              (``ppswap.serve.training``) -> 202 {"id": ...}
    GET    /runs              every job this service's store holds
    GET    /runs/{id}         its state (queued, running, finished, failed, cancelled,
                              interrupted), losses per step, the last step's per-rank
                              metrics, its error
    DELETE /runs/{id}         cancel a queued or running job -> 202
    POST   /runs/{id}/resume  queue an interrupted job again from its last checkpoint
                              (``ppswap.serve.checkpoint``) -> 202
    GET    /runs/{id}/events  server-sent events: the job's states, the library's run
                              events (``ppswap.events``), one StepFinished per step
    GET    /metrics           Prometheus text (one registry per app)
    GET    /healthz           {"status": "ok", ...}
    GET    /                  the live page: a run's loss per step, each rank's saved
                              bytes with and without swap, the last step's timeline
                              (``static/``: plain SVG drawn by the page's own script)

Every refusal is one JSON object ``{"error": {"field": ..., "reason": ...}}``: 400 for a
body that is not JSON, 422 for a field the checks refuse (an unknown option, a value the
library refuses), 404 for an unknown id, 409 for cancelling a job that has ended or
resuming one that is not interrupted or has no checkpoint, 503 when the queue is full.
Nothing is recorded or started for a refused request.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import prometheus_client
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ppswap.metrics import LoopLagMonitor, RankMetrics, metric_fields
from ppswap.results import RunResult
from ppswap.serve.jobs import Job, JobManager, QueueFullError, ResumeRefusedError
from ppswap.serve.store import ACTIVE_STATES, JOB_STATES, JobStore
from ppswap.serve.training import JobInputError, parse_job

__all__ = ["SSE_KEEPALIVE_S", "STATIC_DIR", "create_app", "default_checkpoint_dir"]

STATIC_DIR = Path(__file__).parent / "static"
"""The live page's files (in the package: the page loads nothing from a network)."""

SSE_KEEPALIVE_S = 15.0
"""A follower of a quiet job gets a comment line this often (and the wait a deadline)."""


def _error(status: int, field: str, reason: str) -> JSONResponse:
    return JSONResponse({"error": {"field": field, "reason": reason}}, status_code=status)


class _Exporter:
    """The app's Prometheus registry: one gauge per ``RankMetrics`` field (label
    ``rank``), set after every step; jobs by state and the loop's lag, read at scrape."""

    def __init__(self, manager: JobManager, lag: LoopLagMonitor) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.rank_gauges = {
            name: prometheus_client.Gauge(
                f"ppswap_rank_{name}", text, ["rank"], registry=self.registry
            )
            for name, text in metric_fields()
        }
        self.steps = prometheus_client.Counter(
            "ppswap_steps", "training steps finished", registry=self.registry
        )
        self.step_seconds = prometheus_client.Histogram(
            "ppswap_step_seconds", "seconds per training step", registry=self.registry
        )
        jobs = prometheus_client.Gauge(
            "ppswap_jobs", "jobs of this service by state", ["state"], registry=self.registry
        )
        for state in JOB_STATES:
            jobs.labels(state).set_function(partial(_count_jobs, manager, state))
        lag_gauge = prometheus_client.Gauge(
            "ppswap_event_loop_lag_max_seconds",
            "the event loop's largest lag since the service started",
            registry=self.registry,
        )
        lag_gauge.set_function(lambda: lag.max_s)

    def on_step(
        self, job: Job, step: int, result: RunResult, metrics: tuple[RankMetrics, ...]
    ) -> None:
        self.steps.inc()
        self.step_seconds.observe(result.step_time_s)
        for rank in metrics:
            for name, gauge in self.rank_gauges.items():
                gauge.labels(str(rank.rank)).set(getattr(rank, name))


def _count_jobs(manager: JobManager, state: str) -> float:
    return float(sum(job.state == state for job in manager.jobs.values()))


def default_checkpoint_dir(db_path: str | Path) -> Path:
    """Where checkpoints go unless told: beside the SQLite file, ``<name>.checkpoints``."""
    path = Path(db_path)
    return path.with_name(path.name + ".checkpoints")


def create_app(db_path: str | Path, checkpoint_dir: str | Path | None = None) -> Starlette:
    """The service, its jobs kept in the SQLite file ``db_path`` and their checkpoints
    under ``checkpoint_dir`` (default: ``default_checkpoint_dir(db_path)``). Its lifespan
    opens the store (marking jobs left queued or running as interrupted), the loop-lag
    monitor and the task group the trainer runs in; shutting down cancels the job in
    flight."""
    checkpoints = Path(checkpoint_dir) if checkpoint_dir else default_checkpoint_dir(db_path)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store = await anyio.to_thread.run_sync(JobStore, db_path)
        try:
            async with LoopLagMonitor() as lag, anyio.create_task_group() as tg:
                manager = JobManager(store, lag, checkpoints)
                exporter = _Exporter(manager, lag)
                manager.on_step = exporter.on_step
                app.state.manager, app.state.exporter = manager, exporter
                tg.start_soon(manager.run)
                yield
                tg.cancel_scope.cancel()
        finally:
            await anyio.to_thread.run_sync(store.close)

    async def submit(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, "body", f"not JSON: {exc}")
        try:
            spec = parse_job(body)
        except JobInputError as exc:
            return _error(422, exc.field, exc.reason)
        manager: JobManager = request.app.state.manager
        try:
            job = await manager.submit(spec)
        except QueueFullError as exc:
            return _error(503, "queue", str(exc))
        return JSONResponse({"id": job.id, "state": job.state}, status_code=202)

    async def list_runs(request: Request) -> Response:
        manager: JobManager = request.app.state.manager
        return JSONResponse({"runs": [r.as_json() for r in await manager.store.all()]})

    async def show(request: Request) -> Response:
        manager: JobManager = request.app.state.manager
        job_id = request.path_params["id"]
        record = await manager.store.get(job_id)
        if record is None:
            return _error(404, "id", f"no run {job_id!r}")
        shown = record.as_json()
        job = manager.jobs.get(job_id)
        if job is not None:  # the live state (the store follows it a moment later)
            shown["state"] = job.state
        return JSONResponse(shown)

    async def cancel(request: Request) -> Response:
        manager: JobManager = request.app.state.manager
        job_id = request.path_params["id"]
        job = manager.jobs.get(job_id)
        if job is None:
            record = await manager.store.get(job_id)
            if record is None:
                return _error(404, "id", f"no run {job_id!r}")
            state = record.state
        else:
            state = job.state
        if job is None or state not in ACTIVE_STATES:
            return _error(
                409, "id", f"run {job_id} is {state}; only a queued or running run can be cancelled"
            )
        await manager.cancel(job)
        return JSONResponse({"id": job_id, "state": "cancelling"}, status_code=202)

    async def resume(request: Request) -> Response:
        manager: JobManager = request.app.state.manager
        job_id = request.path_params["id"]
        record = await manager.store.get(job_id)
        if record is None:
            return _error(404, "id", f"no run {job_id!r}")
        job = manager.jobs.get(job_id)
        if job is not None and job.state != record.state:  # the live state
            record = dataclasses.replace(record, state=job.state)
        try:
            job = await manager.resume(record)
        except ResumeRefusedError as exc:
            return _error(409, exc.field, exc.reason)
        except QueueFullError as exc:
            return _error(503, "queue", str(exc))
        steps_done = job.resume_from.steps_done if job.resume_from is not None else 0
        return JSONResponse(
            {"id": job.id, "state": job.state, "steps_done": steps_done}, status_code=202
        )

    async def page(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    async def events(request: Request) -> Response:
        manager: JobManager = request.app.state.manager
        job_id = request.path_params["id"]
        job = manager.jobs.get(job_id)
        if job is None:
            record = await manager.store.get(job_id)
            if record is None:
                return _error(404, "id", f"no run {job_id!r}")
            final = {"type": "JobState", "state": record.state, "error": record.error}
            return StreamingResponse(_one_event(final), media_type="text/event-stream")
        return StreamingResponse(_follow(job), media_type="text/event-stream")

    async def metrics(request: Request) -> Response:
        exporter: _Exporter = request.app.state.exporter
        text = prometheus_client.generate_latest(exporter.registry)
        return Response(text, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        manager: JobManager = request.app.state.manager
        running = manager.running.id if manager.running is not None else None
        return JSONResponse({"status": "ok", "running": running, "queued": manager.queued})

    routes = [
        Route("/runs", submit, methods=["POST"]),
        Route("/runs", list_runs, methods=["GET"]),
        Route("/runs/{id}", show, methods=["GET"]),
        Route("/runs/{id}", cancel, methods=["DELETE"]),
        Route("/runs/{id}/resume", resume, methods=["POST"]),
        Route("/runs/{id}/events", events, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/", page, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def _sse(event_id: int, payload: dict[str, Any]) -> str:
    return f"id: {event_id}\nevent: {payload['type']}\ndata: {json.dumps(payload)}\n\n"


async def _one_event(payload: dict[str, Any]) -> AsyncIterator[str]:
    yield _sse(0, payload)


async def _follow(job: Job) -> AsyncIterator[str]:
    """Every event of ``job`` from its oldest kept one, then each as it comes, until the
    job has ended and its last event is sent."""
    sent = job.first_kept
    while True:
        sent = max(sent, job.first_kept)  # a slow follower skips what history dropped
        while sent < job.posted:
            yield _sse(sent, job.history[sent - job.first_kept])
            sent += 1
        if job.state not in ACTIVE_STATES:
            return
        before = job.posted
        await job.wait_for_news(sent, SSE_KEEPALIVE_S)
        if job.posted == before and job.state in ACTIVE_STATES:
            yield ": keepalive\n\n"
