// pyengine's job dashboard: plain JavaScript, charts drawn as inline SVG, no
// library and nothing fetched from outside this server. Every value shown comes
// from the REST API the page is served with (Flink's paths, Spark's progress).
"use strict";

// ?refresh=<ms> sets how often the page refreshes itself (2 s by default; 0: never,
// for reading a moment at leisure).
const REFRESH_MS = (() => {
  const asked = new URLSearchParams(window.location.search).get("refresh");
  return asked !== null && /^\d+$/.test(asked) ? Number(asked) : 2000;
})();
const SVG = "http://www.w3.org/2000/svg";
// selected: the checkpoint whose subtasks are shown; pinned once the user picks one,
// else it follows the newest checkpoint as the history moves on.
const state = { jobId: null, selected: null, pinned: false, parts: new Map(), vertices: [], rates: {} };

function $(id) { return document.getElementById(id); }

async function get(path) {
  const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try { message = (await response.json()).errors.join("; "); } catch (e) { /* keep the status */ }
    const error = new Error(message);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

function el(name, attrs, parent, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function svgIn(container, height) {
  container.replaceChildren();
  const width = Math.max(300, container.clientWidth || 600);
  const svg = el("svg", { viewBox: `0 0 ${width} ${height}`, height: height, preserveAspectRatio: "none" }, container);
  return { svg, width, height };
}

function num(n) { return Number(n || 0).toLocaleString("en-US", { maximumFractionDigits: 0 }); }
function bytes(n) {
  n = Number(n || 0);
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}
function ms(n) { return num(n) + " ms"; }
function time(ts) { return ts > 0 ? new Date(ts).toLocaleTimeString() : "—"; }

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

// -- the job and its graph --------------------------------------------------------------

function showJob(job) {
  $("job-name").textContent = job.name;
  const badge = $("job-state");
  badge.textContent = job.state;
  badge.className = "state " + job.state;
  $("job-restarts").textContent = String(job.restarts || 0);
  $("job-uptime").textContent = (job.duration / 1000).toFixed(0) + " s";
  const source = job.vertices.length ? job.vertices[0].metrics["read-records"] : 0;
  $("job-records").textContent = num(source);
  document.title = job.name + " — " + job.state;
  state.vertices = job.vertices;
}

function drawGraph(job, pressure) {
  const vertices = job.vertices;
  const maxP = Math.max(1, ...vertices.map(v => v.parallelism));
  const boxW = 250, gap = 70, rowH = 22, top = 30;
  const height = top + 40 + maxP * rowH + 20;
  const container = $("graph");
  container.replaceChildren();
  const width = Math.max(600, vertices.length * (boxW + gap));
  const svg = el("svg", { viewBox: `0 0 ${width} ${height}`, height: height, "data-testid": "job-graph" }, container);
  const inputs = new Map((job.plan.nodes || []).map(n => [n.id, (n.inputs || [])[0]]));
  vertices.forEach((v, i) => {
    const x = 10 + i * (boxW + gap);
    const g = el("g", { class: "vertex-group", "data-vertex": v.id }, svg);
    el("rect", { class: "vertex", x, y: top, width: boxW, height: 40 + v.parallelism * rowH, rx: 6 }, g);
    el("text", { x: x + 8, y: top + 16 }, g, v.id + " · p=" + v.parallelism);
    el("text", { x: x + 8, y: top + 32 }, g, v.name.length > 30 ? v.name.slice(0, 29) + "…" : v.name);
    const bp = pressure[v.id] || { subtasks: [] };
    for (let s = 0; s < v.parallelism; s++) {
      const info = bp.subtasks[s] || { ratio: 0, "backpressure-level": "ok" };
      const rate = (state.rates[v.id] || {})[s] || 0;
      const y = top + 40 + s * rowH;
      const t = el("text", { x: x + 8, y: y + 12, "data-subtask": s, class: "subtask-rate" }, g,
        "#" + s + " " + num(rate) + " rec/s");
      t.setAttribute("data-rate", String(rate));
      el("rect", { x: x + 160, y: y + 4, width: 80, height: 8, fill: "#e1e4e8" }, g);
      el("rect", {
        x: x + 160, y: y + 4, width: Math.max(1, 80 * info.ratio), height: 8,
        class: "bp-" + info["backpressure-level"], "data-backpressure": info.ratio,
      }, g);
    }
    if (i > 0) {
      const input = inputs.get(v.id);
      const y = top + 20;
      el("line", { x1: x - gap + 2, y1: y, x2: x - 4, y2: y, stroke: "#586069", "stroke-width": 1.5 }, svg);
      el("polygon", { points: `${x - 4},${y} ${x - 10},${y - 4} ${x - 10},${y + 4}`, fill: "#586069" }, svg);
      el("text", { x: x - gap + 6, y: y - 6 }, svg, input ? input.ship_strategy : "");
    }
  });
}

// -- line charts --------------------------------------------------------------------------

function lineChart(container, series, options) {
  const { svg, width, height } = svgIn(container, 200);
  const pad = { l: 60, r: 10, t: 10, b: 22 };
  const points = series.flatMap(s => s.points);
  if (!points.length) {
    el("text", { x: width / 2 - 60, y: height / 2 }, svg, options.empty || "no data yet");
    return svg;
  }
  const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  let y0 = options.zero ? 0 : Math.min(...ys), y1 = Math.max(...ys);
  if (y1 <= y0) y1 = y0 + 1;
  const sx = x => pad.l + (x - x0) / (x1 - x0) * (width - pad.l - pad.r);
  const sy = y => height - pad.b - (y - y0) / (y1 - y0) * (height - pad.t - pad.b);
  el("line", { x1: pad.l, y1: height - pad.b, x2: width - pad.r, y2: height - pad.b, stroke: "#d1d5da" }, svg);
  el("text", { x: 4, y: pad.t + 10 }, svg, options.format(y1));
  el("text", { x: 4, y: height - pad.b }, svg, options.format(y0));
  el("text", { x: pad.l, y: height - 6 }, svg, time(x0));
  el("text", { x: width - pad.r - 60, y: height - 6 }, svg, time(x1));
  for (const s of series) {
    if (!s.points.length) continue;
    const d = s.points.map((p, i) => (i ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" ");
    el("path", { d, fill: "none", stroke: s.color, "stroke-width": 2, "data-series": s.name }, svg);
  }
  series.forEach((s, i) => el("text", { x: width - pad.r - 110, y: pad.t + 12 + 14 * i, fill: s.color }, svg, "— " + s.name));
  return svg;
}

function drawProgress(recent) {
  const at = p => Date.parse(p.timestamp);
  lineChart($("throughput-chart"), [
    { name: "read/s", color: "#0366d6", points: recent.map(p => [at(p), p.inputRowsPerSecond]) },
    { name: "at sink/s", color: "#28a745", points: recent.map(p => [at(p), p.processedRowsPerSecond]) },
  ], { zero: true, format: v => num(v) + "/s" });
  const marks = recent.filter(p => p.eventTime && p.eventTime.watermark);
  const svg = lineChart($("watermark-chart"), [
    { name: "lag", color: "#d73a49", points: marks.map(p => [at(p), at(p) - Date.parse(p.eventTime.watermark)]) },
  ], { zero: true, format: v => num(v) + " ms", empty: "this job has no event time (no watermark)" });
  if (marks.length) {
    const last = marks[marks.length - 1].eventTime.watermark;
    el("text", { x: 70, y: 24, "data-watermark": last }, svg, "watermark " + last + " (lag behind wall time below)");
  }
}

// -- checkpoints --------------------------------------------------------------------------

function describe(cp) {
  if (!cp) return "none";
  let text = "#" + cp.id + " at " + time(cp.latest_ack_timestamp || cp.trigger_timestamp) + ", " + ms(cp.end_to_end_duration);
  if (cp.status === "COMPLETED") text += ", " + bytes(cp.checkpointed_size) + " written, " + bytes(cp.state_size) + " full";
  if (cp.checkpoint_type === "UNALIGNED_CHECKPOINT") text += ", unaligned";
  if (cp.failure_message) text += ": " + cp.failure_message;
  if (cp.external_path) text += " — " + cp.external_path;
  return text;
}

async function parts(cp) {
  // The slowest subtask's start delay, alignment, sync and async part of one
  // checkpoint, from the per-vertex details; a finished checkpoint never changes.
  if (state.parts.has(cp.id)) return state.parts.get(cp.id);
  const split = { delay: 0, align: 0, sync: 0, async: 0 };
  for (const v of state.vertices) {
    try {
      const d = await get(`jobs/${state.jobId}/checkpoints/details/${cp.id}/subtasks/${v.id}`);
      split.delay = Math.max(split.delay, d.summary.start_delay.max);
      split.align = Math.max(split.align, d.summary.alignment.duration.max);
      split.sync = Math.max(split.sync, d.summary.checkpoint_duration.sync.max);
      split.async = Math.max(split.async, d.summary.checkpoint_duration.async.max);
    } catch (e) { /* gone from the history meanwhile */ }
  }
  if (cp.status !== "IN_PROGRESS") state.parts.set(cp.id, split);
  return split;
}

function barChart(container, items, stacks, options) {
  const { svg, width, height } = svgIn(container, 200);
  const pad = { l: 60, r: 10, t: 10, b: 22 };
  if (!items.length) {
    el("text", { x: width / 2 - 60, y: height / 2 }, svg, "no checkpoint yet");
    return;
  }
  const top = Math.max(1, ...items.map(it => Math.max(options.total(it), stacks.reduce((a, s) => a + s.value(it), 0))));
  const slot = (width - pad.l - pad.r) / items.length;
  const bw = Math.max(3, Math.min(40, slot * 0.7));
  const sy = v => (height - pad.t - pad.b) * v / top;
  el("text", { x: 4, y: pad.t + 10 }, svg, options.format(top));
  el("line", { x1: pad.l, y1: height - pad.b, x2: width - pad.r, y2: height - pad.b, stroke: "#d1d5da" }, svg);
  items.forEach((it, i) => {
    const x = pad.l + i * slot + (slot - bw) / 2;
    let y = height - pad.b;
    const g = el("g", { class: "bar", "data-checkpoint": it.id }, svg);
    g.addEventListener("click", () => { state.pinned = true; select(it.id); });
    for (const s of stacks) {
      const h = sy(s.value(it));
      y -= h;
      el("rect", { x, y, width: s.narrow ? bw / 2 : bw, height: Math.max(0, h), fill: s.color, "data-part": s.name,
        "data-value": s.value(it) }, g);
      if (s.beside) y += h;
    }
    const total = options.total(it);
    if (total > 0) el("rect", { x: x - 2, y: height - pad.b - sy(total) - 1, width: bw + 4, height: 2, fill: "#24292e",
      "data-part": "end_to_end", "data-value": total }, g);
    el("text", { x: x, y: height - 6, fill: it.status === "FAILED" ? "#b31d28" : "#444d56" }, g,
      (it.is_savepoint ? "S" : "") + it.id);
  });
}

async function drawCheckpoints(cps) {
  $("cp-total").textContent = String(cps.counts.total);
  $("cp-completed").textContent = String(cps.counts.completed);
  $("cp-failed").textContent = String(cps.counts.failed);
  $("cp-in-progress").textContent = String(cps.counts.in_progress);
  $("cp-restored").textContent = String(cps.counts.restored);
  $("cp-latest-completed").textContent = describe(cps.latest.completed);
  $("cp-latest-savepoint").textContent = describe(cps.latest.savepoint);
  $("cp-latest-failed").textContent = describe(cps.latest.failed);
  const r = cps.latest.restored;
  $("cp-latest-restored").textContent = r
    ? "#" + r.id + (r.is_savepoint ? " (savepoint)" : "") + " at " + time(r.restore_timestamp) + " — " + r.external_path
    : "none";

  const history = cps.history.slice().reverse(); // oldest first, left to right
  for (const cp of history) cp.parts = await parts(cp);
  barChart($("cp-duration-chart"), history, [
    { name: "start_delay", color: "#f9c513", value: cp => cp.parts.delay },
    { name: "alignment", color: "#d73a49", value: cp => cp.parts.align },
    { name: "sync", color: "#6f42c1", value: cp => cp.parts.sync },
    { name: "async", color: "#2188ff", value: cp => cp.parts.async },
  ], { total: cp => cp.end_to_end_duration, format: v => num(v) + " ms" });
  barChart($("cp-size-chart"), history.filter(cp => cp.status === "COMPLETED"), [
    { name: "full", color: "#a8d5b5", value: cp => cp.state_size, beside: true },
    { name: "incremental", color: "#28a745", value: cp => cp.checkpointed_size, narrow: true },
  ], { total: () => 0, format: bytes });

  const body = $("cp-history").tBodies[0];
  body.replaceChildren();
  for (const cp of cps.history) {
    const row = document.createElement("tr");
    row.dataset.checkpoint = cp.id;
    if (cp.id === state.selected) row.className = "selected";
    row.addEventListener("click", () => { state.pinned = true; select(cp.id); });
    cell(row, String(cp.id));
    cell(row, cp.checkpoint_type);
    cell(row, cp.status);
    cell(row, cp.num_acknowledged_subtasks + "/" + cp.num_subtasks);
    cell(row, time(cp.trigger_timestamp));
    cell(row, ms(cp.end_to_end_duration));
    cell(row, bytes(cp.checkpointed_size));
    cell(row, bytes(cp.state_size));
    cell(row, bytes(cp.processed_data));
    cell(row, bytes(cp.persisted_data));
    body.appendChild(row);
  }
  if (!state.pinned && cps.history.length) await select(cps.history[0].id, true);
  else if (state.selected !== null) await select(state.selected, true);
}

async function select(id, quiet) {
  state.selected = id;
  $("selected-checkpoint").textContent = "#" + id;
  for (const row of $("cp-history").tBodies[0].rows) row.className = Number(row.dataset.checkpoint) === id ? "selected" : "";
  const body = $("subtask-table").tBodies[0];
  const rows = [];
  for (const v of state.vertices) {
    let d;
    try { d = await get(`jobs/${state.jobId}/checkpoints/details/${id}/subtasks/${v.id}`); }
    catch (e) { if (!quiet) showError(e); continue; }
    for (const s of d.subtasks) {
      const row = document.createElement("tr");
      row.dataset.vertex = v.id;
      row.dataset.subtask = s.index;
      cell(row, v.id);
      cell(row, String(s.index));
      cell(row, s.status);
      if (s.status === "completed") {
        cell(row, time(s.ack_timestamp));
        cell(row, ms(s.end_to_end_duration));
        cell(row, bytes(s.checkpointed_size));
        cell(row, bytes(s.state_size));
        cell(row, ms(s.checkpoint.sync));
        cell(row, ms(s.checkpoint.async));
        cell(row, ms(s.alignment.duration));
        cell(row, bytes(s.alignment.processed));
        cell(row, bytes(s.alignment.persisted));
        cell(row, ms(s.start_delay));
        cell(row, s.unaligned_checkpoint ? "yes" : "no");
      } else {
        for (let i = 0; i < 11; i++) cell(row, "—");
      }
      rows.push(row);
    }
  }
  if (!rows.length) {  // it left the history (which keeps the newest ones, as Flink's does)
    const row = document.createElement("tr");
    const td = cell(row, "checkpoint #" + id + " is no longer in the history");
    td.colSpan = 14;
    rows.push(row);
  }
  body.replaceChildren(...rows);
}

function showError(e) {
  const box = $("error");
  box.hidden = false;
  box.textContent = "could not refresh: " + e.message;
}

async function refresh() {
  try {
    if (state.jobId === null) state.jobId = (await get("jobs")).jobs[0].id;
    const job = await get(`jobs/${state.jobId}`);
    const recent = await get(`jobs/${state.jobId}/recent-progress`);
    const pressure = {};
    for (const v of job.vertices) pressure[v.id] = await get(`jobs/${state.jobId}/vertices/${v.id}/backpressure`);
    state.rates = await subtaskRates();
    showJob(job);
    drawGraph(job, pressure);
    drawProgress(recent);
    await drawCheckpoints(await get(`jobs/${state.jobId}/checkpoints`));
    $("error").hidden = true;
    $("refreshed").textContent = "refreshed " + new Date().toLocaleTimeString();
    document.body.dataset.refreshed = String(Date.now());
  } catch (e) {
    showError(e);
  }
}

async function subtaskRates() {
  // numRecordsInPerSecond per subtask, from the job's Prometheus metrics
  const rates = {};
  let text;
  try {
    const response = await fetch("metrics", { credentials: "same-origin", cache: "no-store" });
    if (!response.ok) return rates;
    text = await response.text();
  } catch (e) { return rates; }
  for (const line of text.split("\n")) {
    if (!line.startsWith("flink_taskmanager_job_task_numRecordsInPerSecond{")) continue;
    const task = /task_id="([^"]*)"/.exec(line), sub = /subtask_index="(\d+)"/.exec(line);
    const value = Number(line.slice(line.lastIndexOf(" ") + 1));
    if (!task || !sub) continue;
    (rates[task[1]] = rates[task[1]] || {})[Number(sub[1])] = value;
  }
  return rates;
}

refresh();
if (REFRESH_MS > 0) setInterval(refresh, Math.max(250, REFRESH_MS));
