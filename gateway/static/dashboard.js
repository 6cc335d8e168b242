// mmserve dashboard: polls /dashboard/data (the gateway's reduction of every replica's
// /metrics, see gateway/dashboard.py) and draws tables plus uPlot charts. Cells carry ids
// (llm-<i>-<field>, encoder-<i>-<field>) so a test can read what is shown.
"use strict";

const POLL_MS = 2000;
const KEEP = 150; // points of history per series (5 minutes at 2 s)
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

const fmt = {
  pct: (x) => (x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%"),
  int: (x) => String(Math.round(x)),
  num: (x) => (x === null || x === undefined ? "-" : x.toFixed(2)),
  ms: (x) => (x === null || x === undefined ? "-" : (1000 * x).toFixed(1) + " ms"),
};

// upper bound of the bucket that holds quantile q (as gateway/dashboard.py Histogram.quantile)
function quantile(h, q) {
  if (!h || h.count <= 0) return null;
  for (let i = 0; i < h.le.length; i++) if (h.cumulative[i] >= q * h.count) return h.le[i];
  return null;
}

function cell(id, text) {
  const td = document.createElement("td");
  td.id = id;
  td.textContent = text;
  return td;
}

function fillTable(tableId, rows, cols) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren();
  rows.forEach((r, i) => {
    const tr = document.createElement("tr");
    const name = cell(`${tableId}-${i}-url`, r.url + (r.up ? "" : "  (down)"));
    if (!r.up) name.className = "down";
    tr.appendChild(name);
    for (const [key, f] of cols) tr.appendChild(cell(`${tableId}-${i}-${key}`, r.up ? f(r) : "-"));
    body.appendChild(tr);
  });
}

const LLM_COLS = [
  ["role", (r) => r.role],
  ["handovers", (r) => fmt.int(r.handovers)],
  ["kv_full_usage", (r) => fmt.pct(r.kv_full_usage)],
  ["kv_swa_usage", (r) => fmt.pct(r.kv_swa_usage)],
  ["running", (r) => fmt.int(r.running)],
  ["waiting", (r) => fmt.int(r.waiting)],
  ["prompt_tokens", (r) => fmt.int(r.prompt_tokens)],
  ["prefix_hit_tokens", (r) => fmt.int(r.prefix_hit_tokens)],
  ["prefix_hit_rate", (r) => fmt.pct(r.prefix_hit_rate)],
  ["generation_tokens", (r) => fmt.int(r.generation_tokens)],
  ["spec_acceptance_rate", (r) => fmt.pct(r.spec_acceptance_rate)],
  ["spec_mean_acceptance_length", (r) => (r.spec_mean_acceptance_length == null ? "-" : r.spec_mean_acceptance_length.toFixed(2))],
  ["ttft_p50", (r) => fmt.ms(quantile(r.ttft, 0.5))],
  ["itl_p50", (r) => fmt.ms(quantile(r.itl, 0.5))],
];
const ENC_COLS = [
  ["cache_lookups", (r) => fmt.int(r.cache_lookups)],
  ["cache_hits", (r) => fmt.int(r.cache_hits)],
  ["cache_hit_rate", (r) => fmt.pct(r.cache_hit_rate)],
  ["forward_passes", (r) => fmt.int(r.forward_passes)],
  ["forward_items", (r) => fmt.int(r.forward_items)],
  ["mean_batch_size", (r) => fmt.num(r.mean_batch_size)],
  ["queue_wait_p50", (r) => fmt.ms(quantile(r.queue_wait, 0.5))],
];

// ---- charts -------------------------------------------------------------------------------
const charts = {};

function chartBox(parent, key, title) {
  const box = document.createElement("div");
  box.className = "chart";
  box.id = `chart-${key}`;
  const h = document.createElement("h3");
  h.textContent = title;
  box.appendChild(h);
  document.getElementById(parent).appendChild(box);
  return box;
}

// time series: one line per (replica, field)
const history = { t: [], lines: {} };

function seriesChart(key, title, names, yFmt, yRange) {
  const opts = {
    width: 440, height: 200,
    scales: { x: { time: true }, y: { range: yRange } },
    series: [{}, ...names.map((n, i) => ({ label: n, stroke: COLORS[i % COLORS.length], width: 2 }))],
    axes: [{}, { values: (u, ticks) => ticks.map(yFmt) }],
  };
  return new uPlot(opts, [[], ...names.map(() => [])], chartBox("series", key, title));
}

function histChart(key, title, labels) {
  const opts = {
    width: 440, height: 200,
    scales: { x: { time: false } },
    series: [{}, { label: "count", fill: "#1f77b455", stroke: "#1f77b4", paths: uPlot.paths.bars({ size: [0.8, 60] }) }],
    axes: [{ values: (u, ticks) => ticks.map((i) => (Number.isInteger(i) && labels[i] !== undefined ? labels[i] : "")) }, {}],
  };
  return new uPlot(opts, [labels.map((_, i) => i), labels.map(() => 0)], chartBox("hists", key, title));
}

function bucketCounts(h) {
  return h.cumulative.map((c, i) => c - (i ? h.cumulative[i - 1] : 0));
}

function leLabel(le, seconds) {
  if (le === null) return "+Inf";
  return seconds ? (le < 1 ? (le * 1000).toFixed(le < 0.01 ? 1 : 0) + "ms" : le + "s") : String(le);
}

function sumHist(hs) {
  const withData = hs.filter((h) => h && h.le.length);
  if (!withData.length) return null;
  const out = { le: withData[0].le, cumulative: withData[0].le.map(() => 0), count: 0 };
  for (const h of withData) {
    h.cumulative.forEach((c, i) => (out.cumulative[i] += c));
    out.count += h.count;
  }
  return out;
}

function drawHist(key, title, h, seconds) {
  if (!h) return;
  if (!charts[key]) charts[key] = histChart(key, title, h.le.map((le) => leLabel(le, seconds)));
  charts[key].setData([h.le.map((_, i) => i), bucketCounts(h)]);
}

function pushSeries(key, title, named, yFmt, yRange) {
  const names = Object.keys(named);
  if (!charts[key]) charts[key] = seriesChart(key, title, names, yFmt, yRange);
  for (const n of names) {
    const id = `${key}/${n}`;
    (history.lines[id] = history.lines[id] || []).push(named[n]);
    if (history.lines[id].length > KEEP) history.lines[id].shift();
  }
  charts[key].setData([history.t, ...names.map((n) => history.lines[`${key}/${n}`])]);
}

function render(d) {
  fillTable("llm", d.llm, LLM_COLS);
  fillTable("encoder", d.encoder, ENC_COLS);
  history.t.push(d.time);
  if (history.t.length > KEEP) history.t.shift();
  const kv = {}, queue = {}, hit = {};
  d.llm.forEach((r, i) => {
    kv[`llm-${i} full`] = r.kv_full_usage;
    kv[`llm-${i} swa`] = r.kv_swa_usage;
    queue[`llm-${i} running`] = r.running;
    queue[`llm-${i} waiting`] = r.waiting;
    hit[`llm-${i} prefix`] = r.prefix_hit_rate;
  });
  d.encoder.forEach((r, i) => (hit[`enc-${i} cache`] = r.cache_hit_rate));
  const pct = (v) => (100 * v).toFixed(0) + "%";
  pushSeries("kv", "KV pool use", kv, pct, [0, 1]);
  pushSeries("queue", "LLM queue depth", queue, (v) => v.toFixed(0), (u, lo, hi) => [0, Math.max(4, hi)]);
  pushSeries("hits", "hit rates (prefix, encoder cache)", hit, pct, [0, 1]);
  drawHist("ttft", "TTFT (all LLM replicas)", sumHist(d.llm.map((r) => r.ttft)), true);
  drawHist("itl", "inter-token latency (all LLM replicas)", sumHist(d.llm.map((r) => r.itl)), true);
  drawHist("batch", "encoder batch size (items per forward)", sumHist(d.encoder.map((r) => r.batch_size)), false);
  drawHist("gw_ttft", "gateway TTFT (streams)", d.gateway.ttft.le.length ? d.gateway.ttft : null, true);
  document.getElementById("updated").textContent = new Date(d.time * 1000).toLocaleTimeString();
  document.body.dataset.ready = String(Number(document.body.dataset.ready) + 1);
}

// The API key (with API keys set): from the URL fragment, /dashboard#key=..., which the browser
// never sends to the server (a ?key= query lands in access logs and proxies), or typed into the
// form; kept for this tab in sessionStorage, taken out of the address bar, sent as a bearer header.
const KEY_SLOT = "mmserve-dashboard-key";

function takeKeyFromFragment() {
  const key = new URLSearchParams(location.hash.slice(1)).get("key");
  if (key) {
    sessionStorage.setItem(KEY_SLOT, key);
    window.history.replaceState(null, "", location.pathname);  // "history" here is the charts' series
  }
}

function askForKey(message) {
  document.getElementById("auth").textContent = message;
  document.getElementById("keyform").hidden = false;
}

document.getElementById("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const input = document.getElementById("key");
  sessionStorage.setItem(KEY_SLOT, input.value.trim());
  input.value = "";
  document.getElementById("keyform").hidden = true;
  document.getElementById("auth").textContent = "";
});

// what the gateway and its replicas leave open (no API key / service token off loopback)
function renderWarnings(warnings) {
  const list = document.getElementById("warnings");
  list.replaceChildren();
  (warnings || []).forEach((w, i) => {
    const li = document.createElement("li");
    const span = document.createElement("span");
    span.id = `warning-${i}`;
    span.textContent = w;
    li.appendChild(span);
    list.appendChild(li);
  });
  list.hidden = !list.children.length;
}

async function poll() {
  try {
    const key = sessionStorage.getItem(KEY_SLOT);
    const r = await fetch("/dashboard/data", { cache: "no-store", headers: key ? { authorization: `Bearer ${key}` } : {} });
    if (r.status === 401) {
      askForKey(key ? "that API key was refused: enter another" : "this gateway needs an API key");
    } else if (r.ok) {
      const d = await r.json();
      renderWarnings(d.warnings);
      render(d);
    }
  } catch (e) {
    document.getElementById("updated").textContent = "gateway unreachable (" + e + ")";
  }
  setTimeout(poll, POLL_MS);
}

takeKeyFromFragment();
poll();
