"""`ServerConfig`: how the HTTP server listens, whom it lets in, and how much one request may ask for."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = None
    """Also serve the Open Inference Protocol v2 over gRPC on this port (needs `grpcio`: the
    `grpc` extra); None: HTTP only."""
    served_model_name: str | None = None
    """The name clients put in `model` (default: the model's own name)."""
    api_key: str | None = None
    """When set, every route except /health needs `Authorization: Bearer <key>`."""
    allowed_origins: tuple[str, ...] = ()
    """CORS origins; none (CORS off) by default."""
    max_queued_requests: int | None = 256
    """Sequences that may wait for a slot; beyond, 429 with Retry-After. None: unbounded."""
    max_body_bytes: int = 8 * 2**20
    """Larger request bodies get 413."""
    shutdown_timeout: float = 30.0
    """On SIGTERM/SIGINT: seconds to let in-flight requests finish before aborting them."""
    log_requests: bool = False
    """Log prompts and outputs (off: only ids, sizes and timings are logged)."""
    max_n: int = 16
    """Cap on `n`."""
    max_logprobs: int = 20
    """Cap on `logprobs` / `top_logprobs`."""
    max_stop: int = 16
    """Cap on the number of stop strings."""
    max_stop_length: int = 256
    """Cap on one stop string's length (characters)."""
    max_prompts: int = 256
    """Cap on the number of prompts in one completions request."""
    allow_runtime_lora_updating: bool = False
    """`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's routes, which vLLM
    opens with VLLM_ALLOW_RUNTIME_LORA_UPDATING): they read adapter folders from this machine's
    disk, so they are off unless asked for, and behind the API key like every route."""
    enable_metrics: bool = True
    """Serve Prometheus metrics at /metrics."""
    enable_playground: bool = True
    """Serve the web playground at / and its metrics charts at /playground/metrics (pages without
    the key; their API calls carry it)."""
    stats_log_interval: float = 5.0
    """Seconds between the engine's periodic log lines while busy (0: no such lines)."""
    enable_response_timings: bool = False
    """Every response carries `timings` (llama.cpp's shape); otherwise only when a request sends
    `return_timings: true`."""
    reasoning_parser: str = "auto"
    """`think`: a chat reply's `<think>…</think>` becomes `reasoning_content` (Qwen3, DeepSeek-R1);
    `openai_gptoss`: gpt-oss's harmony reply, its `analysis` channel the reasoning (tool calls
    parsed too); `none`: the text is left as it is; `auto`: `think` when the chat template
    mentions `<think>`, `openai_gptoss` when it writes `<|channel|>` (and tool_call_parser is auto)."""
    tool_call_parser: str = "auto"
    """How tool calls are written and read back: `hermes` (`<tool_call>` JSON blocks: Qwen,
    Hermes), `llama3_json` (Llama 3.1+), `mistral` (`[TOOL_CALLS]`), `openai` (gpt-oss's harmony
    commentary messages: the whole reply parsed as with reasoning_parser openai_gptoss), or `auto`:
    the format the chat template uses (hermes when it names none)."""
    max_loaded_models: int | None = None
    """Native models loaded at once; loading one more unloads the least recently used idle one.
    None: no limit (only `models_memory`)."""
    models_memory: int | None = None
    """Bytes the loaded native models may take together (weights + KV caches); None: no limit."""
    keep_alive: float = math.inf
    """Seconds a loaded model stays loaded once idle (math.inf: until evicted); a model's own
    keep_alive and Ollama's per-request `keep_alive` override it."""
    model_load_timeout: float = 300.0
    """Seconds a request waits for its model to load before a 503 (the load goes on)."""
    responses_store_size: int = 1000
    """Responses (`/v1/responses`) kept in memory for `previous_response_id` and GET; the least
    recently used goes first. 0: none kept."""
    ssl_keyfile: str | None = None
    """TLS: the server's private key (PEM); with `ssl_certfile`, the server speaks https only."""
    ssl_certfile: str | None = None
    """TLS: the server's certificate chain (PEM)."""
    ssl_ca_certs: str | None = None
    """TLS: the CA certificates that client certificates are verified against."""
    ssl_cert_reqs: int = 0
    """TLS: whether clients must show a certificate, as Python's `ssl` numbers it (and uvicorn and
    vLLM take it): 0 no, 1 optional, 2 required."""
    batch_dir: str | None = None
    """Where the Files and Batches APIs keep uploads, batch records and results (None: the user's
    cache dir, `~/.cache/llmserve/batches`); a restart on the same folder resumes its batches."""
    batch_max_concurrency: int = 2
    """Batch lines in flight at once: the bound that keeps online requests first (a line also
    goes in at the lowest priority, which counts under `--scheduling-policy priority`)."""
    otlp_traces_endpoint: str | None = None
    """Send an OpenTelemetry span per request to this OTLP/gRPC collector (`host:port`, vLLM's
    `--otlp-traces-endpoint`; needs the `otel` extra); None: no tracing."""
    allowed_local_media_path: str | None = None
    """Images named by a file path or `file://` URL are read only from under this folder (None:
    no local files; vLLM's `--allowed-local-media-path`)."""
    allow_remote_media: bool = False
    """Fetch images named by `http(s)://` URLs (off: only data URLs, local files, base64)."""
    media_max_bytes: int = 20 * 2**20
    """Largest image file taken (a data URL's, a local file's or a download's bytes)."""
    media_timeout: float = 10.0
    """Seconds a remote image may take to download."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535]; got {self.port}")
        if self.grpc_port is not None and not 0 <= self.grpc_port < 65536:
            raise ValueError(f"grpc_port must be in [0, 65535]; got {self.grpc_port}")
        if self.grpc_port is not None and self.grpc_port == self.port and self.port:
            raise ValueError(f"grpc_port must differ from port; both are {self.port}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0; got {self.max_queued_requests}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024; got {self.max_body_bytes}")
        if self.stats_log_interval < 0:
            raise ValueError(f"stats_log_interval must be >= 0; got {self.stats_log_interval}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0; got {self.shutdown_timeout}")
        if self.reasoning_parser not in ("auto", "none", "think", "openai_gptoss"):
            raise ValueError(
                f"reasoning_parser must be auto, none, think or openai_gptoss; got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser not in ("auto", "hermes", "llama3_json", "mistral", "openai"):
            raise ValueError(
                "tool_call_parser must be auto, hermes, llama3_json, mistral or openai; "
                f"got {self.tool_call_parser!r}"
            )
        # harmony is one parser for both: the other half cannot be another format
        gptoss, openai = self.reasoning_parser == "openai_gptoss", self.tool_call_parser == "openai"
        if (gptoss and self.tool_call_parser not in ("auto", "openai")) or (
            openai and self.reasoning_parser == "think"
        ):
            raise ValueError(
                "reasoning_parser openai_gptoss and tool_call_parser openai read the same harmony reply: "
                f"got reasoning_parser {self.reasoning_parser!r} with tool_call_parser {self.tool_call_parser!r}"
            )
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError(f"max_loaded_models must be >= 1; got {self.max_loaded_models}")
        if self.models_memory is not None and self.models_memory <= 0:
            raise ValueError(f"models_memory must be > 0 bytes; got {self.models_memory}")
        if self.keep_alive < 0:
            raise ValueError(f"keep_alive must be >= 0 seconds (inf: forever); got {self.keep_alive}")
        if self.model_load_timeout <= 0:
            raise ValueError(f"model_load_timeout must be > 0 seconds; got {self.model_load_timeout}")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0; got {self.responses_store_size}")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("ssl_keyfile needs ssl_certfile (the certificate the key belongs to)")
        if self.ssl_certfile is None and (self.ssl_ca_certs is not None or self.ssl_cert_reqs):
            raise ValueError(
                "ssl_ca_certs and ssl_cert_reqs need ssl_certfile (client certificates need TLS)"
            )
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(
                f"ssl_cert_reqs must be 0 (none), 1 (optional) or 2 (required); got {self.ssl_cert_reqs}"
            )
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError(
                "ssl_cert_reqs needs ssl_ca_certs (the CAs that client certificates are checked against)"
            )
        if self.batch_max_concurrency < 1:
            raise ValueError(f"batch_max_concurrency must be >= 1; got {self.batch_max_concurrency}")
        if self.otlp_traces_endpoint == "":
            raise ValueError("otlp_traces_endpoint must not be empty (leave it unset to disable tracing)")
        if self.media_max_bytes < 1:
            raise ValueError(f"media_max_bytes must be >= 1; got {self.media_max_bytes}")
        if self.media_timeout <= 0:
            raise ValueError(f"media_timeout must be > 0 seconds; got {self.media_timeout}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset to disable authentication)")
