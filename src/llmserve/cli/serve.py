"""`llmserve serve`: the OpenAI-compatible server.

    llmserve serve                                  # the embedded SmolLM2-135M-Instruct on :8000
    llmserve serve ./my-model --port 9000 --api-key $KEY
    LLMSERVE_API_KEY=... llmserve serve model.gguf --max-queued-requests 64
    llmserve serve smollm2:135m=smollm2-135m-instruct gemma3:270m=gemma3-270m --max-loaded-models 1
    llmserve serve --config models.yaml --models-memory 4GiB --keep-alive 10m
    llmserve serve ./my-model --replicas 2             # on Ray Serve (cli/serve_ray.py)

Several models: the first is the default (a request without `model`) and loads at start-up, the
others on their first request (`--preload all` loads every one); `--config` lists models with
their own engines, options and aliases (docs/serving.md).

SIGTERM/SIGINT: stop accepting, let in-flight requests finish for up to --shutdown-timeout seconds,
abort the rest, exit 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmserve.cli.engine_args import add_engine_args, llm_kwargs
from llmserve.cli.serve_ray import add_ray_args
from llmserve.config import ServerConfig
from llmserve.config.cache import parse_bytes
from llmserve.config.models import ModelSpec, check_specs, load_models_file, parse_duration

logger = logging.getLogger("llmserve.server")

ENGINE_DIED_EXIT_CODE = 3  # 2 is bad input (a refused model or flag)
SHUTDOWN_GRACE = 2.0  # seconds for aborted requests to send their error before uvicorn cancels them


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI API")
    p.add_argument(
        "model_tag", nargs="*", default=[], metavar="MODEL",
        help="model(s) to serve: a folder, .gguf file or bundled name, or NAME=SOURCE to serve it as NAME "
        "(an Ollama-style name:tag works); the first is the default",
    )  # fmt: skip
    m = p.add_argument_group("several models")
    m.add_argument(
        "--config", default=None, help="a models.yaml listing the models to serve (instead of MODEL)"
    )
    m.add_argument(
        "--preload", choices=["first", "all", "none"], default="first",
        help="which of the MODELs load at start-up (the rest load on their first request)",
    )  # fmt: skip
    m.add_argument(
        "--max-loaded-models", type=int, default=None,
        help="native models loaded at once; loading another unloads the least recently used idle one",
    )  # fmt: skip
    m.add_argument(
        "--models-memory", type=parse_bytes, default=None,
        help="memory the loaded models may take together (weights + KV caches), e.g. 8GiB",
    )  # fmt: skip
    m.add_argument(
        "--keep-alive", default="-1",
        help="how long an idle model stays loaded: 5m, 1h, 300 (seconds); -1: until evicted (default)",
    )  # fmt: skip
    m.add_argument(
        "--model-load-timeout", type=float, default=ServerConfig().model_load_timeout,
        help="seconds a request waits for its model to load before a 503 (the load goes on)",
    )  # fmt: skip
    s = p.add_argument_group("server")
    defaults = ServerConfig()
    s.add_argument("--host", default=defaults.host)
    s.add_argument("--port", type=int, default=defaults.port)
    s.add_argument(
        "--grpc-port", type=int, default=None,
        help="also serve the Open Inference Protocol v2 over gRPC on this port (needs llmserve[grpc])",
    )  # fmt: skip
    s.add_argument("--served-model-name", default=None, help="the name clients use (default: MODEL)")
    s.add_argument(
        "--api-key",
        default=os.environ.get("LLMSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health and /livez (default: $LLMSERVE_API_KEY)",
    )
    s.add_argument("--allowed-origins", nargs="*", default=[], help="CORS origins (default: CORS off)")
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults.max_queued_requests,
        help="sequences that may wait for a slot; beyond, 429 with Retry-After (-1: unbounded)",
    )
    s.add_argument("--max-body-size", type=parse_bytes, default=defaults.max_body_bytes, help="e.g. 8MiB")
    s.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout)
    s.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="images given as file paths or file:// URLs are read only from under this folder (default: none)",
    )
    s.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="fetch images given as http(s) URLs (off by default)",
    )
    s.add_argument(
        "--media-max-size",
        type=parse_bytes,
        default=defaults.media_max_bytes,
        help="largest image file, e.g. 20MiB",
    )
    s.add_argument(
        "--media-timeout", type=float, default=defaults.media_timeout, help="seconds a remote image may take"
    )
    s.add_argument("--log-requests", action="store_true", help="log prompts and outputs (off by default)")
    s.add_argument("--max-n", type=int, default=defaults.max_n)
    s.add_argument("--disable-metrics", action="store_true", help="no Prometheus metrics at /metrics")
    s.add_argument("--disable-playground", action="store_true", help="no web playground at /")
    s.add_argument(
        "--otlp-traces-endpoint", default=None,
        help="send an OpenTelemetry span per request to this OTLP/gRPC collector, e.g. localhost:4317 "
        "(a `traceparent` header makes it a child of the caller's span; needs llmserve[otel])",
    )  # fmt: skip
    s.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="open POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; behind --api-key)",
    )  # fmt: skip
    s.add_argument(
        "--stats-log-interval", type=float, default=defaults.stats_log_interval,
        help="seconds between engine stats log lines while busy (0: off)",
    )  # fmt: skip
    s.add_argument(
        "--enable-response-timings", action="store_true",
        help="add llama.cpp-style `timings` to every response (else only with return_timings: true)",
    )  # fmt: skip
    s.add_argument(
        "--responses-store-size", type=int, default=defaults.responses_store_size,
        help="responses kept for previous_response_id and GET /v1/responses/{id} (least recently used go)",
    )  # fmt: skip
    s.add_argument("--ssl-keyfile", default=None, help="TLS: the server's private key (PEM); serve https")
    s.add_argument("--ssl-certfile", default=None, help="TLS: the server's certificate chain (PEM)")
    s.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="TLS: CA certificates that client certificates are verified against",
    )
    s.add_argument(
        "--ssl-cert-reqs", type=int, choices=[0, 1, 2], default=defaults.ssl_cert_reqs,
        help="TLS: client certificates 0: not asked for, 1: optional, 2: required (Python's ssl.CERT_*)",
    )  # fmt: skip
    s.add_argument(
        "--reasoning-parser", choices=["auto", "none", "think", "openai_gptoss"], default="auto",
        help="split <think>...</think> (think) or gpt-oss's analysis channel (openai_gptoss) into "
        "reasoning_content (auto: the one the chat template uses)",
    )  # fmt: skip
    s.add_argument(
        "--tool-call-parser", choices=["auto", "hermes", "llama3_json", "mistral", "openai"], default="auto",
        help="tool-call format: hermes (<tool_call>), llama3_json, mistral ([TOOL_CALLS]), openai (gpt-oss's harmony); "
        "auto: the one the chat template uses",
    )  # fmt: skip
    b = p.add_argument_group("batches (the Files and Batches APIs)")
    b.add_argument(
        "--batch-dir", default=None,
        help="where uploaded files, batch records and results live; a restart resumes its batches "
        "(default: ~/.cache/llmserve/batches)",
    )  # fmt: skip
    b.add_argument(
        "--batch-max-concurrency", type=int, default=defaults.batch_max_concurrency,
        help="batch lines in flight at once (fewer: online requests wait less behind batch lines)",
    )  # fmt: skip
    add_ray_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        served_model_name=args.served_model_name,
        api_key=args.api_key or None,
        allowed_origins=tuple(args.allowed_origins),
        max_queued_requests=None if args.max_queued_requests < 0 else args.max_queued_requests,
        max_body_bytes=args.max_body_size,
        shutdown_timeout=args.shutdown_timeout,
        allowed_local_media_path=args.allowed_local_media_path,
        allow_remote_media=args.allow_remote_media,
        media_max_bytes=args.media_max_size,
        media_timeout=args.media_timeout,
        log_requests=args.log_requests,
        max_n=args.max_n,
        enable_metrics=not args.disable_metrics,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        enable_playground=not args.disable_playground,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        stats_log_interval=args.stats_log_interval,
        enable_response_timings=args.enable_response_timings,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        max_loaded_models=args.max_loaded_models,
        models_memory=args.models_memory,
        keep_alive=parse_duration(args.keep_alive),  # type: ignore[arg-type]
        model_load_timeout=args.model_load_timeout,
        responses_store_size=args.responses_store_size,
        ssl_keyfile=_readable(args.ssl_keyfile, "--ssl-keyfile"),
        ssl_certfile=_readable(args.ssl_certfile, "--ssl-certfile"),
        ssl_ca_certs=_readable(args.ssl_ca_certs, "--ssl-ca-certs"),
        ssl_cert_reqs=args.ssl_cert_reqs,
        batch_dir=args.batch_dir,
        batch_max_concurrency=args.batch_max_concurrency,
    )


def _readable(path: str | None, flag: str) -> str | None:
    """A TLS file checked at start-up: uvicorn would fail later, with a traceback and no flag name."""
    if path is not None and not os.access(path, os.R_OK):
        raise ValueError(f"{flag}: cannot read {path!r}")
    return path


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    """The models to serve: --config's, or the MODEL arguments (--model counts as the first)."""
    from llmserve.model_executor.model_loader.source import DEFAULT_MODEL

    given = ([args.model] if args.model else []) + list(args.model_tag)
    if args.config:
        if given:
            raise ValueError("give the models either as MODEL arguments or in --config, not both")
        if args.served_model_name:
            raise ValueError("--served-model-name does not apply to --config (name each model in the file)")
        return load_models_file(args.config)
    if args.served_model_name and len(given) > 1:
        raise ValueError("--served-model-name names one model; with several, write NAME=SOURCE for each")
    specs = []
    for i, item in enumerate(given or [None]):
        if item is None:
            name, source = DEFAULT_MODEL, None
        elif "=" in item and not Path(item).exists():  # NAME=SOURCE (a path may contain '=')
            name, _, source = item.partition("=")
            if not name or not source:
                raise ValueError(f"cannot read {item!r} as NAME=SOURCE")
        else:
            name, source = item, item
        if i == 0 and args.served_model_name:
            name = args.served_model_name
        preload = args.preload == "all" or (args.preload == "first" and i == 0)
        specs.append(ModelSpec(name=name, source=source, preload=preload))
    check_specs(specs)
    return specs


def run(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        from llmserve.cli import serve_ray

        return serve_ray.run(args)
    import uvicorn

    from llmserve.server.app import build_app

    config = server_config(args)
    specs = model_specs(args)
    kwargs: dict[str, Any] = llm_kwargs(args)
    app = build_app(specs, config, kwargs)
    state = app.state.server
    model_name = ", ".join(s.name for s in specs)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not state.draining:
                logger.info(
                    "%s: draining; in-flight requests have %.0f s to finish",
                    signal.Signals(sig).name, config.shutdown_timeout,
                )  # fmt: skip
            if state.draining:
                self.force_exit = True  # a second signal: stop waiting for anything
            state.draining = True
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                # uvicorn re-raises the captured signal after shutting down, so the process
                # would die by it; a drained shutdown is a normal exit (status 0)
                self._captured_signals.clear()

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # uvicorn cancels the requests still open at its timeout: their clients see the
            # connection cut and each leaves an ERROR traceback. So at --shutdown-timeout the
            # engine aborts them instead (each ends with an SSE error event or a 503), and
            # uvicorn's cancellation, SHUTDOWN_GRACE later, is the last resort.
            abort = asyncio.get_running_loop().call_later(config.shutdown_timeout, abort_in_flight)
            try:
                await super().shutdown(sockets)
            finally:
                abort.cancel()

    def abort_in_flight() -> None:
        state.models.abort_all("the server is shutting down")

    server = Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=logging.getLevelName(logging.getLogger().level).lower(),
            timeout_graceful_shutdown=config.shutdown_timeout + SHUTDOWN_GRACE,
            access_log=False,
            ssl_keyfile=config.ssl_keyfile,
            ssl_certfile=config.ssl_certfile,
            ssl_ca_certs=config.ssl_ca_certs,
            ssl_cert_reqs=config.ssl_cert_reqs,
        )
    )
    failed: list[BaseException] = []

    def on_load_error(e: BaseException) -> None:
        failed.append(e)
        server.should_exit = True

    died: list[BaseException] = []

    def on_engine_dead(e: BaseException) -> None:
        # Every in-flight request has its error (500) and /health answers 503; exit non-zero so
        # that a supervisor (systemd, Kubernetes, docker --restart) starts a fresh process.
        logger.error("the engine stopped (%r): shutting the server down", e)
        died.append(e)
        state.draining = True
        server.should_exit = True

    state.on_load_error = on_load_error
    state.on_engine_dead = on_engine_dead
    scheme = "https" if config.ssl_certfile else "http"
    logger.info(
        "llmserve listening on %s://%s:%d (model %r loading)", scheme, config.host, config.port, model_name
    )
    server.run()
    if failed:
        raise ValueError(f"cannot serve {model_name!r}: {failed[0]}")
    if died:
        print(f"llmserve: the engine stopped: {died[0]!r}", file=sys.stderr)
        return ENGINE_DIED_EXIT_CODE
    return 0
