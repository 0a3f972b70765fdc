// The status page. It first draws the /bankml/status answer it was served with (the #initial element:
// real values at the first paint, no request needed), then polls GET /bankml/status every 3 s. It
// renders with the DOM (never innerHTML: every string comes from the server and is shown as text). A
// null is "not measured", with the monitor's reason beside it or as the tooltip; nothing is estimated.
// The charts keep the last 10 minutes of polls in the page; a rate is the change of the server's
// lifetime totals (dashboard.totals) over the last RATE_S at least, as Prometheus' rate() of the same
// counters: answers add their tokens as they complete, so one poll's interval alone is all or nothing.
// Options in the fragment (the route takes no query; a fragment never leaves the browser): #poll=0 draws
// the served state only (the tests' first paint), #poll_ms=N polls every N ms, #key=KEY (below).
"use strict";

const params = new URLSearchParams(location.hash.slice(1));
const POLL_MS = Math.max(250, Number(params.get("poll_ms")) || 3000);
const POLLING = params.get("poll") !== "0";
const WINDOW_S = 600;  // the charts keep this long; they span the time they hold, up to it
// A prompt with this few tokens left to compute shows "cached": the rate of one or two tokens is one
// forward pass's fixed cost (1-4 tok/s on a CPU), not the prompt throughput.
const FEW_UNCACHED = 4;
// An answer of one token has no decode to rate: its token came with the prompt's pass, and the record's
// eval_tps (completion tokens over eval_ms, as llama-server's) is one over the microseconds after it.
const ONE_TOKEN = "one token, no decode";
const RATE_S = 10;  // a rate spans at least this much, once the page has held it
const FIRST = "a rate needs two polls: at the next one";
const $ = (id) => document.getElementById(id);
const CHART = $("chart").content;  // a chart's markup (status.html), cloned per chart
const SVG = CHART.querySelector("svg").namespaceURI;  // as the HTML parser puts an <svg> in it

function bytes(n) {
  if (n === null || n === undefined) return null;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(n >= 100 ? 0 : 1)) + " " + units[i];
}

function num(x, digits) {
  return x === null || x === undefined ? null : Number(x).toFixed(digits);
}

function duration(s) {
  s = Math.floor(s);
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
  return (d ? d + "d " : "") + (d || h ? h + "h " : "") + m + "m " + (s % 60) + "s";
}

function clock(unixS) {
  return unixS ? new Date(unixS * 1000).toLocaleTimeString() : null;
}

// Put `text` in `el`, or "not measured" with the reason when it is null.
function show(el, text, why) {
  el.textContent = "";
  el.classList.remove("na");
  el.removeAttribute("title");
  if (text === null || text === undefined) {
    el.textContent = "not measured";
    el.classList.add("na");
    if (why) el.title = why;
  } else {
    el.textContent = String(text);
  }
}

function row(cells, reasons) {
  const tr = document.createElement("tr");
  cells.forEach((c, i) => {
    const td = document.createElement("td");
    show(td, c, reasons ? reasons[i] : undefined);
    tr.appendChild(td);
  });
  return tr;
}

function fill(tbody, rows, emptyText, width) {
  tbody.replaceChildren(...rows);
  if (!rows.length) {
    const tr = document.createElement("tr"), td = document.createElement("td");
    tr.className = "empty";
    td.colSpan = width;
    td.textContent = emptyText;
    tr.appendChild(td);
    tbody.appendChild(tr);
  }
}

// Why no GPU reading: the monitor's reasons for each backend it tried (gpus.nvml, gpus.amdsmi, ...).
function gpuWhy(u) {
  const why = u.unavailable || {};
  const reasons = Object.keys(why).filter((k) => k.startsWith("gpus")).map((k) => why[k]);
  return "no GPU found" + (reasons.length ? " (" + reasons.join("; ") + ")" : "");
}

// ---- charts --------------------------------------------------------------------------------------

// The point rates are taken from: the newest at least RATE_S old, else the oldest (null: none yet).
function rateBase(at) {
  let base = ring.length ? ring[0] : null;
  for (const p of ring) if (p.t <= at - RATE_S) base = p;
  return base;
}

// One point of every chart from a /bankml/status answer and the point its rates start from: each value,
// or why it has none (`why`: the source is absent here, in the server's words; `note`: measured, nothing
// to show).
function sample(s, base) {
  const d = s.dashboard, u = s.usage, t = d.totals, kv = d.kv_cache;
  const p = { t: s.at, totals: t, kv, v: {}, why: {}, note: {}, keys: {} };
  const put = (key, value, why, note) => {
    p.v[key] = value === undefined ? null : value;
    if (p.v[key] === null && why) p.why[key] = why;
    if (p.v[key] === null && note) p.note[key] = note;
  };
  const pt = base && base.totals;
  const dt = base ? s.at - base.t : 0;
  const fresh = pt && dt > 0 && t.answers >= pt.answers;  // a restarted server's totals start again
  const uncached = (x) => x.prompt_tokens - x.cached_tokens;
  // in front of llama-server, its answers never pass through this process's meters
  const p0 = s.serve.mode === "native" ? null : "llama-server answers here and measures its answers itself";
  put("gen", fresh && !p0 ? (t.completion_tokens - pt.completion_tokens) / dt : null, p0, FIRST);
  put("prompt", fresh && !p0 ? (uncached(t) - uncached(pt)) / dt : null, p0, FIRST);

  const within = "answers of the last " + d.ttft.window_s + " s";
  put("ttft50", d.ttft.p50_ms, p0, d.ttft.unavailable);
  put("ttft95", d.ttft.p95_ms, p0, d.ttft.unavailable);
  p.keys.ttft = [["ttft50", "p50 of the " + within], ["ttft95", "p95"]];

  const noEngine = "no engine runs in this process (llama-server counts its own)";
  put("running", s.serve.requests_running, noEngine);
  put("waiting", s.serve.requests_waiting, noEngine);

  put("kv", kv.usage_ratio === undefined ? null : kv.usage_ratio * 100, kv.unavailable);
  if (kv.prefix_queries_tokens === undefined) put("hit", null, kv.unavailable);
  else if (!fresh || !base.kv || base.kv.prefix_queries_tokens === undefined) put("hit", null, null, FIRST);
  else {
    const queried = kv.prefix_queries_tokens - base.kv.prefix_queries_tokens;
    put("hit", queried > 0 ? 100 * (kv.prefix_hits_tokens - base.kv.prefix_hits_tokens) / queried : null, null,
      "no prompt looked up in the last " + RATE_S + " s");
  }

  const uw = u.unavailable || {};
  put("rss", u.rss_bytes, uw.rss_bytes);
  put("pkgw", u.package_watts, uw.package_watts);
  p.keys.memory = [["rss", "server RSS"]];
  p.keys.power = [["pkgw", "CPU package"]];
  for (const g of u.gpus || []) {
    const gw = g.unavailable || {};
    put("vram " + g.card, g.vram_used_bytes, gw.vram_used_bytes);
    p.keys.memory.push(["vram " + g.card, g.card + " VRAM"]);
    if (g.gtt_total_bytes) {
      put("gtt " + g.card, g.gtt_used_bytes, gw.gtt_used_bytes);
      p.keys.memory.push(["gtt " + g.card, g.card + " GTT"]);
    }
    put("gpuw " + g.card, g.power_watts, gw.power_watts);
    p.keys.power.push(["gpuw " + g.card, g.card]);
  }
  if (!(u.gpus || []).length) {
    put("gpu", null, gpuWhy(u));
    p.keys.memory.push(["gpu", "GPU memory"]);
    p.keys.power.push(["gpu", "GPU"]);
  }

  const last = s.metrics.records.length ? s.metrics.records[s.metrics.records.length - 1] : null;
  if (p0) {
    put("jpt", null, p0);
  } else if (t.energy_j === null) {
    put("jpt", null, last ? (last.unavailable || {}).energy_j : null, last ? null : "no answer completed yet");
  } else if (!fresh || pt.energy_j === null) {
    put("jpt", null, null, FIRST);
  } else {
    const tokens = t.energy_tokens - pt.energy_tokens;
    put("jpt", tokens > 0 ? (t.energy_j - pt.energy_j) / tokens : null, null, "no measured answer in the last " + RATE_S + " s");
  }
  return p;
}

const CHARTS = [
  { id: "tokens", title: "Tokens per second", unit: "tok/s", fmt: (x) => num(x, x < 10 ? 2 : 1) + " tok/s",
    keys: () => [["gen", "generated"], ["prompt", "prompt, uncached"]] },
  { id: "ttft", title: "Time to first token", unit: "ms", fmt: (x) => num(x, 1) + " ms", keys: (p) => p.keys.ttft },
  { id: "requests", title: "Requests", unit: "count", fmt: (x) => String(Math.round(x)),
    keys: () => [["running", "running"], ["waiting", "waiting"]] },
  { id: "cache", title: "KV cache", unit: "%", fmt: (x) => num(x, 1) + " %", max: 100,
    keys: () => [["kv", "pool in use"], ["hit", "prefix-cache hit rate"]] },
  { id: "memory", title: "Memory", unit: "bytes", fmt: bytes, axis: bytes, keys: (p) => p.keys.memory },
  { id: "power", title: "Power", unit: "W", fmt: (x) => num(x, 1) + " W", keys: (p) => p.keys.power },
  { id: "energy", title: "Energy per generated token", unit: "J/token", fmt: (x) => num(x, 4) + " J/token",
    keys: () => [["jpt", "J/token"]] },
];
const COLORS = ["#1f5fbf", "#b54708", "#0f7a3c", "#7a2ea8", "#0e7490", "#9f1239"];
const DASHES = ["", "6 3", "2 3", "8 3 2 3", "4 2", "1 2"];
const W = 480, H = 150, L = 64, R = 10, T = 10, B = 20;  // the plot's box in the SVG's units

const ring = [];  // the last WINDOW_S of points, oldest first (each chart's data-points counts its own)

function el(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}

// An axis label: the number alone (the unit is in the chart's title).
function compact(x) {
  if (x >= 1e6) return +(x / 1e6).toFixed(1) + "M";
  if (x >= 1e4) return +(x / 1e3).toFixed(0) + "k";
  return String(+x.toFixed(x >= 10 ? 0 : x >= 1 ? 1 : 3));
}

function ago(s) {
  return s >= 90 ? "−" + +(s / 60).toFixed(1) + " min" : "−" + +s.toFixed(s >= 10 ? 0 : 1) + " s";
}

function niceMax(x) {
  if (!(x > 0)) return 1;
  const m = Math.pow(10, Math.floor(Math.log10(x)));
  return [1, 2, 2.5, 5, 10].map((f) => f * m).find((v) => v >= x);
}

function setupCharts() {
  $("charts").replaceChildren(...CHARTS.map((c) => {
    const fig = CHART.firstElementChild.cloneNode(true), cap = fig.querySelector("figcaption");
    fig.id = "chart-" + c.id;
    fig.dataset.points = "0";
    cap.id = "chart-" + c.id + "-title";
    cap.textContent = c.title + " (" + c.unit + ")";
    fig.querySelector("svg").setAttribute("viewBox", `0 0 ${W} ${H}`);
    fig.querySelector("svg").setAttribute("aria-labelledby", cap.id);
    return fig;
  }));
}

function drawChart(c) {
  const fig = $("chart-" + c.id), svg = fig.querySelector("svg"), legend = fig.querySelector("ul");
  const last = ring[ring.length - 1], keys = c.keys(last);
  const t1 = last.t, span = Math.max(t1 - ring[0].t, 1e-3), t0 = t1 - span;
  let top = 0, points = 0;
  for (const p of ring) {
    let any = false;
    for (const [k] of keys) {
      const v = p.v[k];
      if (v !== null && v !== undefined) { top = Math.max(top, v); any = true; }
    }
    points += any ? 1 : 0;
  }
  fig.dataset.points = String(points);
  top = c.max || niceMax(top);
  const x = (t) => L + (t - t0) / span * (W - L - R), y = (v) => H - B - v / top * (H - T - B);
  const axis = c.axis || compact;
  const parts = [];
  for (const f of [0, 0.5, 1]) {
    parts.push(el("line", { x1: L, x2: W - R, y1: y(f * top), y2: y(f * top), class: "grid" }));
    parts.push(el("text", { x: L - 6, y: y(f * top) + 4, "text-anchor": "end" }, axis(f * top)));
  }
  const times = ring.length > 1 ? [[ago(span), t0, "start"], [ago(span / 2), t0 + span / 2, "middle"]] : [];
  [...times, ["now", t1, "end"]].forEach(([label, t, a]) =>
    parts.push(el("text", { x: x(t), y: H - 4, "text-anchor": a }, label)));
  const items = keys.map(([k, label], i) => {
    const style = { stroke: COLORS[i % COLORS.length], "stroke-dasharray": DASHES[i % DASHES.length] };
    let d = "", prev = false;
    ring.forEach((p, j) => {
      const v = p.v[k];
      if (v === null || v === undefined) { prev = false; return; }
      d += (prev ? "L" : "M") + x(p.t).toFixed(1) + " " + y(v).toFixed(1);
      const next = ring[j + 1] && ring[j + 1].v[k];
      if (!prev && (next === null || next === undefined)) {  // a point alone still shows
        parts.push(el("circle", { cx: x(p.t), cy: y(v), r: 2.5, fill: style.stroke }));
      }
      prev = true;
    });
    if (d) parts.push(el("path", { d, class: "series", ...style }));
    const li = document.createElement("li"), swatch = el("svg", { width: 22, height: 8, "aria-hidden": "true" });
    swatch.append(el("line", { x1: 0, x2: 22, y1: 4, y2: 4, class: "series", ...style }));
    const v = last.v[k], value = document.createElement("span");
    if (v !== null && v !== undefined) {
      value.textContent = c.fmt(v);
    } else {
      value.className = "na";
      value.textContent = last.why[k] ? "not measured here, because " + last.why[k] : last.note[k] || "not measured";
    }
    li.append(swatch, " " + label + ": ", value);
    return li;
  });
  svg.replaceChildren(...parts);
  legend.replaceChildren(...items);
}

function renderCharts(s) {
  const prev = ring.length ? ring[ring.length - 1] : null;
  if (prev && s.at <= prev.t) return;  // the same answer twice
  ring.push(sample(s, rateBase(s.at)));
  while (ring[0].t < s.at - WINDOW_S) ring.shift();
  const t = s.dashboard.totals;  // lifetime, as bankml_*_tokens_total
  $("totals").textContent = "since start: " + t.answers + " answers · " + t.prompt_tokens + " prompt tokens (" +
    t.cached_tokens + " from the cache) · " + t.completion_tokens + " generated";
  CHARTS.forEach(drawChart);
}

// ---- tables --------------------------------------------------------------------------------------

function renderVerification(s) {
  const v = s.verified || {};
  $("version").textContent = s.bankml || "";
  $("mode").textContent = s.serve && s.serve.mode === "native" ? "native engine" : "in front of llama-server";
  show($("model-name"), [v.name, v.arch].filter(Boolean).join(" · ") || null, "no verification yet");
  show($("model-sha256"), v.model_sha256 || null, "no verification yet");
  show($("model-guard"), v.guard ? v.guard + " (" + (v.engine || "") + " rules), verdict " + v.verdict : null);
  show($("model-path"), s.model);
  show($("model-engine"), s.engine);
  show($("model-hashed"), s.hashed_at ? new Date(s.hashed_at * 1000).toLocaleString() : null);
}

// The prompt rate as the server computes it (uncached tokens over prompt_ms), with how many tokens it
// is over where the cache served the rest, or "cached" when all but FEW_UNCACHED came from the cache.
function promptRate(r) {
  const uncached = r.prompt_tokens - r.cached_tokens;
  if (r.cached_tokens > 0 && uncached <= FEW_UNCACHED) return uncached ? "cached, " + uncached + " new" : "cached";
  const rate = num(r.prompt_tps, 2);
  return rate !== null && r.cached_tokens > 0 ? rate + " (" + uncached + " new)" : rate;
}

function renderAnswers(m) {
  const why = (r, k) => (r.unavailable || {})[k];
  let summary = m.kept + " of the last " + m.keep + " answers kept · " + m.prompt_tokens + " prompt and " +
    m.completion_tokens + " completion tokens";
  summary += m.energy_j === null ? " · energy not measured" :
    " · " + m.energy_j.toFixed(3) + " J, " + m.joules_per_token.toFixed(4) + " J/token";
  const last = m.records.length ? m.records[m.records.length - 1] : null;
  if (last && last.energy_j === null && why(last, "energy_j")) summary += " (" + why(last, "energy_j") + ")";
  $("answers-summary").textContent = summary;
  const rows = m.records.slice().reverse().map((r) => row(
    [clock(r.at), r.prompt_tokens, r.cached_tokens, r.completion_tokens, num(r.ttft_ms, 1), promptRate(r),
      r.completion_tokens === 1 ? ONE_TOKEN : num(r.eval_tps, 2), r.finish, num(r.energy_j, 3), num(r.joules_per_token, 4)],
    [null, null, null, null, why(r, "ttft_ms"), "no uncached prompt tokens", "no completion tokens", null,
      why(r, "energy_j"), why(r, "joules_per_token") || why(r, "energy_j")]));
  fill($("answers-table").tBodies[0], rows, "no completed answer yet", 10);
}

function renderLimiter(lim) {
  const lw = (lim && lim.unavailable) || {};
  // memory_fraction bounds a GPU allocator (XLA_PYTHON_CLIENT_MEM_FRACTION); a CPU has none to bound
  const onGpu = lim && lim.device && !lim.device.startsWith("cpu");
  const share = onGpu ? row(["GPU memory share allowed", num(lim.limit * 100, 0) + " %" + (lw.limit ? " (" + lw.limit + ")" : "")]) :
    row(["GPU memory share", "applies to a GPU only: " + (lw.allocated_bytes || "this process has no GPU device")]);
  fill($("limiter-table").tBodies[0], lim ? [
    row(["device", lim.device || null], [null, "no JAX device in this process"]),
    share,
    row(["allocator holds", lim.allocated_bytes === null ? null : bytes(lim.allocated_bytes) + " of " +
      (lim.limit_bytes === null ? "?" : bytes(lim.limit_bytes))], [null, lw.allocated_bytes]),
    row(["sequences decoding", lim.sequences_in_use + " of " + lim.sequences_max]),
  ] : [], "no engine runs in this process", 2);
}

function renderUsage(u) {
  const why = u.unavailable || {};
  $("usage-sampled").textContent = u.sampled_at ? "sampled " + clock(u.sampled_at) + " over " + u.interval_ms + " ms" : "";
  const used = u.mem_total_bytes - u.mem_available_bytes;
  const memText = u.mem_total_bytes ? bytes(used) + " used of " + bytes(u.mem_total_bytes) +
    " (" + bytes(u.mem_available_bytes) + " available)" : null;
  const swapText = u.swap_total_bytes ? bytes(u.swap_total_bytes - u.swap_free_bytes) + " used of " +
    bytes(u.swap_total_bytes) : "none";
  fill($("usage-table").tBodies[0], [
    row(["CPU cores", u.cores]),
    row(["memory", memText], [null, why.mem_total_bytes]),
    row(["swap", swapText]),
    row(["server RSS (all processes)", bytes(u.rss_bytes)]),
    row(["server CPU %", num(u.cpu_percent, 1)]),
    row(["CPU package power", u.package_watts === null ? null : num(u.package_watts, 2) + " W"], [null, why.package_watts]),
  ], "no usage", 2);
  fill($("process-table").tBodies[0], (u.processes || []).map((p) =>
    row([p.name, p.pid, bytes(p.rss_bytes), num(p.cpu_percent, 1)])), "no process", 4);
  fill($("gpu-table").tBodies[0], (u.gpus || []).map((g) => {
    const gw = g.unavailable || {};
    const pool = (a, b) => (g[a] === null || g[b] === null ? null : bytes(g[a]) + " / " + bytes(g[b]));
    const t = g.throttle;
    const thr = !t ? null : t.throttled ? t.reasons.filter((r) => r !== "gpu_idle").join(", ") :
      t.reasons.includes("gpu_idle") ? "none (idle)" : "none";
    return row([g.card + (g.driver ? " (" + g.driver + ")" : ""), g.name, g.busy_percent,
      pool("vram_used_bytes", "vram_total_bytes"), pool("gtt_used_bytes", "gtt_total_bytes"), num(g.power_watts, 1),
      num(g.power_limit_watts, 0), g.temperature_c, thr],
    [null, gw.name, gw.busy_percent, gw.vram_used_bytes, gw.gtt_used_bytes, gw.power_watts,
      gw.power_limit_watts, gw.temperature_c, gw.throttle]);
  }), gpuWhy(u), 9);
  renderLimiter(u.gpu_limiter);
  const list = $("unavailable");
  list.replaceChildren(...Object.keys(why).map((k) => {
    const li = document.createElement("li"), code = document.createElement("code");
    code.textContent = k;
    li.append(code, ": " + why[k]);
    return li;
  }));
}

function render(s) {
  renderVerification(s);
  renderAnswers(s.metrics);
  renderUsage(s.usage);
  if (s.dashboard) renderCharts(s);
  $("uptime").textContent = duration(s.serve.uptime_s);
}

// ---- polling -------------------------------------------------------------------------------------

// With --api-key, /bankml/status needs the key (and the page is served without its state): open the
// page as /#key=KEY. A fragment never leaves the browser, so the key is in no request line and no log.
function apiKey() {
  const m = /(?:^#|&)key=([^&]*)/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}

async function refresh() {
  const live = $("live");
  try {
    const key = apiKey();
    const headers = key ? { Authorization: "Bearer " + key } : {};
    const r = await fetch("/bankml/status", { cache: "no-store", headers });
    if (r.status === 401) throw new Error("HTTP 401: this server needs its API key; open this page as /#key=KEY");
    if (!r.ok) throw new Error("HTTP " + r.status);
    const s = await r.json();
    render(s);
    live.textContent = "updated " + clock(s.at);
    live.className = "live ok";
  } catch (e) {
    live.textContent = "cannot reach the server (" + e.message + ")";
    live.className = "live bad";
  } finally {
    setTimeout(refresh, POLL_MS);
  }
}

setupCharts();
const initial = JSON.parse($("initial").textContent || "null");
if (initial) {
  render(initial);
  $("live").textContent = "as served at " + clock(initial.at) + (POLLING ? "" : " (not polling)");
  $("live").className = "live ok";
}
if (POLLING) {
  if (initial) setTimeout(refresh, POLL_MS);
  else refresh();
}
