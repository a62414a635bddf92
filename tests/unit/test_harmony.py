"""gpt-oss's harmony replies on text: replies made by rendering messages through the model's own
chat template with transformers (the outside reference for the format) are split back into the
reasoning, content and calls they were made from, whole and streamed in any two pieces; cut
replies keep whole parts only; the parser is chosen by name or off the template; earlier turns'
calls and reasoning reach the template as it reads them; the `required` grammar accepts a call, writing the markers as the special tokens the vocabulary
has (llguidance's matcher over transformers' tokenizer the reference).

tests/data/gpt_oss_chat_template.jinja is the chat_template.jinja of openai/gpt-oss-20b
(Apache-2.0), byte for byte as TRL keeps it (trl/chat_templates/gptoss.jinja).
"""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import llguidance.hf
import pytest
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

from llmserve.config import ServerConfig
from llmserve.sampling_params import SamplingParams
from llmserve.server.protocol import ChatMessage
from llmserve.server.protocol_anthropic import CountTokensRequest
from llmserve.server.protocol_responses import parse_item
from llmserve.server.serving.anthropic import chat_messages as anthropic_messages
from llmserve.server.serving.chat import messages_to_dicts
from llmserve.server.serving.harmony import (
    HARMONY,
    HarmonyFormat,
    HarmonySplitter,
    harmony_on,
    parse_harmony,
    uses_channels,
)
from llmserve.server.serving.responses import chat_messages as responses_messages
from llmserve.server.serving.tools import FORMATS, plan_tools, with_tools
from llmserve.tokenizer.chat_template import ChatTemplate
from llmserve.tokenizer.hf_folder import load_hf_tokenizer
from tests.models.tiny import save_tiny_tokenizer
from tests.unit.test_tool_formats import _ByteTokenizer

TEMPLATE = (Path(__file__).parents[1] / "data" / "gpt_oss_chat_template.jinja").read_text()
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    }
]
USER = {"role": "user", "content": "Weather in Paris?"}
THINK = "The user wants the weather.\nI should call get_weather."
ARGS = {"city": "Paris", "unit": "c"}


def render(messages: list[dict], add_generation_prompt: bool) -> str:
    return render_jinja_template(
        [messages], tools=TOOLS, chat_template=TEMPLATE, add_generation_prompt=add_generation_prompt
    )[0][0]


def reply_of(messages: list[dict], until: str | None = None) -> str:
    """What the model wrote after the generation prompt, in the template's own rendering of the
    conversation that continues with `messages`."""
    prompt = render([USER], add_generation_prompt=True)
    whole = render([USER, *messages], add_generation_prompt=False)
    assert prompt.endswith("<|start|>assistant") and whole.startswith(prompt)
    reply = whole[len(prompt) :]
    return reply[: reply.index(until)] if until else reply


FINAL = reply_of([{"role": "assistant", "thinking": THINK, "content": "It is sunny."}])
CALL = reply_of(
    [
        {"role": "assistant", "thinking": THINK, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "content": "sunny"},
    ],
    until="<|start|>functions.",
)  # fmt: skip
# as the model writes a call: the recipient after the channel, the content type constrained
MODEL_CALL = (
    f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>commentary "
    f"to=functions.get_weather <|constrain|>json<|message|>{json.dumps(ARGS)}<|call|>"
)
PREAMBLE = (
    "<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant<|channel|>commentary "
    f"to=functions.get_weather <|constrain|>json<|message|>{json.dumps(ARGS)}"
)


def test_the_templates_replies_have_the_expected_shape() -> None:
    # the reference says what the parser must read: the channels, the recipient in the header
    assert (
        f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    ) == FINAL
    assert (
        f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant to=functions.get_weather"
        f"<|channel|>commentary json<|message|>{json.dumps(ARGS)}<|call|>"
    ) == CALL


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "calls"),
    [
        (FINAL, THINK, "It is sunny.", []),
        (FINAL.removesuffix("<|return|>"), THINK, "It is sunny.", []),  # <|return|> ended it as EOS
        (CALL, THINK, None, [("get_weather", ARGS)]),
        (CALL.removesuffix("<|call|>"), THINK, None, [("get_weather", ARGS)]),
        (MODEL_CALL, THINK, None, [("get_weather", ARGS)]),
        (
            PREAMBLE,
            None,
            "Checking the weather.",
            [("get_weather", ARGS)],
        ),  # commentary without recipient: content
        (
            MODEL_CALL + "<|start|>assistant" + MODEL_CALL.split("<|start|>assistant")[1],
            THINK,
            None,
            [("get_weather", ARGS)] * 2,
        ),
        (
            "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
            "<|start|>assistant<|channel|>final<|message|>c",
            "a\nb",
            "c",
            [],
        ),
        (
            "<|channel|>analysis<|message|>look<|end|><|start|>assistant<|channel|>commentary to=browser.search "
            '<|constrain|>json<|message|>{"query": "x"}<|call|>',
            'look\n{"query": "x"}',
            None,
            [],
        ),
        ("Just text, no channels.", None, "Just text, no channels.", []),
    ],
)
def test_whole_replies(text, reasoning, content, calls) -> None:
    got_reasoning, got_content, got_calls = parse_harmony(text)
    assert (got_reasoning, got_content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


def _streamed(pieces: list[str], cut: bool = False, calls: bool = True) -> tuple[str, str, list]:
    splitter = HarmonySplitter(calls)
    reasoning = content = ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c, found = splitter.finish(cut)
    return reasoning + r, content + c, [(x.name, x.arguments) for x in found]


@pytest.mark.parametrize("text", [FINAL, CALL, MODEL_CALL, PREAMBLE, FINAL[:-20], "plain text"])
@pytest.mark.parametrize("cut", [False, True])
def test_streamed_in_any_two_pieces_equals_whole(text, cut) -> None:
    reasoning, content, calls = parse_harmony(text, cut)
    want = (reasoning or "", content or "", [(c.name, c.arguments) for c in calls])
    for i in range(len(text) + 1):
        assert _streamed([text[:i], text[i:]], cut) == want, i
    assert _streamed(list(text), cut) == want


@pytest.mark.parametrize(
    "text", [CALL, MODEL_CALL, PREAMBLE, MODEL_CALL + MODEL_CALL.replace("Paris", "Oslo")]
)
def test_calls_stream_as_deltas_that_join_to_the_parsed_calls(text) -> None:
    """Fed a character at a time: each call opens (id, name) when its header is read, its body
    goes out while it is written, and the deltas join to the parsed calls' arguments; a call cut
    after it opened is unfinished (the stream then ends as cut)."""
    _, _, calls = parse_harmony(text)
    splitter, steps = HarmonySplitter(), []
    for ch in text:
        splitter.feed(ch)
        steps.append(splitter.call_deltas())
    _, _, found = splitter.finish()
    steps.append(splitter.final_call_deltas(found))
    joined: dict[int, list[str]] = {}
    for d in (d for step in steps for d in step):
        entry = joined.setdefault(d.index, [d.name, ""])
        assert (d.id is not None) == (entry[1] == "" and d.arguments == "")  # opened once, empty
        entry[1] += d.arguments
    assert [tuple(v) for _, v in sorted(joined.items())] == [(c.name, c.arguments) for c in calls]
    assert not splitter.streamed_unfinished
    assert sum(1 for step in steps[:-1] for d in step if d.arguments) > 5  # the body streamed
    cut = HarmonySplitter()
    cut.feed(MODEL_CALL[: MODEL_CALL.index('"Paris"') + 3])
    deltas = cut.call_deltas()
    assert deltas[0].name == "get_weather" and "".join(d.arguments for d in deltas) == '{"city": "Pa'
    _, _, found = cut.finish(cut=True)
    assert found == [] and cut.final_call_deltas(found) == [] and cut.streamed_unfinished


def test_reasoning_streams_before_the_reply_ends() -> None:
    splitter = HarmonySplitter()
    assert splitter.feed("<|channel|>analysis<|mess") == ("", "")
    assert splitter.feed("age|>Thinking<|e") == ("Thinking", "")  # `<|e` may be `<|end|>`: held
    assert splitter.feed("nd|><|start|>assistant<|channel|>final<|message|>Hi") == ("", "Hi")


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        (
            "<|channel|>analysis<|message|>Still thin",
            "Still thin",
            None,
        ),  # cut while thinking: reasoning only
        ("<|channel|>analysis<|message|>Done<|e", "Done", None),  # a terminator's start, cut
        (f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>fin", THINK, None),
        (FINAL[: FINAL.index("sunny")], THINK, "It is "),
    ],
)
def test_cut_replies_keep_their_whole_parts(text, reasoning, content) -> None:
    assert parse_harmony(text, cut=True) == (reasoning, content, [])


def test_a_cut_call_is_dropped_and_a_whole_one_kept() -> None:
    half = MODEL_CALL[: MODEL_CALL.index('"Paris"')]
    assert parse_harmony(half, cut=True) == (THINK, None, [])
    assert parse_harmony(MODEL_CALL[: MODEL_CALL.index("<|message|>{")], cut=True) == (THINK, None, [])
    _, _, calls = parse_harmony(MODEL_CALL + "<|start|>assistant<|channel|>commentary to=func", cut=True)
    assert [c.name for c in calls] == ["get_weather"]


def test_without_tools_a_call_is_content() -> None:
    assert parse_harmony(MODEL_CALL, calls=False) == (THINK, json.dumps(ARGS), [])


def test_selected_by_name_or_off_the_template() -> None:
    assert uses_channels(TEMPLATE) and not uses_channels("{{ messages }}<think>")
    assert harmony_on("auto", "auto", TEMPLATE) and not harmony_on("auto", "auto", "<think>")
    assert harmony_on("openai_gptoss", "auto", None) and harmony_on("none", "openai", None)
    assert not harmony_on("none", "auto", TEMPLATE)  # the reasoning parser turned off: the raw text
    ServerConfig(reasoning_parser="openai_gptoss", tool_call_parser="openai")
    for rp, tp in (("openai_gptoss", "hermes"), ("think", "openai")):
        with pytest.raises(ValueError, match="read the same harmony reply"):
            ServerConfig(reasoning_parser=rp, tool_call_parser=tp)


def test_harmony_keeps_special_tokens_with_or_without_tools() -> None:
    params = SamplingParams(max_tokens=8)
    for tools in (TOOLS, None):
        plan = plan_tools(tools, None, None, HARMONY)
        assert with_tools(params, plan).skip_special_tokens is False
    assert with_tools(params, plan_tools(None, None, None, FORMATS["mistral"])).skip_special_tokens is True


def test_earlier_turns_render_as_the_template_reads_them() -> None:
    """An assistant turn as the OpenAI client sends it back (arguments as JSON text, the reasoning
    as reasoning_content) renders exactly as the template's own form of it (arguments an object,
    the reasoning as `thinking`)."""
    sent = [
        ChatMessage(role="user", content=USER["content"]),
        ChatMessage(role="assistant", reasoning_content=THINK, tool_calls=[
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]),
        ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
    ]  # fmt: skip
    reference = [
        USER,
        {"role": "assistant", "thinking": THINK, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "content": "sunny"},
    ]  # fmt: skip
    ours = ChatTemplate(TEMPLATE, {}).render(messages_to_dicts(sent), True, tools=TOOLS)
    assert ours == render(reference, add_generation_prompt=True)
    assert f"<|channel|>analysis<|message|>{THINK}<|end|>" in ours and json.dumps(ARGS) + "<|call|>" in ours


def test_required_grammar_accepts_a_call_the_parser_reads() -> None:
    grammar = HARMONY.grammar(TOOLS, parallel=True)
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    lark = llguidance.LLMatcher.grammar_from_lark(grammar)
    assert llguidance.LLMatcher.validate_grammar(lark, tokenizer) == ""
    # the JSON compact as the grammar writes it, which is json.dumps' default spacing
    compact = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{json.dumps(ARGS)}<|call|>"

    def accepts(s: str) -> bool:
        m = llguidance.LLMatcher(tokenizer, lark)
        return m.consume_tokens(list(s.encode())) and m.is_accepting() and not m.is_error()

    assert accepts(compact) and accepts(compact + "<|start|>assistant" + compact)
    assert not accepts(compact.replace("get_weather", "get_time"))
    assert [c.name for c in parse_harmony(compact)[2]] == ["get_weather"]


def test_past_reasoning_from_the_other_apis_reaches_the_turn_it_preceded() -> None:
    """A Responses reasoning item goes to the assistant turn after it (the function call it led
    to), an Anthropic thinking block to its own assistant message: both as reasoning_content."""
    items = [
        parse_item({"role": "user", "content": "Weather in Paris?"}, "input.0"),
        parse_item({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THINK}]}, "input.1"),
        parse_item({"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": json.dumps(ARGS)}, "input.2"),
        parse_item({"type": "function_call_output", "call_id": "c1", "output": "sunny"}, "input.3"),
    ]  # fmt: skip
    messages, _ = responses_messages(None, items)
    assert [(m.role, m.reasoning_content) for m in messages] == [
        ("user", None),
        ("assistant", THINK),
        ("tool", None),
    ]
    req = CountTokensRequest.model_validate({"model": "m", "messages": [
        USER,
        {"role": "assistant", "content": [{"type": "thinking", "thinking": THINK, "signature": ""},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather", "input": ARGS}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
    ]})  # fmt: skip
    messages, _ = anthropic_messages(req)
    assert [(m.role, m.reasoning_content) for m in messages] == [
        ("user", None),
        ("assistant", THINK),
        ("tool", None),
    ]


MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
CALL_ID = 511  # the last of MARKERS, the last id of the tiny vocabulary
COMPACT = (
    f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{json.dumps(ARGS)}<|call|>"
)


def tiny_vocabulary(
    folder: Path, special: tuple[str, ...], eos: list[int]
) -> tuple[HarmonyFormat, transformers.PreTrainedTokenizerBase]:
    """Our format for a tiny vocabulary with `special` tokens and EOS ids `eos`, and transformers'
    reading of that vocabulary (the reference)."""
    save_tiny_tokenizer(folder, special=special)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    fmt = HarmonyFormat.for_tokenizer(load_hf_tokenizer(folder, "tiny"))
    return fmt, transformers.AutoTokenizer.from_pretrained(folder)


def reference_matcher(
    hf: transformers.PreTrainedTokenizerBase, eos: list[int], grammar: str
) -> llguidance.LLMatcher:
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=512, eos_token=eos)
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def test_the_grammar_names_the_markers_that_are_special_tokens(tmp_path: Path) -> None:
    """gpt-oss's markers are special tokens: the grammar names them, and llguidance's matcher takes
    the call written with the special ids (as transformers encodes it) and refuses it spelled in
    text pieces."""
    fmt, hf = tiny_vocabulary(tmp_path, MARKERS, [0])
    assert fmt.special_tokens == {"<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"}
    assert not fmt.end_tokens
    grammar = fmt.grammar(TOOLS, parallel=False)
    assert (
        '<|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> %json' in grammar
    )
    assert grammar.endswith(" <|call|>") and '"<|' not in grammar
    as_tokens = hf.encode(COMPACT, add_special_tokens=False)
    assert {508, 509, 507, CALL_ID} <= set(as_tokens)  # <|channel|>, <|constrain|>, <|message|>, <|call|>
    matcher = reference_matcher(hf, [0], grammar)
    assert matcher.try_consume_tokens(as_tokens) == len(as_tokens) and matcher.is_accepting()
    as_text = hf.encode(COMPACT, add_special_tokens=False, split_special_tokens=True)
    assert reference_matcher(hf, [0], grammar).try_consume_tokens(as_text) == 0
    assert [c.name for c in parse_harmony(hf.decode(as_tokens))[2]] == ["get_weather"]


def test_a_vocabulary_without_the_markers_gets_them_as_text(tmp_path: Path) -> None:
    fmt, hf = tiny_vocabulary(tmp_path, (), [0])
    assert not fmt.special_tokens and fmt.grammar(TOOLS, True) == HARMONY.grammar(TOOLS, True)
    grammar = fmt.grammar(TOOLS, parallel=False)
    assert '"<|channel|>" "commentary to=functions.get_weather " "<|constrain|>"' in grammar
    as_text = hf.encode(COMPACT, add_special_tokens=False)
    matcher = reference_matcher(hf, [0], grammar)
    assert matcher.try_consume_tokens(as_text) == len(as_text) and matcher.is_accepting()


def test_an_end_of_sequence_call_marker_is_left_to_the_stop(tmp_path: Path) -> None:
    """gpt-oss's `<|call|>` is one of its EOS ids: llguidance refuses an EOS id the grammar names,
    so the grammar ends with the arguments, where EOS ids (`<|call|>` among them) are allowed."""
    fmt, hf = tiny_vocabulary(tmp_path, MARKERS, [0, CALL_ID])
    assert fmt.end_tokens == {"<|call|>"}
    grammar = fmt.grammar(TOOLS, parallel=True)
    assert "<|call|>" not in grammar and '(<|start|> "assistant" call)*' in grammar
    named = HarmonyFormat(fmt.special_tokens).grammar(TOOLS, parallel=False)  # <|call|> named: refused
    as_tokens = hf.encode(COMPACT, add_special_tokens=False)
    refused = reference_matcher(hf, [0, CALL_ID], named)
    assert refused.try_consume_tokens(as_tokens) == len(as_tokens) - 1 and not refused.is_accepting()
    matcher = reference_matcher(hf, [0, CALL_ID], grammar)
    assert matcher.try_consume_tokens(as_tokens[:-1]) == len(as_tokens) - 1 and matcher.is_accepting()
    assert matcher.try_consume_tokens([CALL_ID]) == 1 and matcher.is_stopped()
    reply = hf.decode(as_tokens[:-1])  # the engine stops on the EOS id, which the text leaves out
    assert [(c.name, json.loads(c.arguments)) for c in parse_harmony(reply)[2]] == [("get_weather", ARGS)]
