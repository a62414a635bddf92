"""`AsyncEngine` on a tiny real model: streamed deltas add up to the offline result, aborts free
blocks at once, the waiting queue is bounded, a failing step fails every stream."""

from __future__ import annotations

import asyncio

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from tests.models.tiny import make_tiny_model

PROMPTS = ["The quick brown fox", "0123", "naïve café over the lazy dog"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("async-llama")
    make_tiny_model("llama", folder)
    return folder


def make_engine(folder, **kw):
    return LLM(str(folder), show_progress=False, num_kv_blocks=64, block_size=4, **kw).engine


async def collect(engine: AsyncEngine, prompt: str, params: SamplingParams, final_only: bool = False):
    processed = await engine.process_inputs(prompt, params)
    stream = engine.add_request(engine.new_request_id(), processed, final_only=final_only)
    texts, tokens, deltas = {}, {}, 0
    async with stream:
        async for out in stream:
            deltas += 1
            for c in out.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text
                tokens.setdefault(c.index, []).extend(c.token_ids)
    return texts, tokens, deltas


@pytest.mark.parametrize("final_only", [False, True], ids=["deltas", "final only"])
def test_streamed_deltas_add_up_to_the_offline_outputs(folder, final_only):
    """Every step's delta, or (`final_only`, a response sent whole) one output when the request
    finishes: either way the offline result."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, n=2, stop=["o"])
    offline = LLM(str(folder), show_progress=False, num_kv_blocks=64, block_size=4).generate(
        PROMPTS, params, use_tqdm=False
    )

    async def main():
        engine = AsyncEngine(make_engine(folder))
        engine.start()
        try:
            return await asyncio.gather(*(collect(engine, p, params, final_only) for p in PROMPTS))
        finally:
            engine.shutdown()

    for (texts, tokens, deltas), ref in zip(asyncio.run(main()), offline, strict=True):
        assert [texts[i] for i in range(2)] == [c.text for c in ref.outputs]
        assert [tokens[i] for i in range(2)] == [c.token_ids for c in ref.outputs]
        if final_only:
            assert deltas == 1
        else:
            assert deltas > 1  # it streamed, not one final answer


@pytest.mark.parametrize("interval", [1, 4])
def test_a_stream_interval_groups_tokens_and_changes_none(folder, interval):
    """`stream_interval` N: the first token at once, then every N tokens, then the end; the same
    tokens and text as the offline run. (A reader that falls behind gets deltas merged, so the
    token counts at the deltas' ends are checked against the interval's marks, not one by one.)"""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=13, ignore_eos=True, logprobs=1)
    offline = LLM(str(folder), show_progress=False, num_kv_blocks=64, block_size=4).generate(
        PROMPTS, params, use_tqdm=False
    )

    async def read(engine: AsyncEngine, prompt: str) -> tuple[str, list[int], list[int], int]:
        stream = engine.add_request(engine.new_request_id(), await engine.process_inputs(prompt, params))
        text, tokens, ends, logprobs = "", [], [], 0
        async with stream:
            async for out in stream:
                c = out.outputs[0]
                text, tokens = text + c.text, tokens + c.token_ids
                logprobs += len(c.logprobs or [])
                if c.token_ids:
                    ends.append(len(tokens))
        return text, tokens, ends, logprobs

    async def main():
        engine = AsyncEngine(make_engine(folder, stream_interval=interval))
        engine.start()
        try:
            return await asyncio.gather(*(read(engine, p) for p in PROMPTS))
        finally:
            engine.shutdown()

    marks = {1, *range(1 + interval, 14, interval), 13}
    for (text, tokens, ends, logprobs), ref in zip(asyncio.run(main()), offline, strict=True):
        assert text == ref.outputs[0].text and tokens == ref.outputs[0].token_ids and logprobs == 13
        assert set(ends) <= marks and ends[-1] == 13, ends


def test_abort_frees_blocks_within_a_step(folder):
    async def main():
        llm_engine = make_engine(folder)
        engine = AsyncEngine(llm_engine)
        engine.start()
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            stream = engine.add_request("long", await engine.process_inputs("The quick brown fox", params))
            async with stream:
                async for _ in stream:
                    break  # the client goes away after its first token
            for _ in range(100):
                if engine.snapshot.kv_blocks_used == 0 and engine.snapshot.num_running == 0:
                    break
                await asyncio.sleep(0.02)
            assert engine.snapshot.kv_blocks_used == 0
            assert engine.num_active == 0
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_waiting_queue_is_bounded(folder):
    async def main():
        engine = AsyncEngine(make_engine(folder, max_num_seqs=1), max_queued_requests=1)
        engine.start()
        try:
            params = SamplingParams(max_tokens=100, ignore_eos=True)
            prompt = await engine.process_inputs("The quick", params)
            running = engine.add_request("a", prompt)
            async with running:
                async for _ in running:
                    break  # "a" holds the only slot
                waiting = engine.add_request("b", prompt)
                with pytest.raises(QueueFullError) as e:
                    engine.add_request("c", prompt)
                assert e.value.retry_after >= 1
                waiting.abort()
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_failing_step_fails_every_stream(folder):
    async def main():
        llm_engine = make_engine(folder)

        def broken_step():
            raise RuntimeError("boom")

        llm_engine.step = broken_step
        engine = AsyncEngine(llm_engine)
        engine.start()
        try:
            stream = engine.add_request("x", await engine.process_inputs("The", SamplingParams()))
            with pytest.raises(EngineDeadError, match="boom"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                engine.check_queue()
        finally:
            engine.shutdown()

    asyncio.run(main())
