// The prefixserve console: a chat playground, a live view of the prefix cache and a what-if.
// It calls the server's own routes with the key its user gives; it has no access of its own.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("prefixserve-key") || "", role: null,
                samples: [], lastView: null, messages: [], abort: null, poll: null };

// ------------------------------------------------------------------ requests

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

async function api(path, options) {
  const response = await fetch(path, Object.assign({ headers: headers() }, options || {}));
  if (!response.ok) throw new Error(await errorText(response));
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return response.status + ": " + ((body.error && body.error.message) || JSON.stringify(body));
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

// ------------------------------------------------------------------ tabs and key

function selectTab(name) {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.classList.toggle("active", tab.dataset.tab === name);
  }
  for (const panel of document.querySelectorAll(".panel")) panel.hidden = panel.id !== name;
  if (name === "cache") pollCache();
}

async function useKey(event) {
  if (event) event.preventDefault();
  state.key = $("key").value.trim() || state.key;
  sessionStorage.setItem("prefixserve-key", state.key);
  $("key").value = "";
  state.samples = [];
  showError("");
  await loadModels();
  await whoAmI();
  await pollCache();
}

async function whoAmI() {
  try {
    const view = await (await api("/v1/cache/view?top=1")).json();
    state.role = view.role;
    $("who").textContent = "viewing as " + view.role;
  } catch (e) {
    $("who").textContent = "";
  }
}

async function loadModels() {
  try {
    const models = await (await api("/v1/models")).json();
    const select = $("model");
    select.textContent = "";
    for (const model of models.data) {
      const option = document.createElement("option");
      option.value = option.textContent = model.id;
      select.appendChild(option);
    }
  } catch (e) {
    showError("Models: " + e.message + (state.key ? " (chatting needs an API key)"
                                                   : " (this server needs a key)"));
  }
}

// ------------------------------------------------------------------ chat

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "message " + role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  box.appendChild(body);
  $("messages").appendChild(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function chatBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = { model: $("model").value || undefined, messages: messages.concat(state.messages),
                 stream: true, stream_options: { include_usage: true },
                 temperature: Number($("temperature").value),
                 top_p: Number($("top_p").value), max_tokens: Number($("max_tokens").value) };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  return body;
}

async function send(event) {
  event.preventDefault();
  const text = $("user").value.trim();
  if (!text || state.abort) return;
  $("user").value = "";
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const answer = addMessage("assistant", "");
  const stats = document.createElement("div");
  stats.className = "answer-stats muted";
  answer.appendChild(stats);
  state.abort = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  try {
    const reply = await streamChat(chatBody(), answer.querySelector(".text"), stats);
    state.messages.push({ role: "assistant", content: reply });
  } catch (e) {
    if (e.name !== "AbortError") showError("Chat: " + e.message);
    state.messages.pop();
  } finally {
    state.abort = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

async function streamChat(body, target, stats) {
  const start = performance.now();
  const response = await api("/v1/chat/completions", {
    method: "POST", body: JSON.stringify(body), signal: state.abort.signal,
    headers: headers({ "Content-Type": "application/json" }) });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", text = "", first = null, usage = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:") || line.includes("[DONE]")) continue;
      const chunk = JSON.parse(line.slice(5));
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        if (first === null) first = performance.now();
        text += delta.content;
        target.textContent = text;
      }
    }
  }
  showStats(stats, usage, start, first, performance.now());
  return text;
}

function showStats(stats, usage, start, first, end) {
  if (!usage) return;
  const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
  const ttft = first === null ? end - start : first - start;
  const decode = first === null ? 0 : (end - first) / 1000;
  const speed = decode > 0 && usage.completion_tokens > 1
    ? ((usage.completion_tokens - 1) / decode).toFixed(1) + " tok/s" : "-";
  stats.dataset.cached = String(cached);
  stats.dataset.prompt = String(usage.prompt_tokens);
  stats.textContent = `cached ${cached} of ${usage.prompt_tokens} prompt tokens · TTFT ` +
    `${ttft.toFixed(0)} ms · ${speed} · ${usage.completion_tokens} tokens`;
}

function clearChat() {
  state.messages = [];
  $("messages").textContent = "";
}

// ------------------------------------------------------------------ cache view

async function pollCache() {
  if ($("cache").hidden) return;
  try {
    const view = await (await api("/v1/cache/view")).json();
    showError("");
    renderView(view);
  } catch (e) {
    showError("Cache view: " + e.message);
  }
}

function percent(x) { return (100 * x).toFixed(1) + "%"; }

function renderView(view) {
  state.role = view.role;
  $("who").textContent = "viewing as " + view.role;
  for (const el of document.querySelectorAll(".admin-only")) el.hidden = view.role === "tenant";
  const c = view.counters;
  $("hit-rate").textContent = c.query_tokens ? percent(c.hit_tokens / c.query_tokens) : "-";
  $("hit-tokens").textContent = `${c.hit_tokens} of ${c.query_tokens}`;
  $("sequences").textContent = String(c.sequences);
  const last = state.lastView;
  if (last && c.evictions !== undefined) {
    const seconds = Math.max(view.time - last.time, 1e-3);
    $("evictions").textContent = ((c.evictions - last.counters.evictions) / seconds).toFixed(1);
  }
  if (c.running !== undefined) $("load").textContent = `${c.running} / ${c.waiting}`;
  state.lastView = view;
  state.samples.push({ t: view.time, q: c.query_tokens, h: c.hit_tokens, qb: c.queries,
                       hb: c.hits });
  if (state.samples.length > 300) state.samples.shift();
  drawHitChart();
  renderBlocks(view.blocks);
  fillTable("namespace-table", view.namespaces.map((n) => [n.name, n.blocks, n.sequences,
    n.prompt_tokens, n.prompt_tokens ? percent(n.cached_tokens / n.prompt_tokens) : "-"]));
  fillTable("prefix-table", view.prefixes.map((p) => [p.hash, p.tokens, p.hits,
    new Date(p.last_use * 1000).toLocaleTimeString(), p.namespace, p.held_by]));
  fillTable("tier-table", (view.tiers || []).map((t) => [t.name, t.up ? "yes" : "down",
    t.writable ? "yes" : "no", t.hit_blocks, t.stored_blocks, t.errors]));
  if (c.retained_hits !== undefined) {
    $("retained").textContent = `(blocks hit thanks to a retention: ${c.retained_hits})`;
  }
  if (view.role === "admin") pollPins();
  if (view.role !== "tenant") pollTtft();
}

// The TTFT histogram of /metrics as a distribution: the share of requests whose first token
// came within each bucket's bound (either metric prefix).
async function pollTtft() {
  try {
    const text = await (await api("/metrics")).text();
    const points = [];
    let total = 0;
    for (const line of text.split("\n")) {
      const m = line.match(/^\w+:time_to_first_token_seconds_bucket\{.*le="([^"]+)".*\} (\S+)$/);
      if (!m) continue;
      if (m[1] === "+Inf") total = Number(m[2]);
      else points.push([Number(m[1]), Number(m[2])]);
    }
    const canvas = $("ttft-chart");
    canvas.dataset.requests = String(total);
    if (total > 0) cdfChart(canvas, points.map(([le, n]) => [le, n / total]));
  } catch (e) {
    $("ttft-chart").dataset.requests = "";
  }
}

function cdfChart(canvas, points) {
  const g = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 30;
  g.clearRect(0, 0, w, h);
  g.font = "11px sans-serif";
  const lx = (s) => Math.log10(Math.max(s, 1e-3));
  const x0 = lx(points[0][0]), x1 = lx(points[points.length - 1][0]);
  const x = (s) => pad + (lx(s) - x0) / Math.max(x1 - x0, 1e-9) * (w - pad - 20);
  const y = (f) => h - pad / 2 - f * (h - pad);
  g.strokeStyle = "#ccc";
  g.fillStyle = "#555";
  for (const f of [0, 0.5, 1]) {
    g.beginPath(); g.moveTo(pad, y(f)); g.lineTo(w, y(f)); g.stroke();
    g.fillText(percent(f).replace(".0", ""), 0, y(f) + 4);
  }
  g.strokeStyle = g.fillStyle = "#2a6fdb";
  g.lineWidth = 2;
  g.beginPath();
  points.forEach(([s, f], i) => {
    if (i) g.lineTo(x(s), y(f)); else g.moveTo(x(s), y(f));
    g.fillRect(x(s) - 2, y(f) - 2, 4, 4);
  });
  g.stroke();
  g.lineWidth = 1;
  g.fillStyle = "#555";
  for (const [s] of points.filter((_, i) => i % 3 === 0)) {
    g.fillText(s < 1 ? `${Math.round(s * 1000)} ms` : `${s} s`, x(s) - 10, h - 2);
  }
}

async function pollPins() {
  try {
    const pins = await (await api("/v1/pins")).json();
    fillTable("pin-table", pins.data.map((p) => [p.id, p.num_blocks, p.num_tokens]));
  } catch (e) {
    fillTable("pin-table", []);
  }
}

function fillTable(id, rows) {
  const body = $(id).querySelector("tbody");
  body.textContent = "";
  for (const row of rows) {
    const tr = document.createElement("tr");
    for (const cell of row) {
      const td = document.createElement("td");
      td.textContent = String(cell);
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

const BLOCK_STATES = [["running", "in use by running requests"], ["cached", "cached, free"],
                      ["empty", "empty"]];

function renderBlocks(blocks) {
  const bar = $("blocks-bar");
  const legend = $("blocks-legend");
  bar.textContent = legend.textContent = "";
  for (const [name, label] of BLOCK_STATES) {
    const part = document.createElement("div");
    part.className = "part " + name;
    part.style.width = (100 * blocks[name] / Math.max(blocks.total, 1)) + "%";
    bar.appendChild(part);
    const item = document.createElement("span");
    item.className = "key " + name;
    item.textContent = `${label}: ${blocks[name]}`;
    legend.appendChild(item);
  }
  const pinned = document.createElement("span");
  pinned.textContent = `pinned: ${blocks.pinned} · total ${blocks.total}`;
  legend.appendChild(pinned);
}

function perPoll(query, hit) {
  const points = [];
  const s = state.samples;
  for (let i = 1; i < s.length; i++) {
    const dq = s[i][query] - s[i - 1][query];
    if (dq > 0) points.push([s[i].t, (s[i][hit] - s[i - 1][hit]) / dq]);
  }
  return points;
}

function drawHitChart() {
  const overall = state.samples.map((x) => [x.t, x.q ? x.h / x.q : 0]);
  lineChart($("hit-chart"), [
    { points: overall, color: "#888", label: "tokens, since start" },
    { points: perPoll("q", "h"), color: "#2a6fdb", label: "tokens, per poll" },
    { points: perPoll("qb", "hb"), color: "#d9822b", label: "blocks, per poll" }]);
}

function lineChart(canvas, series) {
  const g = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 30;
  g.clearRect(0, 0, w, h);
  g.strokeStyle = "#ccc";
  g.fillStyle = "#555";
  g.font = "11px sans-serif";
  for (const y of [0, 0.5, 1]) {
    const py = h - pad / 2 - y * (h - pad);
    g.beginPath(); g.moveTo(pad, py); g.lineTo(w, py); g.stroke();
    g.fillText(percent(y).replace(".0", ""), 0, py + 4);
  }
  const all = series.flatMap((x) => x.points);
  if (!all.length) return;
  const t0 = Math.min(...all.map((p) => p[0])), t1 = Math.max(...all.map((p) => p[0]));
  const x = (t) => pad + (t1 > t0 ? (t - t0) / (t1 - t0) : 1) * (w - pad - 10);
  let legendX = pad + 10;
  for (const line of series) {
    g.strokeStyle = g.fillStyle = line.color;
    g.lineWidth = 2;
    g.beginPath();
    line.points.forEach((p, i) => {
      const py = h - pad / 2 - p[1] * (h - pad);
      if (i) g.lineTo(x(p[0]), py); else g.moveTo(x(p[0]), py);
      g.fillRect(x(p[0]) - 2, py - 2, 4, 4);
    });
    g.stroke();
    g.fillText(line.label, legendX, 12);
    legendX += g.measureText(line.label).width + 20;
  }
  g.lineWidth = 1;
}

// ------------------------------------------------------------------ what if

async function runWhatIf() {
  $("whatif-status").textContent = "replaying…";
  $("whatif-run").disabled = true;
  try {
    const replicas = Number($("whatif-replicas").value) || 4;
    const result = await (await api("/v1/cache/what_if?replicas=" + replicas)).json();
    renderWhatIf(result);
    $("whatif-status").textContent = `${result.requests} requests replayed`;
  } catch (e) {
    $("whatif-status").textContent = "";
    showError("What if: " + e.message);
  } finally {
    $("whatif-run").disabled = false;
  }
}

function renderWhatIf(result) {
  const rows = result.sizes.map((s) => [
    s.factor === null ? "infinite cache" : `${s.factor}x the KV memory`,
    s.capacity_blocks === null ? "∞" : s.capacity_blocks, percent(s.token_hit_rate),
    percent(s.block_hit_rate)]);
  if (result.tier) {
    rows.push([`1x + disk tier of ${result.tier.tier_blocks} blocks`, result.pool_blocks,
               percent(result.tier.token_hit_rate), percent(result.tier.block_hit_rate)]);
  }
  for (const r of result.replicas) {
    rows.push([`${r.replicas} replicas, ${r.routing}`, `${result.pool_blocks} each`,
               percent(r.token_hit_rate), percent(r.block_hit_rate)]);
  }
  fillTable("whatif-table", rows);
  $("whatif-commands").textContent = result.commands.join("\n");
  barChart($("whatif-chart"), rows.map((r) => [r[0], parseFloat(r[2]) / 100]));
}

function barChart(canvas, bars) {
  const g = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, label = 230;
  g.clearRect(0, 0, w, h);
  g.font = "12px sans-serif";
  const row = Math.min(26, h / Math.max(bars.length, 1));
  bars.forEach(([name, value], i) => {
    const y = i * row;
    g.fillStyle = "#333";
    g.fillText(name, 0, y + row * 0.65);
    g.fillStyle = "#2a6fdb";
    g.fillRect(label, y + 3, value * (w - label - 60), row - 6);
    g.fillStyle = "#333";
    g.fillText(percent(value), label + value * (w - label - 60) + 5, y + row * 0.65);
  });
}

async function downloadLog(event) {
  event.preventDefault();
  try {
    const blob = await (await api("/v1/cache/requests")).blob();
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = "requests.jsonl";
    link.click();
  } catch (e) {
    showError("Request log: " + e.message);
  }
}

// ------------------------------------------------------------------ start

function start() {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => selectTab(tab.dataset.tab));
  }
  $("key-form").addEventListener("submit", useKey);
  $("chat-form").addEventListener("submit", send);
  $("user").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(e);
  });
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("clear").addEventListener("click", clearChat);
  $("whatif-run").addEventListener("click", runWhatIf);
  $("whatif-log").addEventListener("click", downloadLog);
  state.poll = setInterval(pollCache, 2000);
  loadModels();
  whoAmI();
}

start();
