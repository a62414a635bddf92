"""The stat loggers without a server: the periodic log line's timing and figures, and the
Prometheus logger's counters fed from scheduler snapshots (cumulative -> deltas)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.metrics.loggers import LoggingStatLogger
from llmserve.metrics.prometheus import PrometheusStatLogger, _token_buckets
from llmserve.metrics.stats import IterationStats, SchedulerStats, SequenceTimes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(running: int, waiting: int, prompt: int = 0, generated: int = 0, queries: int = 0, hits: int = 0):
    stats = IterationStats(
        0.0, SchedulerStats(running, waiting, 100, 25, 0, queries, hits, step_tokens=prompt + generated)
    )
    stats.num_prompt_tokens, stats.num_generation_tokens = prompt, generated
    return stats


def test_log_line_every_interval_while_busy_and_once_when_idle(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    stat_logger = LoggingStatLogger(interval=5.0, clock=clock)
    caplog.set_level(logging.INFO, logger="llmserve")
    clock.now = 1000.0  # a long idle time before the first request is not part of any rate
    stat_logger.record(step(1, 2, prompt=100, queries=100, hits=0))
    for _ in range(4):
        clock.now += 1.0
        stat_logger.record(step(1, 2, generated=10, queries=100, hits=0))
    assert not caplog.records  # 4 s into the busy period
    clock.now += 1.0
    stat_logger.record(step(3, 0, generated=10, queries=300, hits=150))
    (line,) = [r.getMessage() for r in caplog.records]
    # 5 s: 100 prompt tokens, 50 generated; 150 of the 300 queried tokens hit
    assert line == (
        "engine: 3 running, 0 waiting, KV cache 25.0% used, prefix-cache hit rate 50.0%, "
        "prompt 20.0 tok/s, generation 10.0 tok/s"
    )
    clock.now += 0.5
    stat_logger.record(step(0, 0, generated=5, queries=300, hits=150))  # idle: the tail is logged
    assert len(caplog.records) == 2
    assert (
        caplog.records[-1]
        .getMessage()
        .endswith("prefix-cache hit rate -, prompt 0.0 tok/s, generation 10.0 tok/s")
    )
    clock.now += 60
    stat_logger.record(step(0, 0))  # nothing happened: no line
    assert len(caplog.records) == 2


def test_a_busy_period_of_one_step_is_measured_from_its_start(caplog: pytest.LogCaptureFixture) -> None:
    """An embedding request pooled in the step that started the busy period: its rate is over
    that step's time, not over no time at all (it read 4e9 tok/s before)."""
    clock = Clock()
    stat_logger = LoggingStatLogger(interval=5.0, clock=clock)
    caplog.set_level(logging.INFO, logger="llmserve")
    stats = step(0, 0, prompt=4)
    stats.step_seconds = 0.25
    stat_logger.record(stats)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.endswith("prompt 16.0 tok/s, generation 0.0 tok/s")


def sample(logger: PrometheusStatLogger, name: str, **labels: str) -> float:
    body, _ = logger.exposition()
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_prometheus_counters_from_cumulative_scheduler_counts() -> None:
    logger = PrometheusStatLogger("m", max_model_len=2048)
    logger.record(IterationStats(0.0, SchedulerStats(2, 1, 8, 4, 1, 64, 16, step_tokens=40)))
    logger.record(IterationStats(0.0, SchedulerStats(1, 0, 8, 1, 3, 96, 48, step_tokens=2)))
    assert sample(logger, "llmserve:num_preemptions_total", model_name="m") == 3
    assert sample(logger, "llmserve:prefix_cache_queries_total") == 96
    assert sample(logger, "llmserve:prefix_cache_hits_total") == 48
    assert sample(logger, "llmserve:num_requests_running") == 1
    assert sample(logger, "llmserve:kv_cache_usage_perc") == 0.125
    assert sample(logger, "llmserve:iteration_tokens_total_count") == 2
    assert sample(logger, "llmserve:iteration_tokens_total_sum") == 42
    # two loggers in one process do not collide (each has its own registry)
    PrometheusStatLogger("other", max_model_len=16)


def test_finished_sequence_intervals() -> None:
    stats = IterationStats(0.0)
    seq = SequenceTimes(arrival=10.0, num_prompt_tokens=7, max_tokens=4, n=1, first_scheduled=10.5)
    stats.observe_tokens(seq, 1, 11.0)
    stats.observe_tokens(seq, 1, 11.25)
    stats.observe_tokens(seq, 1, 11.75)
    stats.observe_finished(seq, "length", 12.0)
    (f,) = stats.finished
    assert (f.queue_time, f.prefill_time, f.decode_time, f.inference_time) == (0.5, 0.5, 0.75, 1.25)
    assert f.e2e_latency == 2.0 and f.time_per_output_token == 0.375
    assert stats.time_to_first_tokens == [1.0] and stats.inter_token_latencies == [0.25, 0.5]
    assert stats.num_prompt_tokens == 7 and stats.num_generation_tokens == 3


def test_token_buckets_end_at_the_context() -> None:
    assert _token_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 2048]
    assert _token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_lora_requests_info_holds_the_current_adapters_and_counts_per_adapter() -> None:
    """vLLM's lora_requests_info: one series, its labels the running and waiting adapters (the
    previous series removed when they change); finished requests counted per adapter."""
    from llmserve.metrics.stats import LoRAStats

    stat_logger = PrometheusStatLogger("m", 64)

    def lora_step(running: tuple[str, ...], waiting: tuple[str, ...], finished: str | None = None):
        stats = IterationStats(1.0, SchedulerStats(2, 1, lora=LoRAStats(4, running, waiting)))
        if finished is not None:
            stats.observe_finished(SequenceTimes(0.0, 3, 8, 1, lora_name=finished), "stop", 1.0)
        stat_logger.record(stats)
        families = {f.name: f for f in text_string_to_metric_families(stat_logger.exposition()[0].decode())}
        info = [s.labels for s in families["llmserve:lora_requests_info"].samples]
        counts = {
            s.labels["lora_name"]: s.value
            for s in families["llmserve:lora_requests"].samples
            if s.name.endswith("_total")
        }
        return info, counts

    info, counts = lora_step(("sql",), ("chat", "math"))
    assert [(i["max_lora"], i["running_lora_adapters"], i["waiting_lora_adapters"]) for i in info] == [
        ("4", "sql", "chat,math")
    ]
    assert counts == {}
    info, counts = lora_step(("chat", "sql"), (), finished="sql")
    assert [(i["running_lora_adapters"], i["waiting_lora_adapters"]) for i in info] == [("chat,sql", "")]
    assert counts == {"sql": 1.0}
    stat_logger.set_idle()
    families = {f.name: f for f in text_string_to_metric_families(stat_logger.exposition()[0].decode())}
    assert not families["llmserve:lora_requests_info"].samples
