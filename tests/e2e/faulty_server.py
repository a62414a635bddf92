"""`llmserve serve` whose engine step raises after $LLMSERVE_TEST_FAULT_AFTER_STEPS steps: a fault
injected from outside the package, for the engine-failure test (test_engine_failure.py)."""

from __future__ import annotations

import os
import sys

from llmserve.cli.main import main
from llmserve.engine.llm_engine import LLMEngine

_real_step = LLMEngine.step
_budget = [int(os.environ["LLMSERVE_TEST_FAULT_AFTER_STEPS"])]


def _failing_step(self: LLMEngine):  # type: ignore[no-untyped-def]
    if _budget[0] <= 0:
        raise RuntimeError("injected fault: the step failed")
    _budget[0] -= 1
    return _real_step(self)


LLMEngine.step = _failing_step  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
