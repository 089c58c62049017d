// The live page: chat through /v1/chat/completions (streamed) and a dashboard fed by
// /v1/dashboard/events. Both are read with fetch, not EventSource, so that the API key
// travels in the Authorization header (never in a URL). Text is only ever set with
// textContent: model output is not HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "mlx-mtp-api-key";
let apiKey = sessionStorage.getItem(KEY_STORAGE) || "";
const conversation = [];  // the messages sent with each request
const attached = [];  // data URLs of the images the next message carries
let chatAbort = null;

function headers(extra = {}) {
  return apiKey ? { ...extra, Authorization: "Bearer " + apiKey } : extra;
}

// Server-sent events from a fetch Response: yields each event's data (a string).
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let blank;
    while ((blank = /\r?\n\r?\n/.exec(buffer))) {
      const block = buffer.slice(0, blank.index);
      buffer = buffer.slice(blank.index + blank[0].length);
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error) return body.error.message || JSON.stringify(body.error);
  } catch (e) { /* not JSON */ }
  return `HTTP ${response.status}`;
}

// --- images: pasted, dropped or picked; sent as OpenAI image_url parts (data URLs) ------
function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachImages(files) {
  for (const file of files) {
    if (file.type.startsWith("image/")) attached.push(await readDataUrl(file));
  }
  showAttachments();
}

function imageElement(url) {
  const img = document.createElement("img");
  img.src = url;  // a data: URL read from the user's own file: nothing is fetched
  img.alt = "attached image";
  return img;
}

function showAttachments() {
  $("attachments").replaceChildren(...attached.map((url, i) => {
    const thumb = document.createElement("div");
    thumb.className = "thumb";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.title = "Remove this image";
    remove.addEventListener("click", () => { attached.splice(i, 1); showAttachments(); });
    thumb.append(imageElement(url), remove);
    return thumb;
  }));
}

// --- chat ------------------------------------------------------------------------------
function addMessage(role, text, images = []) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  if (role === "assistant") {
    const details = document.createElement("details");
    details.className = "reasoning";
    details.open = true;
    const summary = document.createElement("summary");
    summary.textContent = "Thinking";
    const reasoning = document.createElement("div");
    reasoning.className = "reasoning-text";
    details.append(summary, reasoning);
    const content = document.createElement("div");
    content.className = "content";
    const stats = document.createElement("div");
    stats.className = "stats";
    div.append(details, content, stats);
  } else {
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    div.append(content);
    if (images.length) {
      const strip = document.createElement("div");
      strip.className = "images";
      strip.append(...images.map(imageElement));
      div.append(strip);
    }
  }
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function requestBody() {
  const body = { messages: conversation.slice(), stream: true,
                 stream_options: { include_usage: true } };
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const temperature = $("temperature").value.trim();
  if (temperature !== "") body.temperature = Number(temperature);
  const thinking = $("thinking").value;
  if (thinking) body.chat_template_kwargs = { enable_thinking: thinking === "on" };
  return body;
}

function describeStats(final) {
  const parts = [];
  const usage = final.usage || {};
  const timings = final.timings || {};
  const mtp = final.mtp || {};
  if (usage.completion_tokens !== undefined) parts.push(`${usage.completion_tokens} tokens`);
  if (timings.predicted_per_second) parts.push(`${timings.predicted_per_second.toFixed(1)} tokens/s`);
  if (mtp.num_draft_tokens) {
    parts.push(`MTP accepted ${(100 * mtp.acceptance_rate).toFixed(0)}% ` +
               `(mean length ${mtp.mean_acceptance_length.toFixed(2)})`);
  }
  const cached = (usage.prompt_tokens_details || {}).cached_tokens;
  if (cached) parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  if (final.finish_reason) parts.push(`finish: ${final.finish_reason}`);
  return parts.join(" · ");
}

async function send(text) {
  const images = attached.splice(0);
  showAttachments();
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  // Images first, then the question (as the OpenAI and Qwen examples order them).
  conversation.push({ role: "user", content: parts.length ? [...parts, { type: "text", text }]
                                                          : text });
  addMessage("user", text, images);
  const div = addMessage("assistant");
  const reasoningBox = div.querySelector(".reasoning");
  const reasoningText = div.querySelector(".reasoning-text");
  const content = div.querySelector(".content");
  const stats = div.querySelector(".stats");
  div.dataset.state = "streaming";
  setBusy(true);
  chatAbort = new AbortController();
  let answer = "";
  const final = {};
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: chatAbort.signal,
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(requestBody()),
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "generation failed");
      for (const key of ["usage", "timings", "mtp"]) if (chunk[key]) final[key] = chunk[key];
      const choice = (chunk.choices || [])[0];
      if (!choice) continue;
      if (choice.finish_reason) final.finish_reason = choice.finish_reason;
      const delta = choice.delta || {};
      const thought = delta.reasoning_content ?? delta.reasoning;
      if (thought) {
        reasoningText.textContent += thought;
        reasoningBox.dataset.hasText = "";
      }
      if (delta.content) {
        // Thoughts fold away once the answer starts (a click opens them again).
        if (!answer && reasoningBox.hasAttribute("data-has-text")) reasoningBox.open = false;
        answer += delta.content;
        content.textContent = answer;
      }
      if (delta.tool_calls) content.textContent += JSON.stringify(delta.tool_calls);
      div.scrollIntoView({ block: "end" });
    }
    stats.textContent = describeStats(final);
    div.dataset.state = "done";
  } catch (e) {
    const err = document.createElement("div");
    err.className = "error";
    err.textContent = e.name === "AbortError" ? "Stopped." : "Error: " + e.message;
    div.append(err);
    div.dataset.state = e.name === "AbortError" ? "stopped" : "error";
  } finally {
    // The next turn carries the answer, not the thoughts (as chat templates expect);
    // a turn that failed is left out, so that it can be sent again.
    if (div.dataset.state === "error") conversation.pop();
    else conversation.push({ role: "assistant", content: answer });
    chatAbort = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// --- dashboard -------------------------------------------------------------------------
const fmt = (x, digits = 0) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
const count = (x) => (x === null || x === undefined ? "–" : Math.round(x).toLocaleString("en-US"));
const percent = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KB", "MB", "GB", "TB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log(n) / Math.log(1024)));
  return (n / 1024 ** i).toFixed(i ? 1 : 0) + " " + units[i];
}
const tpsHistory = [];

function drawChart() {
  const canvas = $("tps-chart");
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  if (tpsHistory.length < 2) return;
  const top = Math.max(1, ...tpsHistory);
  ctx.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue("--accent");
  ctx.lineWidth = 2;
  ctx.beginPath();
  // The last minute, one point per snapshot, the newest at the right edge.
  const n = tpsHistory.length;
  tpsHistory.forEach((v, i) => {
    const x = w - ((n - 1 - i) / 59) * w, y = h - 2 - (v / top) * (h - 4);
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
  ctx.stroke();
}

function fillRows(tbody, rows) {
  tbody.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      const td = document.createElement("td");
      if (cell instanceof Node) td.append(cell); else td.textContent = cell;
      tr.append(td);
    }
    return tr;
  }));
}

function bar(fraction) {
  const outer = document.createElement("div");
  outer.className = "bar";
  const inner = document.createElement("div");
  inner.style.width = `${Math.round(100 * (fraction || 0))}%`;
  outer.append(inner);
  return outer;
}

function update(s) {
  $("model").textContent = s.model;
  $("tps").textContent = fmt(s.generation_tokens_per_second, 1);
  $("prompt-tps").textContent = fmt(s.prompt_tokens_per_second, 1);
  $("generated").textContent = count(s.generation_tokens);
  $("prompt-tokens").textContent = count(s.prompt_tokens);
  $("ttft").textContent = s.mean_ttft_seconds === null ? "–"
    : (1000 * s.mean_ttft_seconds).toFixed(0) + " ms";
  $("running").textContent = s.requests_running;
  $("max-concurrency").textContent = s.max_concurrency;
  $("waiting").textContent = s.requests_waiting;
  $("finished").textContent = count(s.requests_finished);
  $("failed").textContent = count(s.requests_failed);

  $("acceptance").textContent = percent(s.acceptance_rate);
  $("acceptance-length").textContent = fmt(s.mean_acceptance_length, 2);
  $("drafts").textContent = count(s.num_drafts);
  // Draft tokens copied from the context (--draft-source lookup|both): accepted / drafted.
  $("lookup").textContent = s.lookup_draft_tokens
    ? `${count(s.lookup_accepted_tokens)} / ${count(s.lookup_draft_tokens)} ` +
      `(${percent(s.lookup_acceptance_rate)})`
    : "–";
  fillRows($("positions").tBodies[0], s.per_position.map((p) => [
    String(p.position + 1), percent(p.rate), bar(p.rate)]));

  const policy = s.draft_policy;
  if (!policy || !policy.max_k) {
    $("policy-mode").textContent = "MTP off";
    fillRows($("k-table").tBodies[0], []);
  } else {
    $("policy-mode").textContent = (policy.adaptive ? "adaptive" : "fixed") +
      `, K ≤ ${policy.max_k}; batch now: ${policy.batch_size}`;
    const tbody = $("k-table").tBodies[0];
    fillRows(tbody, policy.by_batch_size.map((r) => [String(r.batch_size), fmt(r.k)]));
    policy.by_batch_size.forEach((r, i) => {
      tbody.rows[i].title = r.detail;
      tbody.rows[i].classList.toggle("current", r.batch_size === policy.batch_size);
    });
  }

  const pc = s.prefix_cache;
  $("cache-hits").textContent = pc.enabled ? `${count(pc.hits)} of ${count(pc.hits + pc.misses)}` : "off";
  $("cache-tokens").textContent = `${count(s.prefix_cache_hit_tokens)} of ${count(s.prefix_cache_query_tokens)}`;
  $("cache-entries").textContent = count(pc.entries);
  $("cache-bytes").textContent = `${bytes(pc.bytes)} of ${bytes(pc.max_bytes)}`;

  const mem = s.memory;  // serve --memory-budget: what admission accounts
  $("memory-budget").textContent = mem.budget_bytes === null ? "none" : bytes(mem.budget_bytes);
  $("memory-sequences").textContent = bytes(mem.sequences_bytes);
  $("memory-reserved").textContent = bytes(mem.reserved_bytes);
  $("memory-prefix-cache").textContent = bytes(mem.prefix_cache_bytes);

  tpsHistory.push(s.generation_tokens_per_second || 0);
  if (tpsHistory.length > 60) tpsHistory.shift();
  drawChart();
}

let dashboardAbort = null;
let wakeDashboard = () => {};  // resolves the wait for a key or for the tab to show again
const untilWoken = () => new Promise((resolve) => { wakeDashboard = resolve; });

function setStatus(state, title) {
  $("status").dataset.state = state;
  $("status").title = title;
}

// A hidden tab does not follow the stream: snapshots cost the server a little work.
async function followDashboard() {
  let delay = 1000;
  for (;;) {
    if (document.hidden) {
      setStatus("connecting", "paused while the tab is hidden");
      await untilWoken();
      continue;
    }
    dashboardAbort = new AbortController();
    try {
      const response = await fetch("/v1/dashboard/events",
                                   { headers: headers(), signal: dashboardAbort.signal });
      if (response.status === 401) {
        setStatus("error", "API key required");
        $("model").textContent = "enter the server's API key";
        $("api-key").focus();
        await untilWoken();
        continue;
      }
      if (!response.ok) throw new Error(await errorMessage(response));
      setStatus("live", "live");
      delay = 1000;
      for await (const data of sseData(response)) update(JSON.parse(data));
      setStatus("error", "stream ended");
    } catch (e) {
      if (e.name === "AbortError") continue;  // a new key, or the tab was hidden
      setStatus("error", String(e.message || e));
    }
    await new Promise((resolve) => setTimeout(resolve, delay));
    delay = Math.min(2 * delay, 10000);
  }
}

// --- wiring ----------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = apiKey;
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    apiKey = $("api-key").value.trim();
    sessionStorage.setItem(KEY_STORAGE, apiKey);
    if (dashboardAbort) dashboardAbort.abort();
    wakeDashboard();
  });
  document.addEventListener("visibilitychange", () => {
    if (document.hidden) {
      if (dashboardAbort) dashboardAbort.abort();
    } else {
      wakeDashboard();
    }
  });
  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || chatAbort) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("prompt").addEventListener("paste", (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])];
    if (files.some((f) => f.type.startsWith("image/"))) {
      e.preventDefault();
      attachImages(files);
    }
  });
  const composer = $("chat-form");
  composer.addEventListener("dragover", (e) => {
    e.preventDefault();
    composer.classList.add("dropping");
  });
  composer.addEventListener("dragleave", () => composer.classList.remove("dropping"));
  composer.addEventListener("drop", (e) => {
    e.preventDefault();
    composer.classList.remove("dropping");
    attachImages([...e.dataTransfer.files]);
  });
  $("attach").addEventListener("click", () => $("image-file").click());
  $("image-file").addEventListener("change", (e) => {
    attachImages([...e.target.files]);
    e.target.value = "";
  });
  $("stop").addEventListener("click", () => chatAbort && chatAbort.abort());
  $("new-chat").addEventListener("click", () => {
    if (chatAbort) chatAbort.abort();
    conversation.length = 0;
    attached.length = 0;
    showAttachments();
    $("messages").replaceChildren();
  });
  followDashboard();
});
