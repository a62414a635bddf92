// The metrics page: /metrics polled every second (with the key, like every API call), its
// Prometheus text parsed here, and the last two minutes drawn: running and waiting requests
// (every model summed), KV cache usage (per model), prompt and generation tokens per second (the
// counters' increase over the last few seconds ÷ that time).

import { api, getKey, setKey } from "./api.js";
import { LineChart } from "./chart.js";

const PREFIX = "llmserve:"; // docs/metrics.md: vLLM's names with this prefix
const POLL_MS = 1000;
const SPAN_S = 120;
const RATE_WINDOW_S = 5; // rates over the last 5 s (Prometheus's rate() over a window): steadier lines

const $ = (id) => document.getElementById(id);

/** Prometheus text exposition → [{name, labels, value}] (comments and blank lines skipped). */
export function parsePrometheus(text) {
  const samples = [];
  const line = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const label = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  for (const raw of text.split("\n")) {
    const match = raw.startsWith("#") ? null : line.exec(raw.trim());
    if (!match) continue;
    const labels = {};
    for (const [, key, value] of (match[2] || "").matchAll(label)) {
      labels[key] = value.replace(/\\n/g, "\n").replace(/\\(.)/g, "$1");
    }
    const value = { "+Inf": Infinity, "-Inf": -Infinity }[match[3]] ?? Number(match[3]);
    samples.push({ name: match[1], labels, value });
  }
  return samples;
}

function total(samples, name) {
  return samples.filter((s) => s.name === PREFIX + name).reduce((sum, s) => sum + s.value, 0);
}

function byModel(samples, name) {
  return Object.fromEntries(samples.filter((s) => s.name === PREFIX + name)
    .map((s) => [s.labels.model_name || "model", s.value]));
}

class History {
  constructor() {
    this.series = {}; // label → [[t, value]]
  }

  push(label, t, value) {
    const points = (this.series[label] ??= []);
    points.push([t, value]);
    while (points.length && points[0][0] < t - SPAN_S - 5) points.shift();
  }
}

// one history per chart, so that a model called "running" cannot mix with the request counts
const history = { requests: new History(), kv: new History(), throughput: new History() };
const charts = {
  requests: new LineChart($("chart-requests"), { span: SPAN_S }),
  kv: new LineChart($("chart-kv"), { span: SPAN_S, yMax: 100 }),
  throughput: new LineChart($("chart-throughput"), { span: SPAN_S }),
};
const counterHistory = []; // the counters of the polls in the rate window

async function poll() {
  const now = performance.now() / 1000;
  try {
    const samples = parsePrometheus(await (await api("/metrics")).text());
    $("error").hidden = true;
    record(samples, now);
  } catch (e) {
    $("error").textContent = String(e);
    $("error").hidden = false;
  }
  draw(now);
}

function record(samples, now) {
  const running = total(samples, "num_requests_running");
  const waiting = total(samples, "num_requests_waiting");
  history.requests.push("running", now, running);
  history.requests.push("waiting", now, waiting);
  const kv = byModel(samples, "kv_cache_usage_perc");
  for (const [model, used] of Object.entries(kv)) history.kv.push(model, now, used * 100);
  const counters = { t: now, generation: total(samples, "generation_tokens_total"),
    prompt: total(samples, "prompt_tokens_total") };
  counterHistory.push(counters);
  while (counterHistory[0].t < now - RATE_WINDOW_S) counterHistory.shift();
  const first = counterHistory[0];
  if (first !== counters) {
    for (const key of ["prompt", "generation"]) {
      // a counter that went down (its model unloaded) gives no negative rate
      const rate = Math.max(0, counters[key] - first[key]) / (now - first.t);
      history.throughput.push(`${key} tokens/s`, now, rate);
    }
  }
  $("tile-running").textContent = running;
  $("tile-waiting").textContent = waiting;
  const fullest = Math.max(...Object.values(kv));
  $("tile-kv").textContent = Number.isFinite(fullest) ? `${(fullest * 100).toFixed(1)}%` : "–";
  const generation = history.throughput.series["generation tokens/s"];
  $("tile-generation").textContent = generation ? generation.at(-1)[1].toFixed(1) : "–";
  $("tile-tokens").textContent = counters.generation;
}

function draw(now) {
  for (const [name, chart] of Object.entries(charts)) chart.draw(history[name].series, now);
}

$("api-key").value = getKey();
$("api-key").addEventListener("change", () => {
  setKey($("api-key").value.trim());
  poll();
});
// the next poll is timed from the end of the last, so a slow answer cannot pile polls up
(async function loop() {
  await poll();
  setTimeout(loop, POLL_MS);
})();
