// The API as the pages use it: the key (kept in localStorage, sent as a bearer token on every
// call), OpenAI-shaped error bodies turned into one message, and a streamed reply's SSE events.

const KEY_ITEM = "llmserve.apiKey";
// The server's root, from this file's address (<root>/playground/static/api.js): the pages keep
// working behind a proxy that serves the server under a path prefix.
const ROOT = new URL("../../", import.meta.url);

export function getKey() {
  return localStorage.getItem(KEY_ITEM) || "";
}

export function setKey(key) {
  if (key) localStorage.setItem(KEY_ITEM, key);
  else localStorage.removeItem(KEY_ITEM);
}

/** An error answer: its HTTP status (0: no answer) and the body's message and param. */
export class APIError extends Error {
  constructor(status, message, param = null) {
    super(message);
    this.status = status;
    this.param = param;
  }

  toString() {
    const where = this.param ? `${this.param}: ` : "";
    return `${this.status ? `HTTP ${this.status} · ` : ""}${where}${this.message}`;
  }
}

/** The error of a failed response: {"error": {"message", "param", ...}} or its plain text. */
async function errorOf(response) {
  const text = await response.text();
  try {
    const error = JSON.parse(text).error;
    if (error && error.message) return new APIError(response.status, error.message, error.param);
  } catch {
    // not JSON: a proxy's page, say; shown as it is
  }
  return new APIError(response.status, text || response.statusText);
}

/** fetch() of `path` (from the server's root: "/v1/models") with the key; resolves to the
 * response, or throws an APIError (an abort passes through). */
export async function api(path, { body, signal } = {}) {
  const headers = {};
  const key = getKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(new URL(path.replace(/^\//, ""), ROOT), {
      method: body === undefined ? "GET" : "POST",
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new APIError(0, `the server did not answer (${e.message})`);
  }
  if (!response.ok) throw await errorOf(response);
  return response;
}

/** The `data:` payloads of a text/event-stream, parsed as JSON, until [DONE]. An error event
 * (a failure after the stream began: {"error": {...}}) is thrown as an APIError. */
export async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const payload = JSON.parse(data);
      if (payload.error) {
        const e = payload.error;
        throw new APIError(Number(e.code) || 500, e.message || JSON.stringify(e), e.param);
      }
      yield payload;
    }
  }
}
