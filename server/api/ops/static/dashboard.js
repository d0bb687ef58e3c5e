// The localserve dashboard: polls /v1/dashboard/state, /v1/batches and Anthropic's
// /v1/messages/batches, and /v1/usage, and runs a streamed chat against /v1/chat/completions.
// Plain browser JavaScript, no dependencies.
"use strict";

const POLL_MS = 1000;
const USAGE_EVERY = 5; // polls between usage reads
const KEY_STORAGE = "localserve-api-key";
const $ = (id) => document.getElementById(id);

let apiKey = localStorage.getItem(KEY_STORAGE) || "";
let pollTimer = null;
let pollRun = 0; // the latest poll chain; an older one stops scheduling itself
let polls = 0;
let chatAbort = null;

function headers(extra = {}) {
  return apiKey ? { ...extra, Authorization: `Bearer ${apiKey}` } : extra;
}

async function getJSON(path) {
  const r = await fetch(path, { headers: headers() });
  if (r.status === 401) throw new Error("unauthorized");
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

function text(id, value) {
  $(id).textContent = value;
}

function ms(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds < 1 ? `${(seconds * 1000).toFixed(1)} ms` : `${seconds.toFixed(2)} s`;
}

function money(usd) {
  return `$${usd.toFixed(usd < 1 ? 6 : 2)}`;
}

function duration(seconds) {
  if (!isFinite(seconds)) return "–";
  if (seconds < 60) return `${Math.round(seconds)} s`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

// -- live state ------------------------------------------------------------------------------

function renderState(s) {
  text("model", s.model);
  text("bits", s.bits ? `${s.bits}-bit` : "");
  text("status", s.status);
  $("status").className = `tag ${s.status}`;
  if (!s.requests) return; // still loading
  text("running", s.requests.running);
  text("waiting", s.requests.waiting);
  text("in-flight", s.requests.in_flight);
  text("ttft-p50", ms(s.latency.ttft_p50));
  text("ttft-p95", ms(s.latency.ttft_p95));
  text("itl-p50", ms(s.latency.itl_p50));
  text("itl-p95", ms(s.latency.itl_p95));
  const kv = s.kv;
  text("kv", `${kv.blocks_used} of ${kv.blocks_total} blocks used`);
  $("kv-bar").style.width = `${(100 * kv.blocks_used) / Math.max(1, kv.blocks_total)}%`;
  text("kv-resident", `${(kv.resident_bytes / 2 ** 20).toFixed(1)} MB resident`);
  const hit = s.prefix_cache.hit_rate;
  text("cache-hit", hit === null ? "–" : `${(100 * hit).toFixed(1)}%`);
  text("preemptions", s.preemptions);
  renderChart(s.throughput);
  renderModels(s.models || []);
}

function renderModels(models) {
  const body = $("models").querySelector("tbody");
  body.replaceChildren();
  for (const m of models) {
    const row = body.insertRow();
    row.dataset.name = m.name;
    row.insertCell().textContent = m.name;
    row.insertCell().textContent = `${(m.bytes / 2 ** 20).toFixed(0)} MB`;
    row.insertCell().textContent = m.running;
    row.insertCell().textContent = m.goes_in === null ? "kept" : duration(m.goes_in);
    row.insertCell().textContent = m.load_seconds === null ? "–" : `${m.load_seconds.toFixed(1)} s`;
    row.insertCell().textContent = m.ttft_p50 === null ? "–" : `${(m.ttft_p50 * 1000).toFixed(0)} ms`;
  }
}

function renderChart(samples) {
  const svg = $("chart");
  const width = 600, height = 160, span = 300;
  const now = samples.length ? samples[samples.length - 1].t : Date.now() / 1000;
  const kinds = ["interactive", "batch", "prompt"];
  const top = Math.max(1, ...samples.flatMap((p) => kinds.map((k) => p[k]))) * 1.1;
  svg.replaceChildren();
  for (const k of kinds) {
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("class", k);
    line.setAttribute("points", samples.map((p) => {
      const x = width - ((now - p.t) / span) * width;
      return `${x.toFixed(1)},${(height - (p[k] / top) * height).toFixed(1)}`;
    }).join(" "));
    svg.appendChild(line);
    text(`rate-${k}`, samples.length ? samples[samples.length - 1][k].toFixed(1) : "0");
  }
}

// Both APIs' batches in one shape: OpenAI's /v1/batches and Anthropic's Message Batches.
function fromOpenAI(b) {
  const c = b.request_counts;
  return { id: b.id, status: b.status, created: b.created_at, started: b.in_progress_at,
           done: c.completed, failed: c.failed, total: c.total,
           running: b.status === "in_progress",
           cancel: (b.status === "validating" || b.status === "in_progress")
             ? `/v1/batches/${encodeURIComponent(b.id)}/cancel` : null };
}

function fromMessages(b) {
  const c = b.request_counts;
  const created = Date.parse(b.created_at) / 1000;
  const running = b.processing_status === "in_progress";
  return { id: b.id, status: b.processing_status, created, started: created,
           done: c.succeeded, failed: c.errored + c.canceled + c.expired,
           total: c.processing + c.succeeded + c.errored + c.canceled + c.expired, running,
           cancel: running ? `/v1/messages/batches/${encodeURIComponent(b.id)}/cancel` : null };
}

function renderBatches(batches) {
  const body = $("batches").querySelector("tbody");
  body.replaceChildren();
  $("no-batches").hidden = batches.length > 0;
  const now = Date.now() / 1000;
  for (const b of batches) {
    const finished = b.done + b.failed;
    const row = body.insertRow();
    row.dataset.id = b.id;
    row.insertCell().textContent = b.id;
    row.insertCell().textContent = b.status;
    const cell = row.insertCell();
    const bar = document.createElement("div");
    bar.className = "bar";
    const fill = document.createElement("div");
    fill.className = "fill";
    fill.style.width = `${b.total ? (100 * finished) / b.total : 0}%`;
    bar.appendChild(fill);
    const label = document.createElement("span");
    label.className = "progress";
    label.textContent = `${b.done} done, ${b.failed} failed of ${b.total}`;
    cell.append(bar, label);
    let eta = "–";
    if (b.running && finished > 0 && b.started) {
      eta = duration(((now - b.started) / finished) * (b.total - finished));
    }
    row.insertCell().textContent = eta;
    const action = row.insertCell();
    if (b.cancel) {
      const button = document.createElement("button");
      button.className = "cancel";
      button.textContent = "Cancel";
      button.onclick = () => cancelBatch(b.cancel, button);
      action.appendChild(button);
    }
  }
}

async function cancelBatch(url, button) {
  button.disabled = true;
  const r = await fetch(url, { method: "POST", headers: headers() });
  if (!r.ok) button.disabled = false;
  poll();
}

function renderUsage(usage) {
  const p = usage.prices;
  const days = new Map();
  for (const row of usage.data) {
    const d = days.get(row.date) || { it: 0, ic: 0, bt: 0, bc: 0, saved: 0 };
    const tokens = row.prompt_tokens + row.completion_tokens;
    if (row.kind === "batch") {
      const full = (row.prompt_tokens * p.input_per_million
                    + row.completion_tokens * p.output_per_million) / 1e6;
      d.bt += tokens; d.bc += row.cost_usd; d.saved += full - row.cost_usd;
    } else {
      d.it += tokens; d.ic += row.cost_usd;
    }
    days.set(row.date, d);
  }
  const body = $("usage").querySelector("tbody");
  body.replaceChildren();
  for (const [day, d] of [...days.entries()].reverse()) {
    const row = body.insertRow();
    for (const v of [day, d.it, money(d.ic), d.bt, money(d.bc), money(d.saved)]) {
      row.insertCell().textContent = v;
    }
  }
}

async function poll() {
  clearTimeout(pollTimer);
  const run = ++pollRun;
  try {
    const state = await getJSON("/v1/dashboard/state");
    renderState(state);
    if (state.status === "ok") {
      const [openai, messages] = await Promise.all([
        getJSON("/v1/batches?limit=20"), getJSON("/v1/messages/batches?limit=20")]);
      renderBatches([...openai.data.map(fromOpenAI), ...messages.data.map(fromMessages)]
        .sort((a, b) => b.created - a.created).slice(0, 20));
    }
    if (polls++ % USAGE_EVERY === 0) renderUsage(await getJSON("/v1/usage"));
  } catch (e) {
    if (e.message === "unauthorized") {
      askForKey("That key was refused.");
      return;
    }
    text("status", "unreachable");
  }
  if (run === pollRun) pollTimer = setTimeout(poll, POLL_MS);
}

function askForKey(message) {
  clearTimeout(pollTimer);
  $("key-form").hidden = false;
  $("main").hidden = true;
  text("key-error", message || "");
}

// -- the playground --------------------------------------------------------------------------

async function sendChat() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push({ role: "user", content: $("message").value });
  const body = {
    model: $("model").textContent, messages, stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  chatAbort = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  $("answer").textContent = "";
  $("reasoning").textContent = "";
  $("thinking").hidden = true;
  text("chat-stats", "waiting for the first token…");
  const started = performance.now();
  let first = null, tokens = 0, finish = null;
  const stats = () => {
    const secs = first === null ? 0 : (performance.now() - first) / 1000;
    const rate = secs > 0 ? (tokens / secs).toFixed(1) : "–";
    const ttft = first === null ? "–" : `${((first - started) / 1000).toFixed(2)} s`;
    return `${tokens} tokens · ${rate} tokens/s · first token after ${ttft}`;
  };
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body), signal: chatAbort.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : `HTTP ${r.status}`);
    }
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 1);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          // a thinking model's reasoning comes first, folded above the answer
          for (const [key, at] of [["reasoning_content", "reasoning"], ["content", "answer"]]) {
            if (!delta[key]) continue;
            if (first === null) first = performance.now();
            tokens += 1;
            $(at).textContent += delta[key];
            if (at === "reasoning") $("thinking").hidden = false;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        text("chat-stats", stats());
      }
    }
    text("chat-stats", `${stats()} · finished: ${finish}`);
  } catch (e) {
    text("chat-stats", e.name === "AbortError" ? `${stats()} · stopped` : `error: ${e.message}`);
  } finally {
    $("send").disabled = false;
    $("stop").disabled = true;
    chatAbort = null;
  }
}

// -- start -----------------------------------------------------------------------------------

async function start() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    apiKey = $("api-key").value.trim();
    localStorage.setItem(KEY_STORAGE, apiKey);
    $("key-form").hidden = true;
    $("main").hidden = false;
    poll();
  });
  $("send").addEventListener("click", sendChat);
  $("stop").addEventListener("click", () => chatAbort && chatAbort.abort());
  // /health is public and says whether keys are needed, so no request is refused (a 401 would
  // be a console error) before the user could give one.
  const health = await fetch("/health").then((r) => r.json()).catch(() => ({}));
  if (health.auth_required && !apiKey) {
    askForKey();
    return;
  }
  poll();
}

start();
