// The live batch page: reads the server's event stream (/dashboard/events) and draws it.
// Plain browser JavaScript, no dependency. fetch() rather than EventSource, because EventSource
// can send no Authorization header and hides the status code (401 must ask for the key).
"use strict";

const EVENTS_URL = "/dashboard/events";
const KEY_STORAGE = "conveyor-api-key";
const RETRY_MIN_MS = 500, RETRY_MAX_MS = 4000;
const COLORS = {};
const state = { config: null, steps: [], rows: new Map(), blocks: "", retryMs: RETRY_MIN_MS, lastUpdate: null };

const $ = (id) => document.getElementById(id);

function cssColors() {
  const style = getComputedStyle(document.documentElement);
  for (const name of ["decode", "prefill", "steptime", "target", "free", "used", "cached", "shared", "preempted",
                      "dim", "line"]) {
    COLORS[name] = style.getPropertyValue("--" + name).trim();
  }
}

// ---------------------------------------------------------------- connection

function setStatus(kind, text, detail) {
  const status = $("status");
  status.className = "status " + kind;
  status.textContent = text;
  $("status-detail").textContent = detail || "";
}

async function connect() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  const headers = key ? { Authorization: "Bearer " + key } : {};
  let response;
  try {
    response = await fetch(EVENTS_URL, { headers, cache: "no-store" });
  } catch (err) {
    return retry("server unreachable");
  }
  if (response.status === 401) {
    setStatus("locked", "API key needed");
    $("key-form").hidden = false;
    $("key-error").textContent = key ? "that key was refused" : "";
    return;
  }
  if (!response.ok) {
    let message = "HTTP " + response.status;
    try { message = (await response.json()).error.message; } catch (err) { /* not an OpenAI error body */ }
    return retry(message);
  }
  $("key-form").hidden = true;
  state.retryMs = RETRY_MIN_MS;
  setStatus("idle", "connected");
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ")) handle(JSON.parse(line.slice(6)));
        }
      }
    }
  } catch (err) {
    /* the connection broke: same as its end */
  }
  retry("connection to the server lost");
}

function retry(why) {
  setStatus("down", "engine down", why + "; reconnecting…");
  const wait = state.retryMs;
  state.retryMs = Math.min(RETRY_MAX_MS, state.retryMs * 2);
  setTimeout(connect, wait);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("key-input").value);
  $("key-input").value = "";
  connect();
});

function handle(message) {
  if (message.type === "hello") {
    state.config = message.config;
    state.steps = message.steps;
    state.windowS = message.window_s;
    renderConfig(message.config);
    if (message.engine.status === "down") setStatus("down", "engine down", message.engine.reason);
  } else if (message.type === "update") {
    state.steps.push(...message.steps);
    if (state.steps.length > 240) state.steps.splice(0, state.steps.length - 240);
    state.lastUpdate = message;
    const busy = message.num_running + message.num_waiting > 0;
    setStatus(busy ? "live" : "idle", busy ? "live" : "idle",
              message.accepting ? "" : "shutting down: in-flight requests are finishing");
    renderCards(message);
    renderRows(message);
    state.blocks = message.blocks;
    drawBlocks();
    drawTimeline();
  } else if (message.type === "engine" && message.status === "down") {
    setStatus("down", "engine down", message.reason);
  }
}

// ---------------------------------------------------------------- cards and tables

function fmt(value, digits = 1) {
  return value === null || value === undefined ? "–" : Number(value).toLocaleString(undefined,
    { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

function ms(p) { return p ? `${fmt(p.p50, 0)} · ${fmt(p.p90, 0)} · ${fmt(p.p99, 0)} ms` : "–"; }

function renderCards(m) {
  const s = m.stats, span = `over the last ${fmt(s.window_s, 0)} s`;
  $("c-output").textContent = fmt(s.output_tokens_per_s);
  $("c-output-foot").textContent = span;
  $("c-prompt").textContent = fmt(s.prompt_tokens_per_s);
  $("c-prompt-foot").textContent = `${fmt(s.requests_per_s * 60, 0)} requests/min finished`;
  $("c-load").textContent = `${m.num_running} · ${m.num_waiting}`;
  $("c-load-foot").textContent = `${s.preemptions} preemptions ${span}`;
  $("c-kv").textContent = fmt(100 * s.kv_usage, 1) + " %";
  const c = m.block_counts, total = m.blocks.length;
  $("c-kv-foot").textContent = `${c.in_use + c.in_use_cached} of ${total} blocks`;
  $("c-hits").textContent = s.prefix_hit_rate === null ? "–" : fmt(100 * s.prefix_hit_rate, 1) + " %";
  $("c-hits-foot").textContent = s.prefix_hit_rate_total === null ? "of prompt tokens, last minute"
    : `${fmt(100 * s.prefix_hit_rate_total, 1)} % since start`;
  $("c-ttft").textContent = ms(s.ttft_ms);
  $("c-ttft-foot").textContent = "finished requests, " + span;
  $("c-itl").textContent = ms(s.itl_ms);
  const target = state.config && state.config.target_itl_ms;
  $("c-itl-foot").textContent = target ? `latency target ${fmt(target, 0)} ms` : "no latency target";
}

function bar(kind, done, total, cached, text) {
  const el = document.createElement("div");
  el.className = "bar";
  if (cached) el.append(fill("cached", Math.min(cached, done) / total));
  el.append(fill(kind, done / total));
  if (cached) el.lastChild.style.left = (100 * Math.min(cached, done) / total) + "%";
  if (cached) el.lastChild.style.width = (100 * Math.max(0, done - cached) / total) + "%";
  const label = document.createElement("span");
  label.className = "text";
  label.textContent = text;
  el.append(label);
  return el;
}

function fill(kind, fraction) {
  const el = document.createElement("span");
  el.className = "fill " + kind;
  el.style.width = (100 * Math.min(1, fraction || 0)) + "%";
  return el;
}

function cell(content, className) {
  const td = document.createElement("td");
  if (className) td.className = className;
  if (content instanceof Node) td.append(content); else td.textContent = content;
  return td;
}

function renderRows(m) {
  const tbody = $("rows").tBodies[0];
  const seen = new Set(m.rows.map((r) => r.id));
  for (const [id, tr] of state.rows) {
    if (seen.has(id) || tr.classList.contains("leaving")) continue;
    tr.classList.add("leaving");   // fades out where it is, then goes
    setTimeout(() => { tr.remove(); if (state.rows.get(id) === tr) state.rows.delete(id); }, 500);
  }
  let cursor = tbody.firstElementChild;
  for (const r of m.rows) {
    let tr = state.rows.get(r.id);
    if (!tr || tr.classList.contains("leaving")) {
      if (tr) tr.remove();
      tr = document.createElement("tr");
      tr.className = "row joined";
      tr.dataset.id = r.id;
      state.rows.set(r.id, tr);
      const joined = tr;
      setTimeout(() => joined.classList.remove("joined"), 50);
    }
    const badge = document.createElement("span");
    badge.className = "badge " + r.state;
    badge.textContent = r.state;
    tr.dataset.state = r.state;
    tr.replaceChildren(
      cell(r.id, "id"), cell(r.tenant || "(default)", "tenant"), cell(String(r.priority), "num"), cell(badge),
      cell(bar("prompt", r.prompt, r.prompt_total, r.cached, `${r.prompt} / ${r.prompt_total}`)),
      cell(bar("output", r.output, r.max_tokens, 0, `${r.output} / ${r.max_tokens}`)),
      cell(fmt(r.tokens_per_s), "num"), cell(fmt(r.age_s) + " s", "num"),
      cell(r.step_tokens ? `+${r.step_tokens}` : (r.wait_cause || ""), "num"));
    tr.title = `${r.id}: ${r.blocks} KV blocks, ${r.cached} prompt tokens from the prefix cache, ` +
               `${r.preemptions} preemptions`;
    // The engine's order (running in batch order, then waiting); leaving rows keep their place.
    while (cursor && cursor.classList.contains("leaving")) cursor = cursor.nextElementSibling;
    if (tr === cursor) cursor = cursor.nextElementSibling; else tbody.insertBefore(tr, cursor);
  }
  $("no-rows").hidden = m.rows.length > 0;
  const listed = m.rows.length, total = m.num_running + m.num_waiting;
  $("rows-summary").textContent = listed < total ? `${listed} of ${total} shown` : "";
}

function renderConfig(config) {
  const tbody = $("config").tBodies[0];
  tbody.replaceChildren();
  $("model").textContent = config.model;
  for (const [key, value] of Object.entries(config)) {
    const tr = document.createElement("tr");
    const shown = value === null ? "none" : Array.isArray(value) ? (value.length ? JSON.stringify(value) : "none")
      : String(value);
    tr.append(cell(key.replaceAll("_", " ")), cell(shown));
    tbody.append(tr);
  }
}

// ---------------------------------------------------------------- canvases

function sizeCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return [ctx, width, height];
}

function niceMax(value) {
  if (value <= 0) return 1;
  const scale = Math.pow(10, Math.floor(Math.log10(value)));
  for (const m of [1, 2, 5, 10]) if (m * scale >= value) return m * scale;
  return 10 * scale;
}

function drawTimeline() {
  const [ctx, width, height] = sizeCanvas($("timeline"));
  const steps = state.steps, left = 44, right = 52, top = 8, bottom = 16, gap = 14;
  const plotW = width - left - right, paneH = height - top - bottom - gap;
  // Two panes: tokens per step above, step time below (with the latency target, when there is one).
  const tokH = Math.round(paneH * 0.6), msTop = top + tokH + gap, msH = paneH - tokH;
  const maxTokens = niceMax(Math.max(1, ...steps.map((s) => s[1] + s[2])));
  const target = state.config && state.config.target_itl_ms;
  const maxMs = niceMax(Math.max(1, target ? target * 1.1 : 0, ...steps.map((s) => s[4])));
  // Tokens on a square-root scale: a 512-token prefill chunk and 4 decode rows both stay visible.
  const yTok = (v) => top + tokH - tokH * Math.sqrt(v / maxTokens);
  const yMs = (v) => msTop + msH - msH * v / maxMs;
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillStyle = COLORS.dim;
  ctx.strokeStyle = COLORS.line;
  ctx.lineWidth = 1;
  const grid = (y, label, side) => {
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + plotW, y); ctx.stroke();
    ctx.textAlign = side === "left" ? "right" : "left";
    ctx.fillText(label, side === "left" ? left - 4 : left + plotW + 4, y + 3);
  };
  for (const f of [0, 0.25, 1]) grid(yTok(maxTokens * f), fmt(maxTokens * f, 0), "left");
  for (const f of [0, 0.5, 1]) grid(yMs(maxMs * f), fmt(maxMs * f, 0) + " ms", "right");
  ctx.textAlign = "left";
  ctx.fillText("tokens", left + plotW + 4, top + 8);
  ctx.fillText("step time", 2, msTop + 8);
  const slot = plotW / 240, barW = Math.max(1, slot - 1);
  const x0 = left + plotW - steps.length * slot;
  steps.forEach((s, i) => {
    const x = x0 + i * slot, decode = s[2], prefill = s[1];
    ctx.fillStyle = COLORS.decode;
    ctx.fillRect(x, yTok(decode), barW, top + tokH - yTok(decode));
    ctx.fillStyle = COLORS.prefill;
    ctx.fillRect(x, yTok(decode + prefill), barW, yTok(decode) - yTok(decode + prefill));
    if (s[5] > 0) {
      ctx.fillStyle = COLORS.preempted;
      ctx.beginPath(); ctx.arc(x + barW / 2, top + 3, 3, 0, 2 * Math.PI); ctx.fill();
    }
  });
  if (target) {
    ctx.strokeStyle = COLORS.target; ctx.setLineDash([5, 4]);
    ctx.beginPath(); ctx.moveTo(left, yMs(target)); ctx.lineTo(left + plotW, yMs(target)); ctx.stroke();
    ctx.setLineDash([]);
  }
  ctx.strokeStyle = COLORS.steptime; ctx.lineWidth = 1.5;
  ctx.beginPath();
  steps.forEach((s, i) => {
    const x = x0 + i * slot + barW / 2;
    if (i === 0) ctx.moveTo(x, yMs(s[4])); else ctx.lineTo(x, yMs(s[4]));
  });
  ctx.stroke();
  ctx.fillStyle = COLORS.dim; ctx.textAlign = "center";
  ctx.fillText(steps.length ? `last ${steps.length} steps, newest on the right` : "no step yet",
               left + plotW / 2, height - 3);
}

const BLOCK_KINDS = [["free", "free"], ["used", "in use"], ["cached", "cached, reusable"],
                     ["shared", "in use, in the prefix cache"]];

function drawBlocks() {
  const canvas = $("blocks"), blocks = state.blocks, n = blocks.length;
  if (!n) return;
  const width = canvas.clientWidth, maxHeight = 260;
  let size = Math.max(2, Math.min(16, Math.floor(Math.sqrt(width * maxHeight / n))));
  let cols = Math.max(1, Math.floor(width / size));
  while (size > 2 && Math.ceil(n / cols) * size > maxHeight) { size -= 1; cols = Math.floor(width / size); }
  canvas.style.height = Math.ceil(n / cols) * size + "px";
  const [ctx] = sizeCanvas(canvas);
  const gap = size >= 5 ? 1 : 0;
  const colors = [COLORS.free, COLORS.used, COLORS.cached, COLORS.shared];
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = colors[blocks.charCodeAt(i) - 48];
    ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
  }
  const counts = [0, 0, 0, 0];
  for (let i = 0; i < n; i++) counts[blocks.charCodeAt(i) - 48] += 1;
  const legend = $("block-legend");
  legend.replaceChildren();
  BLOCK_KINDS.forEach(([cls, label], i) => {
    const sw = document.createElement("i");
    sw.className = "sw " + cls;
    legend.append(sw, `${label} ${counts[i]}`);
  });
  canvas.dataset.counts = counts.join(",");
}

cssColors();
window.addEventListener("resize", () => { drawTimeline(); drawBlocks(); });
drawTimeline();
connect();
