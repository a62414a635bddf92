"""`PrometheusStatLogger`: the /metrics exposition, vLLM's metric set under the `llmserve:` prefix.

Every metric carries a `model_name` label; names, types and meanings follow vLLM's (V1) metrics
one for one, so a vLLM dashboard ports by replacing the `vllm:` prefix (docs/metrics.md has the
table). Counters and histograms are updated from each step's `IterationStats` on the event loop;
the gauges are set from the step's scheduler snapshot. Rejected requests (which never reach the
engine) are counted by the server through `record_rejected`.

Every metric also carries an `engine` label (`native`, `openai`). A server with several models keeps
one registry (`MetricFamilies`) and gives each model its own `PrometheusStatLogger` (the children
for its labels); a logger built alone owns a fresh registry, so two never collide.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from llmserve.metrics.stats import IterationStats, LoRAStats, SpecDecodingStats

PREFIX = "llmserve:"

FINISH_REASONS = ("stop", "length", "abort")
REJECT_REASONS = ("validation", "auth", "not_found", "too_large", "queue_full", "unavailable")

# Seconds. CPU serving spans milliseconds (a decode step) to minutes (a long batch under load).
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
    10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.0, 5.0, 10.0, 30.0,
)  # fmt: skip


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context length."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return [*buckets, float(max_model_len)] if buckets[-1] < max_model_len else buckets
            buckets.append(float(m * scale))
        scale *= 10


_LABELS = ["model_name", "engine"]
CACHE_INFO_KEYS = (
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "kv_bytes_per_token",
    "num_kv_blocks",
)


def new_registry() -> CollectorRegistry:
    """A registry with the process and Python collectors of prometheus-client's default one."""
    registry = CollectorRegistry(auto_describe=True)
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


class MetricFamilies:
    """Every llmserve: metric of one registry, labelled by `model_name` and `engine`; each served
    model binds its own children (`PrometheusStatLogger`). Token-count histograms end at
    `max_model_len` (a server with several models passes the largest context it may meet)."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int) -> None:
        self.registry = r = registry
        tokens = _token_buckets(max_model_len)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, _LABELS, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*_LABELS, *extra], registry=r)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, _LABELS, buckets=buckets, registry=r)

        # scheduler state (gauges)
        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        # counters
        self.cache_queries = counter(
            "prefix_cache_queries", "Prefix-cache queries, in terms of number of queried tokens."
        )
        self.cache_hits = counter(
            "prefix_cache_hits", "Prefix-cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.success = counter(
            "request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.rejected = counter(
            "request_rejected", "Requests refused before reaching the engine, by reason (llmserve only).",
            ("reason",),
        )  # fmt: skip
        # histograms
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        )  # fmt: skip
        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            _TOKEN_LATENCY_BUCKETS,
        )  # fmt: skip
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", _TOKEN_LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.inference_time = histogram(
            "request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.decode_time = histogram(
            "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.prompt_len = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_len = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.params_n = histogram(
            "request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]
        )
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.cache_info = Gauge(
            PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig.",
            [*_LABELS, *CACHE_INFO_KEYS], registry=r,
        )  # fmt: skip
        self.spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", ("position",)
        )
        self.lora_info = Gauge(
            PREFIX + "lora_requests_info", "Running stats on lora requests.",
            [*_LABELS, "max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r,
        )  # fmt: skip
        self.lora_requests = counter(
            "lora_requests", "Finished requests per LoRA adapter, by reason (llmserve only).",
            ("lora_name", "finished_reason"),
        )  # fmt: skip
        self.model_loaded = gauge(
            "model_loaded", "1 while the model is loaded and serving, 0 otherwise (llmserve only)."
        )
        self.model_loads = counter("model_loads", "Model loads, by outcome (llmserve only).", ("outcome",))
        self.model_load_time = histogram(
            "model_load_seconds", "Histogram of the time a model took to load (llmserve only).",
            (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),
        )  # fmt: skip


class PrometheusStatLogger:
    """One model's view of the metrics: the families' children for its `model_name` and `engine`.

    Without `families` the logger owns a fresh registry (two loggers in one process never collide).
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        cache_info: dict[str, str] | None = None,
        families: MetricFamilies | None = None,
        engine: str = "native",
    ) -> None:
        f = families or MetricFamilies(new_registry(), max_model_len)
        self.families = f
        self.registry = f.registry
        labels = (model_name, engine)
        self.labels = labels
        self.running = f.running.labels(*labels)
        self.waiting = f.waiting.labels(*labels)
        self.kv_usage = f.kv_usage.labels(*labels)
        self.cache_queries = f.cache_queries.labels(*labels)
        self.cache_hits = f.cache_hits.labels(*labels)
        self.preemptions = f.preemptions.labels(*labels)
        self.prompt_tokens = f.prompt_tokens.labels(*labels)
        self.generation_tokens = f.generation_tokens.labels(*labels)
        self.success = {reason: f.success.labels(*labels, reason) for reason in FINISH_REASONS}
        self.rejected = {reason: f.rejected.labels(*labels, reason) for reason in REJECT_REASONS}
        self.iteration_tokens = f.iteration_tokens.labels(*labels)
        self.ttft = f.ttft.labels(*labels)
        self.itl = f.itl.labels(*labels)
        self.tpot = f.tpot.labels(*labels)
        self.e2e = f.e2e.labels(*labels)
        self.queue_time = f.queue_time.labels(*labels)
        self.inference_time = f.inference_time.labels(*labels)
        self.prefill_time = f.prefill_time.labels(*labels)
        self.decode_time = f.decode_time.labels(*labels)
        self.prompt_len = f.prompt_len.labels(*labels)
        self.generation_len = f.generation_len.labels(*labels)
        self.params_n = f.params_n.labels(*labels)
        self.params_max_tokens = f.params_max_tokens.labels(*labels)
        if cache_info:
            f.cache_info.labels(*labels, *(cache_info.get(k, "") for k in CACHE_INFO_KEYS)).set(1)
        self._last_queries = self._last_hits = self._last_preemptions = 0
        self._last_spec: SpecDecodingStats | None = None
        self._lora_labels: tuple[str, ...] | None = None

    def _record_spec(self, spec: SpecDecodingStats) -> None:
        """Speculation's counters are cumulative in the engine: add what changed since the last step."""
        last = self._last_spec or SpecDecodingStats(accepted_per_pos=(0,) * len(spec.accepted_per_pos))
        f, labels = self.families, self.labels
        if spec.num_drafts == last.num_drafts:
            return
        f.spec_drafts.labels(*labels).inc(spec.num_drafts - last.num_drafts)
        f.spec_draft_tokens.labels(*labels).inc(spec.num_draft_tokens - last.num_draft_tokens)
        f.spec_accepted_tokens.labels(*labels).inc(spec.num_accepted_tokens - last.num_accepted_tokens)
        for pos, (now, before) in enumerate(zip(spec.accepted_per_pos, last.accepted_per_pos, strict=True)):
            if now != before:
                f.spec_accepted_per_pos.labels(*labels, str(pos)).inc(now - before)
        self._last_spec = spec

    def _record_lora(self, lora: LoRAStats) -> None:
        """vLLM's lora_requests_info: one series whose labels name the adapters running and
        waiting (comma-separated), its value the time of the last update. The series of the
        previous labels is removed, so the gauge holds only the current state."""
        labels = (*self.labels, str(lora.max_lora), ",".join(lora.waiting), ",".join(lora.running))
        if labels != self._lora_labels:
            self._remove_lora_info()
            self._lora_labels = labels
        self.families.lora_info.labels(*labels).set_to_current_time()

    def _remove_lora_info(self) -> None:
        if self._lora_labels is not None:
            self.families.lora_info.remove(*self._lora_labels)
            self._lora_labels = None

    def set_idle(self) -> None:
        """The model was unloaded: its gauges read 0 (counters keep their totals)."""
        for g in (self.running, self.waiting, self.kv_usage):
            g.set(0)
        self._remove_lora_info()
        self._last_queries = self._last_hits = self._last_preemptions = 0
        self._last_spec = None

    def record(self, stats: IterationStats) -> None:
        sched = stats.scheduler
        if sched is not None:
            self.running.set(sched.num_running)
            self.waiting.set(sched.num_waiting)
            self.kv_usage.set(sched.kv_usage)
            # the scheduler's counters are cumulative: add what changed since the last step
            self.cache_queries.inc(sched.prefix_cache_queries - self._last_queries)
            self.cache_hits.inc(sched.prefix_cache_hits - self._last_hits)
            self.preemptions.inc(sched.num_preemptions - self._last_preemptions)
            self._last_queries, self._last_hits = sched.prefix_cache_queries, sched.prefix_cache_hits
            self._last_preemptions = sched.num_preemptions
            if sched.step_tokens:
                self.iteration_tokens.observe(sched.step_tokens)
            if sched.spec is not None:
                self._record_spec(sched.spec)
            if sched.lora is not None:
                self._record_lora(sched.lora)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.itl.observe(itl)
        for f in stats.finished:
            self.success[f.finish_reason].inc()
            if f.lora_name is not None:
                self.families.lora_requests.labels(*self.labels, f.lora_name, f.finish_reason).inc()
            self.e2e.observe(f.e2e_latency)
            self.prompt_len.observe(f.num_prompt_tokens)
            self.generation_len.observe(f.num_generation_tokens)
            self.params_n.observe(f.n)
            self.params_max_tokens.observe(f.max_tokens)
            for value, histogram in (
                (f.queue_time, self.queue_time),
                (f.prefill_time, self.prefill_time),
                (f.decode_time, self.decode_time),
                (f.inference_time, self.inference_time),
                (f.time_per_output_token, self.tpot),
            ):
                if value is not None:
                    histogram.observe(value)

    def record_rejected(self, reason: str) -> None:
        self.rejected[reason].inc()

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of the /metrics response."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
