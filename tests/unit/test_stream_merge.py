"""A request stream whose reader fell behind: the deltas that wait are read as one (tokens, text
and logprobs joined in order, the last one's finish and metrics), an error after them still comes
after them, and a reader that keeps up gets every step's delta on its own."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.engine.async_engine import RequestStream, merge_deltas
from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput


def delta(step: int, finished: bool = False) -> RequestOutput:
    """Step `step`'s delta of a request with two samples, one token each, with logprobs."""
    outputs = [
        CompletionOutput(
            i,
            f"s{i}t{step} ",
            [100 * i + step],
            -0.5 * step,
            [{100 * i + step: (-0.5, 1)}],
            "length" if finished else None,
        )
        for i in range(2)
    ]
    prompt_logprobs = [None, {7: (-1.0, 1)}] if step == 0 else None
    return RequestOutput(
        "r", "p", [1, 7], outputs, finished, prompt_logprobs, 2, None, RequestMetrics(float(step))
    )


def test_merged_deltas_join_in_order() -> None:
    merged = merge_deltas(merge_deltas(delta(0), delta(1)), delta(2, finished=True))
    assert merged.finished and merged.prompt_logprobs == [None, {7: (-1.0, 1)}]
    assert merged.metrics is not None and merged.metrics.arrival_time == 2.0
    for i, c in enumerate(merged.outputs):
        assert c.index == i and c.text == f"s{i}t0 s{i}t1 s{i}t2 "
        assert c.token_ids == [100 * i, 100 * i + 1, 100 * i + 2]
        assert c.logprobs == [{100 * i + s: (-0.5, 1)} for s in range(3)]
        assert c.cumulative_logprob == -1.0 and c.finish_reason == "length"


class _Engine:
    def abort(self, request_id: str) -> None:
        pass


async def _read(stream: RequestStream) -> list[RequestOutput | BaseException]:
    got: list[RequestOutput | BaseException] = []
    try:
        async for out in stream:
            got.append(out)
    except RuntimeError as e:
        got.append(e)
    return got


def test_a_reader_behind_gets_one_delta_and_then_the_error() -> None:
    async def main() -> list:
        stream = RequestStream(_Engine(), "r", None)  # type: ignore[arg-type]
        for step in range(3):
            stream._put(delta(step))
        stream._put(RuntimeError("engine died"))
        return await _read(stream)

    first, error = asyncio.run(main())
    assert isinstance(first, RequestOutput) and first.outputs[0].token_ids == [0, 1, 2]
    assert isinstance(error, RuntimeError)


def test_a_reader_that_keeps_up_gets_every_step() -> None:
    async def main() -> list:
        stream = RequestStream(_Engine(), "r", None)  # type: ignore[arg-type]

        async def produce() -> None:
            for step in range(4):
                stream._put(delta(step, finished=step == 3))
                await asyncio.sleep(0.01)

        reader = asyncio.create_task(_read(stream))
        await produce()
        return await reader

    got = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in got] == [[0], [1], [2], [3]] and got[-1].finished


@pytest.mark.parametrize("after", [1, 2])
def test_nothing_is_read_past_the_finished_delta(after: int) -> None:
    async def main() -> list:
        stream = RequestStream(_Engine(), "r", None)  # type: ignore[arg-type]
        for step in range(after):
            stream._put(delta(step))
        stream._put(delta(after, finished=True))
        return await _read(stream)

    (only,) = asyncio.run(main())
    assert only.finished and only.outputs[1].token_ids == [100 + s for s in range(after + 1)]
