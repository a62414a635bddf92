"""`llmserve serve` whose engine steps each sleep $LLMSERVE_TEST_STEP_DELAY seconds first: a slow
upstream, so a test can disconnect while a stream is surely still running (test_models.py)."""

from __future__ import annotations

import os
import sys
import time

from llmserve.cli.main import main
from llmserve.engine.llm_engine import LLMEngine

_real_step = LLMEngine.step
_delay = float(os.environ["LLMSERVE_TEST_STEP_DELAY"])


def _slow_step(self: LLMEngine):  # type: ignore[no-untyped-def]
    time.sleep(_delay)
    return _real_step(self)


LLMEngine.step = _slow_step  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
