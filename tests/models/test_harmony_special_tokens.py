"""gpt-oss's forced tool call on the engine, over a tiny random Llama whose vocabulary has harmony's
markers as special tokens and `<|call|>` among its EOS ids, as gpt-oss's generation config has it:
the grammar of `tool_choice: required` makes the reply write the markers as their special ids, the
engine stops at an EOS id once the arguments are complete, and the parser reads the call from the
text (special tokens kept). The outside reference is llguidance's own matcher over transformers'
tokenizer: every sampled token is one it accepts."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
import transformers

from llmserve import LLM, SamplingParams
from llmserve.server.serving.harmony import HarmonyFormat, parse_harmony
from llmserve.server.serving.tools import plan_tools, with_tools
from tests.models.tiny import make_tiny_model_eos0

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
START, MESSAGE, CHANNEL, CONSTRAIN, CALL = 505, 507, 508, 509, 511
EOS = [0, CALL]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
PROMPT = [5, 17, 99, 42, START, 3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony-special")
    make_tiny_model_eos0(path, MARKERS)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": None}))
    return path


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), num_kv_blocks=256, block_size=4, show_progress=False)


@pytest.mark.parametrize("seed", [None, 0, 5], ids=["greedy", "seed0", "seed5"])
def test_a_required_call_writes_special_markers_and_stops_at_eos(llm, folder, seed):
    fmt = HarmonyFormat.for_tokenizer(llm.get_tokenizer())
    assert fmt.end_tokens == {"<|call|>"} and "<|call|>" not in fmt.grammar(TOOLS, True)
    plan = plan_tools(TOOLS, "required", False, fmt)  # one call: else a random model may go on calling
    params = with_tools(
        SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=120), plan
    )
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in EOS, out
    assert out.token_ids[0] == CHANNEL and {CONSTRAIN, MESSAGE} <= set(out.token_ids)
    _, content, calls = parse_harmony(out.text)
    assert content is None and calls and {c.name for c in calls} == {"get_weather"}
    assert all(set(json.loads(c.arguments)) == {"city", "unit"} for c in calls)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    reference = llguidance.hf.from_tokenizer(hf, n_vocab=512, eos_token=EOS)
    matcher = llguidance.LLMatcher(reference, plan.constraint.grammar, log_level=0)
    assert matcher.try_consume_tokens(out.token_ids[:-1]) == len(out.token_ids) - 1 and matcher.is_accepting()
