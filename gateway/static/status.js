// The status page: polls GET /bankml/status every 3 s and renders it with the DOM (never innerHTML:
// every string comes from the server and is shown as text). A null is "not measured", with the
// monitor's reason as the tooltip.
"use strict";

const POLL_MS = 3000;
const $ = (id) => document.getElementById(id);

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
    [clock(r.at), r.prompt_tokens, r.cached_tokens, r.completion_tokens, num(r.ttft_ms, 1), num(r.prompt_tps, 2),
      num(r.eval_tps, 2), r.finish, num(r.energy_j, 3), num(r.joules_per_token, 4)],
    [null, null, null, null, why(r, "ttft_ms"), "no uncached prompt tokens", "no completion tokens", null,
      why(r, "energy_j"), why(r, "joules_per_token") || why(r, "energy_j")]));
  fill($("answers-table").tBodies[0], rows, "no completed answer yet", 10);
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
  }), "no GPU found" + (why["gpus.nvml"] ? " (" + why["gpus.nvml"] + ")" : ""), 9);
  const lim = u.gpu_limiter;
  const lw = (lim && lim.unavailable) || {};
  fill($("limiter-table").tBodies[0], lim ? [
    row(["device", lim.device || null], [null, "no JAX device in this process"]),
    row(["memory share allowed", num(lim.limit * 100, 0) + " %" + (lw.limit ? " (" + lw.limit + ")" : "")]),
    row(["allocator holds", lim.allocated_bytes === null ? null : bytes(lim.allocated_bytes) + " of " +
      (lim.limit_bytes === null ? "?" : bytes(lim.limit_bytes))], [null, lw.allocated_bytes]),
    row(["sequences decoding", lim.sequences_in_use + " of " + lim.sequences_max]),
  ] : [], "no engine runs in this process", 2);
  const list = $("unavailable");
  list.replaceChildren(...Object.keys(why).map((k) => {
    const li = document.createElement("li"), code = document.createElement("code");
    code.textContent = k;
    li.append(code, ": " + why[k]);
    return li;
  }));
}

// With --api-key, /bankml/status needs the key: open the page as /#key=KEY. A fragment never
// leaves the browser, so the key is in no request line and no log.
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
    renderVerification(s);
    renderAnswers(s.metrics);
    renderUsage(s.usage);
    $("uptime").textContent = duration(s.serve.uptime_s);
    live.textContent = "updated " + clock(s.at);
    live.className = "live ok";
  } catch (e) {
    live.textContent = "cannot reach the server (" + e.message + ")";
    live.className = "live bad";
  } finally {
    setTimeout(refresh, POLL_MS);
  }
}

refresh();
