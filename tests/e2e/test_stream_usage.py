"""Usage in streamed responses, through the `openai` client on the tiny model: vLLM's
`stream_options.continuous_usage_stats` puts the running usage on every chunk (prompt tokens,
completion tokens so far, their total), on completions and chat alike; with `include_usage` the
last chunk still carries the final usage, and the running count ends on it."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.e2e

# EOS ignored: every choice runs to max_tokens, so the final count is known
FIXED = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}


def stream(client: openai.OpenAI, chat: bool, options: dict, **kwargs) -> list:
    if chat:
        messages = [{"role": "user", "content": "Count with me"}]
        return list(client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True,
                                                   stream_options=options, **FIXED, **kwargs))  # fmt: skip
    return list(client.completions.create(model=MODEL_NAME, prompt=kwargs.pop("prompt", "Count with me"),
                                          stream=True, stream_options=options, **FIXED, **kwargs))  # fmt: skip


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_grows_to_the_final_usage(server: ServerProcess, chat: bool, n: int) -> None:
    """Each chunk's running count is the tokens shown so far, its own included (counted by their
    logprobs). How many tokens a chunk holds depends on load: a stream that falls behind the
    engine gets the waiting steps as one delta, as vLLM's does."""
    logprobs = {"logprobs": True} if chat else {"logprobs": 1}
    chunks = stream(
        server.client(), chat, {"include_usage": True, "continuous_usage_stats": True}, n=n, **logprobs
    )
    *running, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8 * n  # include_usage's own chunk
    assert running and all(c.choices and c.usage is not None for c in running)
    counts = [c.usage.completion_tokens for c in running]
    assert counts == sorted(counts) and counts[-1] == last.usage.completion_tokens
    shown = 0
    for c in running:
        lp = c.choices[0].logprobs
        shown += 0 if lp is None else len(lp.content or []) if chat else len(lp.tokens or [])
        assert c.usage.completion_tokens == shown
    for c in running:
        assert c.usage.prompt_tokens == last.usage.prompt_tokens > 0
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    if chat:  # the role chunk goes out before any token: nothing generated yet
        assert running[0].choices[0].delta.role == "assistant" and counts[0] == 0


def test_continuous_usage_on_several_prompts(server: ServerProcess) -> None:
    chunks = stream(server.client(), False, {"continuous_usage_stats": True}, prompt=["One", "Two three"])
    assert all(c.choices for c in chunks)  # no include_usage: no usage-only chunk at the end
    assert chunks[-1].usage.completion_tokens == 16
    whole = server.client().completions.create(model=MODEL_NAME, prompt=["One", "Two three"], **FIXED)
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_usage_is_null_on_chunks_unless_asked(server: ServerProcess, chat: bool) -> None:
    for options in ({"include_usage": True}, {"include_usage": False}):
        chunks = stream(server.client(), chat, options)
        with_choices = [c for c in chunks if c.choices]
        assert with_choices and all(c.usage is None for c in with_choices)
        assert (chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8) == options[
            "include_usage"
        ]
