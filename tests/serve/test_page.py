"""The live page in headless Chromium against a real ``ppswap serve`` on loopback: after a
real run, the page's DOM holds the run's own losses, each rank's saved bytes with and
without swap and the last step's timeline, and its screenshot (kept in the test's tmp
dir, ``page.png``) shows the plots. Skipped where Chromium is not installed
(``apt-get install chromium``; the test installs nothing)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from server_support import HOST, TINY, free_port, server, wait_state, wait_up

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BLUE = (0x1F, 0x77, 0xB4)  # the page's loss line and with-swap bars


class _Svg(HTMLParser):
    """Every element's attributes, by tag (the dumped DOM's SVG)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))


def chromium(*args: str, timeout_s: float = 90) -> str:
    assert CHROMIUM is not None
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000"]
    done = subprocess.run(
        [CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=timeout_s, check=True
    )
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium)")
@pytest.mark.timeout(300)
@pytest.mark.asyncio
async def test_the_live_page_draws_a_real_run_in_headless_chromium(tmp_path: Path) -> None:
    port = free_port()
    with server(tmp_path / "jobs.db", port, tmp_path / "server.log") as process:
        async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", timeout=30) as client:
            await wait_up(client, process)
            run_id = (await client.post("/runs", json=TINY | {"steps": 4})).json()["id"]
            shown = await wait_state(client, run_id, "finished")
            events = (await client.get(f"/runs/{run_id}/events")).text
        url = f"http://{HOST}:{port}/?run={run_id}"
        dom = chromium("--dump-dom", url)
        screenshot = tmp_path / "page.png"
        chromium(f"--screenshot={screenshot}", "--window-size=800,1000", url)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    parsed = _Svg()
    parsed.feed(dom)
    by_id = {attrs["id"]: attrs for _, attrs in parsed.elements if "id" in attrs}
    assert by_id["status"] is not None and f"run {run_id}: finished" in dom
    # the loss plot: the run's own losses, one point per step
    assert json.loads(by_id["loss-plot"]["data-losses"]) == shown["losses"]
    points = [a for tag, a in parsed.elements if tag == "circle" and "data-loss" in a]
    assert [float(a["data-loss"]) for a in points] == shown["losses"]
    # saved bytes per rank: with swap (the last step's) and without (the twin's)
    bars = {
        (int(a["data-rank"]), a["data-series"]): int(a["data-bytes"])
        for tag, a in parsed.elements
        if tag == "rect" and "data-series" in a
    }
    posted = [
        json.loads(x.removeprefix("data: ")) for x in events.splitlines() if x[:6] == "data: "
    ]
    without = next(e for e in posted if e["type"] == "SavedBytesWithoutSwap")
    # the job keeps the last step's timeline only (a follower that came late gets that one)
    kept = [bool(e["timeline"]) for e in posted if e["type"] == "RunFinished"]
    assert kept == [False, False, False, True]
    for rank in shown["ranks"]:
        assert bars[(rank["rank"], "with")] == rank["peak_saved_bytes"]
    for rank in without["ranks"]:
        assert bars[(rank["rank"], "without")] == rank["peak_saved_bytes"]
    assert bars[(0, "with")] < bars[(0, "without")]  # swap cut rank 0's saved bytes
    # the last step's timeline: compute, copies and waits of both ranks
    spans = [a for tag, a in parsed.elements if tag == "rect" and "data-kind" in a]
    assert int(by_id["timeline-plot"]["data-spans"]) == len(spans) > 0
    assert {a["data-kind"] for a in spans} >= {"compute", "copy", "wait"}
    # the screenshot is not blank: the plots' blue is drawn
    image = pytest.importorskip("PIL.Image").open(screenshot).convert("RGB")
    blue = sum(1 for pixel in image.getdata() if pixel == BLUE)
    assert image.size == (800, 1000) and blue > 500, blue
