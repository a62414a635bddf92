"""Cost of the metrics: gathering a step's statistics (engine thread) and recording them into the
Prometheus and log-line loggers (event loop), for a synthetic step of `--batch` decoding requests
of which `--finished` finish.

    python benchmarks/bench_metrics.py [--batch 64] [--finished 2] [--steps 2000]

Prints microseconds per step for each side; compare with a decode step (20-200 ms on this CPU).
"""

from __future__ import annotations

import argparse
import time

from llmserve.core.scheduler import SchedulerStats
from llmserve.metrics.loggers import LoggingStatLogger
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.metrics.stats import IterationStats, SequenceTimes


def one_step(batch: int, finished: int) -> IterationStats:
    stats = IterationStats(0.35, SchedulerStats(batch, 3, 0.4, 0, 1000, 100, batch))
    for _ in range(batch):
        stats.observe_tokens(SequenceTimes(0.0, 128, 128, 1, 0.1, 0.2, 0.3, 5), 1, 0.35)
    for _ in range(finished):
        stats.observe_finished(SequenceTimes(0.0, 128, 128, 1, 0.1, 0.2, 0.3, 128), "length", 0.4)
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--finished", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    start = time.perf_counter()
    steps = [one_step(args.batch, args.finished) for _ in range(args.steps)]
    gather = (time.perf_counter() - start) / args.steps
    loggers = [PrometheusStatLogger("bench", 8192), LoggingStatLogger()]
    start = time.perf_counter()
    for stats in steps:
        for stat_logger in loggers:
            stat_logger.record(stats)
    record = (time.perf_counter() - start) / args.steps
    print(
        f"batch {args.batch}, {args.finished} finishing: gather {gather * 1e6:.0f} us/step (engine thread), "
        f"record {record * 1e6:.0f} us/step (event loop)"
    )


if __name__ == "__main__":
    main()
