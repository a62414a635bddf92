// The chat playground: the settings panel → a /v1/chat/completions request, streamed back over
// SSE into the conversation (reasoning apart, tool calls as JSON), with each reply's time to first
// token and tokens per second. Errors (the API's OpenAI-shaped body, or the page's own check of
// a JSON field) show in the banner above the conversation, and the failed turn is taken back.

import { APIError, api, getKey, setKey, sseData } from "./api.js";

const $ = (id) => document.getElementById(id);
const NUMBER_FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed",
  "presence_penalty", "frequency_penalty"];
const SETTINGS_ITEM = "llmserve.playground";

let history = []; // the conversation sent with each request (system prompt apart)
let controller = null; // the reply in flight, to stop it

function showError(error) {
  const banner = $("error");
  banner.textContent = error ? String(error) : "";
  banner.hidden = !error;
}

/** Whether the conversation shows its end: a growing reply is followed only then (a reader who
 * scrolled up stays where they are). */
function atEnd() {
  const list = $("messages");
  return list.scrollHeight - list.scrollTop - list.clientHeight < 40;
}

function scrollToEnd() {
  $("messages").scrollTop = $("messages").scrollHeight;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text; // model text is never parsed as HTML
  return node;
}

// -- models -------------------------------------------------------------------------------------

async function loadModels() {
  const select = $("model");
  const previous = select.value || localStorage.getItem(`${SETTINGS_ITEM}.model`);
  try {
    const { data } = await (await api("/v1/models")).json();
    select.replaceChildren(...data.map((m) => {
      const option = element("option", "", m.state && m.state !== "loaded" ? `${m.id} (${m.state})` : m.id);
      option.value = m.id;
      return option;
    }));
    if (data.some((m) => m.id === previous)) select.value = previous;
    showError(null);
  } catch (e) {
    select.replaceChildren();
    showError(e);
  }
}

// -- the request --------------------------------------------------------------------------------

function parseJSONField(id, name) {
  try {
    return JSON.parse($(id).value);
  } catch (e) {
    throw new APIError(0, `not valid JSON: ${e.message}`, name);
  }
}

/** The request body for `messages`, from the settings; empty fields are left to the server. */
function buildRequest(messages) {
  const system = $("system").value.trim();
  const body = {
    model: $("model").value || undefined,
    messages: system ? [{ role: "system", content: system }, ...messages] : messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  for (const name of NUMBER_FIELDS) {
    const raw = $(name).value.trim();
    if (raw !== "") body[name] = Number(raw);
  }
  const stop = $("stop").value.split("\n").filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  const format = $("response-format").value;
  if (format === "json_object") body.response_format = { type: "json_object" };
  if (format === "json_schema") {
    const schema = parseJSONField("schema", "json_schema.schema");
    body.response_format = { type: "json_schema", json_schema: { name: "output", schema, strict: true } };
  }
  if ($("tools").value.trim()) {
    body.tools = parseJSONField("tools", "tools");
    body.tool_choice = $("tool-choice").value;
  }
  return body;
}

// -- one reply ----------------------------------------------------------------------------------

/** The DOM of an assistant reply, filled as deltas arrive. */
class ReplyView {
  constructor(parent, model) {
    this.node = element("div", "message assistant");
    this.node.append(element("div", "role", model || "assistant"));
    this.reasoning = element("details", "reasoning");
    this.reasoning.append(element("summary", "", "Reasoning"), element("pre", ""));
    this.reasoning.hidden = true;
    this.reasoning.open = true;
    this.content = element("div", "content");
    this.tools = element("div", "tool-calls");
    this.stats = element("div", "stats", "…");
    this.node.append(this.reasoning, this.content, this.tools, this.stats);
    parent.append(this.node);
  }

  addReasoning(text) {
    this.reasoning.hidden = false;
    this.reasoning.querySelector("pre").textContent += text;
  }

  showCalls(calls) {
    this.tools.replaceChildren(...calls.map((c) => {
      const node = element("pre", "tool-call", `${c.function.name}(${c.function.arguments})`);
      node.title = node.dataset.id = c.id || "";
      return node;
    }));
  }
}

/** The reply's text, reasoning and tool calls, and the times its tokens came. */
class Reply {
  constructor(view) {
    this.view = view;
    this.content = "";
    this.calls = [];
    this.usage = null;
    this.finish = null;
    this.start = performance.now();
    this.first = null;
    this.last = null;
  }

  add(chunk) {
    const follow = atEnd();
    if (chunk.usage) this.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      if (delta.content || delta.reasoning_content || delta.tool_calls) {
        this.last = performance.now();
        this.first ??= this.last;
      }
      if (delta.reasoning_content) this.view.addReasoning(delta.reasoning_content);
      if (delta.content) {
        this.content += delta.content;
        this.view.content.textContent = this.content;
      }
      for (const call of delta.tool_calls || []) this.addCall(call);
      if (choice.finish_reason) this.finish = choice.finish_reason;
    }
    if (follow) scrollToEnd();
  }

  addCall(delta) {
    const call = (this.calls[delta.index ?? 0] ??= { id: delta.id, type: "function",
      function: { name: "", arguments: "" } });
    if (delta.id) call.id = delta.id;
    call.function.name += delta.function?.name || "";
    call.function.arguments += delta.function?.arguments || "";
    this.view.showCalls(this.calls);
  }

  /** TTFT: request sent → first token; tokens/s: the tokens after the first ÷ the time they took. */
  summary(stopped) {
    const parts = [];
    if (this.first !== null) parts.push(`TTFT ${((this.first - this.start) / 1000).toFixed(2)} s`);
    const tokens = this.usage?.completion_tokens;
    if (tokens > 1 && this.last > this.first) {
      parts.push(`${((tokens - 1) / ((this.last - this.first) / 1000)).toFixed(1)} tokens/s`);
    }
    if (tokens !== undefined) parts.push(`${tokens} tokens`);
    parts.push(stopped ? "stopped" : `finish: ${this.finish}`);
    return parts.join(" · ");
  }

  message() {
    const message = { role: "assistant", content: this.content || (this.calls.length ? null : "") };
    if (this.calls.length) message.tool_calls = this.calls;
    return message;
  }
}

/** The first tool call of the last assistant turn that has no result yet (undefined: none). */
function pendingCall() {
  const last = history.findLastIndex((m) => m.role === "assistant");
  const answered = new Set(history.slice(last + 1).map((m) => m.tool_call_id));
  return history[last]?.tool_calls?.find((call) => !answered.has(call.id));
}

/** The next turn: the user's message, or (sent "as tool result") the result of the pending call. */
function nextTurn(text) {
  if ($("role").value === "user") return { message: { role: "user", content: text }, label: "user" };
  const call = pendingCall();
  if (call === undefined) throw new APIError(0, "no tool call waits for a result", "role");
  return { message: { role: "tool", tool_call_id: call.id, content: text },
    label: `tool result · ${call.function.name}` };
}

async function send(text) {
  let body;
  let turn;
  try {
    turn = nextTurn(text);
    body = buildRequest([...history, turn.message]);
  } catch (e) { // a field the page could not read: nothing was sent
    $("prompt").value = text;
    showError(e);
    return;
  }
  const messages = [...history, turn.message];
  showError(null);
  const turnNode = element("div", `message ${turn.message.role}`);
  turnNode.append(element("div", "role", turn.label), element("div", "content", text));
  $("messages").append(turnNode);
  if (turn.message.role === "tool") {
    history = messages;
    if (pendingCall()) return; // the model answers once every call of its turn has its result
  }
  const view = new ReplyView($("messages"), body.model);
  const reply = new Reply(view);
  scrollToEnd();
  setBusy(true);
  controller = new AbortController();
  try {
    const response = await api("/v1/chat/completions", { body, signal: controller.signal });
    for await (const chunk of sseData(response)) reply.add(chunk);
    view.stats.textContent = reply.summary(false);
    history = [...messages, reply.message()];
    $("role").value = pendingCall() ? "tool" : "user"; // calls made: their results come next
  } catch (e) {
    if (e.name === "AbortError") { // a stopped reply stays, as far as it came
      view.stats.textContent = reply.summary(true);
      history = [...messages, reply.message()];
    } else { // the turn is taken back: fix the setting and send again
      history = messages.slice(0, -1);
      $("role").value = turn.message.role;
      turnNode.remove();
      view.node.remove();
      $("prompt").value = text;
      showError(e);
    }
  } finally {
    controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop-button").disabled = !busy;
  document.body.dataset.busy = busy ? "true" : "false"; // tests wait on it
}

// -- settings kept across visits ----------------------------------------------------------------

const KEPT = ["system", ...NUMBER_FIELDS, "stop", "response-format", "schema", "tools", "tool-choice"];

function saveSettings() {
  const values = Object.fromEntries(KEPT.map((id) => [id, $(id).value]));
  localStorage.setItem(SETTINGS_ITEM, JSON.stringify(values));
  localStorage.setItem(`${SETTINGS_ITEM}.model`, $("model").value);
  $("schema-label").hidden = $("response-format").value !== "json_schema";
}

function restoreSettings() {
  let values = {};
  try {
    values = JSON.parse(localStorage.getItem(SETTINGS_ITEM) || "{}");
  } catch {
    // a damaged entry: the defaults
  }
  for (const id of KEPT) if (typeof values[id] === "string") $(id).value = values[id];
  $("schema-label").hidden = $("response-format").value !== "json_schema";
}

function main() {
  restoreSettings();
  $("api-key").value = getKey();
  $("api-key").addEventListener("change", () => {
    setKey($("api-key").value.trim());
    loadModels();
  });
  $("reload-models").addEventListener("click", loadModels);
  $("settings").addEventListener("change", saveSettings);
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop-button").addEventListener("click", () => controller?.abort());
  $("clear").addEventListener("click", () => {
    history = [];
    $("role").value = "user";
    $("messages").replaceChildren();
    showError(null);
  });
  setBusy(false);
  loadModels();
}

main();
