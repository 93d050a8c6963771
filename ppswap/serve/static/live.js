// The live page of `ppswap serve`: follows one run's server-sent events
// (GET /runs/{id}/events) and draws three plain SVG plots from them: the loss per
// step (StepFinished), each rank's peak saved bytes with swap (StepFinished's ranks)
// and without (SavedBytesWithoutSwap), and the last step's timeline per rank and
// actor (RunFinished's timeline rows: [rank, actor, name, start_s, duration_s]).
// The run is ?run=<id>, else the newest run the service lists.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const MARGIN = { left: 70, right: 20, top: 20, bottom: 36 };

const state = { losses: [], withSwap: new Map(), withoutSwap: new Map(), timeline: [] };

function el(name, attrs, parent, text) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  parent.appendChild(node);
  return node;
}

function clear(svg) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  return { width: Number(svg.getAttribute("width")), height: Number(svg.getAttribute("height")) };
}

function formatBytes(bytes) {
  if (bytes >= 1 << 20) return (bytes / (1 << 20)).toFixed(1) + " MiB";
  if (bytes >= 1 << 10) return (bytes / (1 << 10)).toFixed(1) + " KiB";
  return bytes + " B";
}

function drawLoss() {
  const svg = document.getElementById("loss-plot");
  const { width, height } = clear(svg);
  const points = state.losses.filter((p) => p.loss !== null);
  svg.setAttribute("data-losses", JSON.stringify(state.losses.map((p) => p.loss)));
  if (points.length === 0) return;
  const low = Math.min(...points.map((p) => p.loss));
  const high = Math.max(...points.map((p) => p.loss));
  const span = high - low || 1;
  const lastStep = Math.max(1, points[points.length - 1].step);
  const x = (step) => MARGIN.left + (step / lastStep) * (width - MARGIN.left - MARGIN.right);
  const y = (loss) => height - MARGIN.bottom - ((loss - low) / span) * (height - MARGIN.top - MARGIN.bottom);
  el("text", { x: 4, y: y(high) + 4, class: "axis" }, svg, high.toFixed(4));
  el("text", { x: 4, y: y(low) + 4, class: "axis" }, svg, low.toFixed(4));
  el("text", { x: x(0), y: height - 10, class: "axis" }, svg, "step 0");
  el("text", { x: x(lastStep) - 40, y: height - 10, class: "axis" }, svg, "step " + lastStep);
  const coords = points.map((p) => `${x(p.step).toFixed(1)},${y(p.loss).toFixed(1)}`).join(" ");
  el("polyline", { points: coords, class: "loss-line" }, svg);
  for (const p of points) {
    const dot = el("circle", { cx: x(p.step), cy: y(p.loss), r: 3, class: "loss-point" }, svg);
    dot.setAttribute("data-step", p.step);
    dot.setAttribute("data-loss", p.loss);
    el("title", {}, dot, `step ${p.step}: loss ${p.loss}`);
  }
}

function drawBytes() {
  const svg = document.getElementById("bytes-plot");
  const { width, height } = clear(svg);
  const ranks = [...new Set([...state.withSwap.keys(), ...state.withoutSwap.keys()])].sort((a, b) => a - b);
  if (ranks.length === 0) return;
  const values = [...state.withSwap.values(), ...state.withoutSwap.values()];
  const high = Math.max(1, ...values);
  const group = (width - MARGIN.left - MARGIN.right) / ranks.length;
  const barWidth = Math.min(60, group / 3);
  const scale = (bytes) => (bytes / high) * (height - MARGIN.top - MARGIN.bottom);
  el("text", { x: 4, y: MARGIN.top + 4, class: "axis" }, svg, formatBytes(high));
  el("text", { x: 4, y: height - MARGIN.bottom, class: "axis" }, svg, "0");
  ranks.forEach((rank, index) => {
    const left = MARGIN.left + index * group + group / 2 - barWidth;
    [["without", state.withoutSwap], ["with", state.withSwap]].forEach(([series, values], k) => {
      if (!values.has(rank)) return;
      const bytes = values.get(rank);
      const bar = el("rect", {
        x: left + k * barWidth, y: height - MARGIN.bottom - scale(bytes),
        width: barWidth - 4, height: scale(bytes), class: "bar bar-" + series,
        "data-rank": rank, "data-series": series, "data-bytes": bytes,
      }, svg);
      el("title", {}, bar, `rank ${rank} ${series} swap: ${bytes} bytes`);
    });
    el("text", { x: left, y: height - 18, class: "axis" }, svg, "rank " + rank);
  });
  el("rect", { x: width - 190, y: 8, width: 10, height: 10, class: "bar-without" }, svg);
  el("text", { x: width - 176, y: 17, class: "legend" }, svg, "without swap");
  el("rect", { x: width - 95, y: 8, width: 10, height: 10, class: "bar-with" }, svg);
  el("text", { x: width - 81, y: 17, class: "legend" }, svg, "with swap");
}

function spanKind(actor, name) {
  if (actor === "copy") return "copy";
  if (actor === "p2p") return "p2p";
  if (/^(WO|WL|RF|RB)/.test(name)) return "wait";  // a swap copy or a receive waited for
  if (/^(SF|SB|BATCH)/.test(name)) return "p2p";
  return "compute";
}

function drawTimeline() {
  const svg = document.getElementById("timeline-plot");
  const LANE_LABELS = 110;  // room for "rank 0 compute"
  const rows = state.timeline;
  const lanes = [...new Set(rows.map((r) => `${r[0]} ${r[1]}`))].sort();
  svg.setAttribute("height", Math.max(120, MARGIN.top + MARGIN.bottom + lanes.length * 22));
  const { width } = clear(svg);
  svg.setAttribute("data-spans", rows.length);
  if (rows.length === 0) return;
  const start = Math.min(...rows.map((r) => r[3]));
  const end = Math.max(...rows.map((r) => r[3] + r[4]));
  const scale = (width - LANE_LABELS - MARGIN.right) / Math.max(end - start, 1e-9);
  lanes.forEach((lane, index) => {
    el("text", { x: 4, y: MARGIN.top + index * 22 + 14, class: "axis" }, svg, "rank " + lane);
  });
  for (const [rank, actor, name, begin, duration] of rows) {
    const kind = spanKind(actor, name);
    const rect = el("rect", {
      x: LANE_LABELS + (begin - start) * scale, y: MARGIN.top + lanes.indexOf(`${rank} ${actor}`) * 22,
      width: Math.max(1, duration * scale), height: 18, class: "span span-" + kind, "data-kind": kind,
    }, svg);
    el("title", {}, rect, `${name} (${kind}): ${(duration * 1e3).toFixed(3)} ms`);
  }
  const bottom = MARGIN.top + lanes.length * 22 + 14;
  el("text", { x: LANE_LABELS, y: bottom, class: "axis" }, svg, "0 ms");
  el("text", { x: width - 80, y: bottom, class: "axis" }, svg, ((end - start) * 1e3).toFixed(1) + " ms");
  ["compute", "copy", "wait", "p2p"].forEach((kind, k) => {
    el("rect", { x: LANE_LABELS + 150 + k * 90, y: bottom - 10, width: 10, height: 10, class: "span-" + kind }, svg);
    el("text", { x: LANE_LABELS + 164 + k * 90, y: bottom, class: "legend" }, svg, kind);
  });
}

function onEvent(event) {
  if (event.type === "StepFinished") {
    state.losses.push({ step: event.step, loss: event.loss });
    for (const rank of event.ranks) state.withSwap.set(rank.rank, rank.peak_saved_bytes);
    drawLoss();
    drawBytes();
  } else if (event.type === "SavedBytesWithoutSwap") {
    for (const rank of event.ranks) state.withoutSwap.set(rank.rank, rank.peak_saved_bytes);
    drawBytes();
  } else if (event.type === "RunFinished" && event.timeline.length > 0) {
    state.timeline = event.timeline;
    drawTimeline();
  }
}

async function chooseRun() {
  const asked = new URLSearchParams(window.location.search).get("run");
  if (asked) return asked;
  const runs = (await (await fetch("/runs")).json()).runs;
  return runs.length > 0 ? runs[runs.length - 1].id : null;
}

async function main() {
  const status = document.getElementById("status");
  const runId = await chooseRun();
  if (runId === null) {
    status.textContent = "no run yet: POST /runs to start one";
    return;
  }
  const source = new EventSource(`/runs/${encodeURIComponent(runId)}/events`);
  const follow = (message) => {
    const event = JSON.parse(message.data);
    if (event.type === "JobState") {
      status.textContent = `run ${runId}: ${event.state}` + (event.error ? ` (${event.error})` : "");
      document.body.setAttribute("data-state", event.state);
      if (!["queued", "running"].includes(event.state)) source.close();  // no reconnect
    }
    onEvent(event);
  };
  for (const type of ["JobState", "StepFinished", "SavedBytesWithoutSwap", "RunFinished"]) {
    source.addEventListener(type, follow);
  }
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) status.textContent += " (stream closed)";
  };
}

main();
