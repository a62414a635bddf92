"""Stat loggers: what consumes each step's `IterationStats`.

StatLogger          the interface: record(stats), called on the event loop once per step
LoggingStatLogger   one INFO line every few seconds while the engine is busy
PrometheusStatLogger (metrics/prometheus.py) the /metrics counters, gauges and histograms
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from llmserve.metrics.stats import IterationStats, SpecDecodingStats

logger = logging.getLogger("llmserve")


class StatLogger(Protocol):
    def record(self, stats: IterationStats) -> None: ...


class LoggingStatLogger:
    """Logs running/waiting requests, KV-cache usage, the prefix-cache hit rate and prompt and
    generation throughput, every `interval` seconds while there is work, and once more when the
    engine falls idle (so the end of a burst is not lost)."""

    def __init__(self, interval: float = 5.0, clock=time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._last_log = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._cache_queries = 0  # cumulative values at the last line
        self._cache_hits = 0
        self._pending_queries = 0
        self._pending_hits = 0
        self._active = False  # something happened since the last line
        self._idle = True  # the next record opens a new busy period
        self._spec_last: SpecDecodingStats | None = None  # speculation's counts at the last line
        self._spec_now: SpecDecodingStats | None = None

    def record(self, stats: IterationStats) -> None:
        now = self._clock()
        if self._idle:  # measure a busy period from its first step's start, not from the last line
            self._last_log, self._idle = now - stats.step_seconds, False
        self._prompt_tokens += stats.num_prompt_tokens
        self._generation_tokens += stats.num_generation_tokens
        self._active |= bool(stats.num_prompt_tokens or stats.num_generation_tokens or stats.finished)
        sched = stats.scheduler
        if sched is None:
            return
        self._pending_queries, self._pending_hits = sched.prefix_cache_queries, sched.prefix_cache_hits
        self._spec_now = sched.spec
        idle = sched.num_running == 0 and sched.num_waiting == 0
        due = now - self._last_log >= self.interval
        if (due and (self._active or not idle)) or (idle and self._active):
            logger.info(self.format_line(stats, now - self._last_log))
            self._last_log = now
            self._prompt_tokens = self._generation_tokens = 0
            self._cache_queries, self._cache_hits = self._pending_queries, self._pending_hits
            self._spec_last = self._spec_now
            self._active = False
        self._idle = idle

    def format_line(self, stats: IterationStats, elapsed: float) -> str:
        sched = stats.scheduler
        assert sched is not None
        elapsed = max(elapsed, 1e-9)
        queries = self._pending_queries - self._cache_queries
        hits = self._pending_hits - self._cache_hits
        hit_rate = f"{100 * hits / queries:.1f}%" if queries else "-"
        line = (
            f"engine: {sched.num_running} running, {sched.num_waiting} waiting, "
            f"KV cache {100 * sched.kv_usage:.1f}% used, prefix-cache hit rate {hit_rate}, "
            f"prompt {self._prompt_tokens / elapsed:.1f} tok/s, "
            f"generation {self._generation_tokens / elapsed:.1f} tok/s"
        )
        spec, last = self._spec_now, self._spec_last
        if spec is not None:
            drafts = spec.num_drafts - (last.num_drafts if last else 0)
            proposed = spec.num_draft_tokens - (last.num_draft_tokens if last else 0)
            accepted = spec.num_accepted_tokens - (last.num_accepted_tokens if last else 0)
            if proposed:
                line += (
                    f", speculation: {100 * accepted / proposed:.1f}% of {proposed} proposed tokens accepted, "
                    f"{1 + accepted / drafts:.2f} tokens per verified draft"
                )
        return line
