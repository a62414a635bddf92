"""Structured outputs in the engine, on a tiny random Llama (whose unconstrained text is noise, so
only the grammar can make it valid): JSON schemas validated by `jsonschema`, regexes matched in
full, choices, Lark and GBNF grammars; sampled and greedy, batched beside unconstrained requests,
through preemption, with n > 1; bad constraints refused before anything is queued."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from llmserve import LLM, SamplingParams, StructuredOutputsParams
from llmserve.errors import ParameterError
from tests.models.tiny import make_tiny_model_eos0 as make_model

PROMPT = [5, 17, 99, 3, 42]
SHORT = {"type": "string", "maxLength": 6}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": SHORT}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}}, "required": ["ok", "none"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"]},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "minItems": 2, "maxItems": 4}}, "required": ["xs"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer",
     "minimum": -5, "maximum": 5}, "y": SHORT}, "required": ["x", "y"]}}, "required": ["inner"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["p"]},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                       {"enum": ["none"]}]}}, "required": ["id"]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["x"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a", "b"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["s"],
     "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0,
     "maximum": 4}, "name": SHORT}, "required": ["kind", "legs", "name"]},
    {"type": "object", "properties": {"m": {"type": "array", "items": {"type": "array", "items": {"enum": [0, 1]},
     "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}, "required": ["m"]},
    {"type": "object", "properties": {"when": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["when"]},
    {"type": "object", "properties": {"ip": {"type": "string", "pattern": "^[0-9]{1,3}(\\.[0-9]{1,3}){3}$"}},
     "required": ["ip"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"]},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "note": {"anyOf": [SHORT, {"type": "null"}]}},
     "required": ["flag", "note"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties":
     {"c": {"enum": ["deep"]}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "v": {"type": "integer",
     "minimum": 0, "maximum": 3}}, "required": ["k", "v"]}, "minItems": 1, "maxItems": 3},
    {"type": "array", "prefixItems": [{"enum": ["head"]}, {"type": "integer", "minimum": 0, "maximum": 9}],
     "items": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1}, "label": SHORT},
     "required": ["score", "label"]},
    {"type": "object", "properties": {"opt": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": []},
    {"type": "object", "properties": {"one": {"oneOf": [{"type": "boolean"}, {"enum": ["n/a"]}]}}, "required": ["one"]},
    {"type": "object", "properties": {"empty": {"type": "array", "maxItems": 0}}, "required": ["empty"]},
    {"type": "object", "properties": {"u": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}},
     "required": ["u"]},
    {"type": "object", "properties": {"q": {"type": "string", "enum": ["it's", "say \"hi\"", "back\\slash"]}},
     "required": ["q"]},
    {"type": "object", "properties": {"uni": {"enum": ["café", "naïve", "日本"]}}, "required": ["uni"]},
    {"allOf": [{"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 3}},
                "required": ["x"]}]},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "string", "maxLength": 3},
    {"type": "number", "minimum": 0, "maximum": 10},
    {"$defs": {"leaf": {"enum": ["L"]}, "pair": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "minItems": 2,
     "maxItems": 2}}, "type": "object", "properties": {"p": {"$ref": "#/$defs/pair"}}, "required": ["p"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 100, "maximum": 105},
     "m": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3}}, "required": ["n", "m"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 2}},
     "required": ["items"]},
]  # fmt: skip


def closed_schema(schema):
    """OpenAI's strict mode: objects list every key (additionalProperties false). An open object
    lets the grammar add keys of any length, which a random model's noise fills forever."""
    if isinstance(schema, dict):
        schema = {k: closed_schema(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed_schema(v) for v in schema]
    return schema


SCHEMAS = [closed_schema(s) for s in SCHEMAS]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("so-llama")
    make_model(folder)
    return LLM(str(folder), num_kv_blocks=256, block_size=4, show_progress=False)


def constrained(seed: int | None = 0, max_tokens: int = 200, **kw) -> SamplingParams:
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**kw),
    )


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_json_schema_outputs_validate(llm, schema):
    """Sampled at temperature 1 with three seeds and greedily: every output parses and validates."""
    for seed in (0, 1, 2, None):
        out = llm.generate(PROMPT, constrained(seed, json=schema), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop", (seed, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_and_grammars(llm):
    cases = [
        ({"regex": r"[a-c]{2,5}-\d{3}"}, lambda t: re.fullmatch(r"[a-c]{2,5}-\d{3}", t)),
        ({"choice": ["alpha", "beta gamma", 'quo"te']}, lambda t: t in ("alpha", "beta gamma", 'quo"te')),
        (
            {"grammar": 'start: "(" num ("," num)* ")"\nnum: /[0-9]/'},
            lambda t: re.fullmatch(r"\(\d(,\d)*\)", t),
        ),
        ({"grammar": 'root ::= "x" ("y" | "z")+ "!"'}, lambda t: re.fullmatch(r"x[yz]+!", t)),  # GBNF
    ]
    for kw, ok in cases:
        for seed in (0, 1, None):
            out = llm.generate(PROMPT, constrained(seed, max_tokens=60, **kw), use_tqdm=False)[0].outputs[0]
            assert ok(out.text) and out.finish_reason == "stop", (kw, seed, out.text)


def test_constrained_and_free_requests_share_a_batch(llm):
    """A free request batched with constrained ones gives its unbatched tokens; n > 1 samples each
    follow the grammar; grammar states survive preemption (a cache too small for all of them)."""
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPT, free, use_tqdm=False)[0].outputs[0].token_ids
    schema = SCHEMAS[16]
    batch = [PROMPT, [1, 2, 3], PROMPT, [7, 8]]
    params = [
        free,
        constrained(3, json=schema),
        constrained(None, regex=r"\d{4}"),
        constrained(4, json=schema),
    ]
    outs = llm.generate(batch, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(outs[1].outputs[0].text), schema)
    assert re.fullmatch(r"\d{4}", outs[2].outputs[0].text)
    jsonschema.validate(json.loads(outs[3].outputs[0].text), schema)
    many = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=100,
                          structured_outputs=StructuredOutputsParams(json=schema))  # fmt: skip
    texts = [c.text for c in llm.generate(PROMPT, many, use_tqdm=False)[0].outputs]
    for t in texts:
        jsonschema.validate(json.loads(t), schema)
    assert len(set(texts)) > 1


def test_grammar_state_survives_preemption(tmp_path):
    make_model(tmp_path)
    small = LLM(str(tmp_path), num_kv_blocks=24, block_size=4, max_num_seqs=8, show_progress=False)
    schema = SCHEMAS[5]
    params = [constrained(i, json=schema, max_tokens=60) for i in range(8)]
    outs = small.generate([PROMPT] * 8, params, use_tqdm=False)
    assert small.engine.scheduler.stats().num_preemptions > 0, "the cache was large enough: no preemption"
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "invalid structured_outputs.json"),
     ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
     ({"regex": "(unclosed"}, "invalid structured_outputs.regex"),
     ({"grammar": "start: undefined_rule"}, "invalid structured_outputs.grammar"),
     ({"grammar": "root ::= (("}, "structured_outputs.grammar")],
)  # fmt: skip
def test_invalid_constraints_are_refused_before_queuing(llm, kw, match):
    with pytest.raises(ParameterError, match=match) as e:
        llm.generate(PROMPT, constrained(0, **kw), use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kw",
    [{}, {"json": {}, "regex": "a"}, {"regex": ""}, {"choice": []}, {"choice": ["a", ""]}, {"json": 5},
     {"grammar": 3}],
)  # fmt: skip
def test_malformed_params_are_refused(kw):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kw)


def test_equal_constraints_share_one_compiled_grammar(llm):
    manager = llm.engine.structured_outputs
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert a.cache_key() == b.cache_key()
    assert manager.compile(a) is manager.compile(b)


def test_masks_beside_the_forward_pass_give_the_same_outputs(llm):
    """Masks computed on the worker thread during the forward pass (where a core is free) and
    after it (this 2-core machine's default) constrain a mixed batch to the same tokens."""
    runner = llm.engine.runner
    prompts = [PROMPT, "Another prompt", "Free text"]
    params = [
        constrained(1, json=SCHEMAS[3]),
        constrained(2, regex=r"[a-z]{3,8}"),
        SamplingParams(seed=3, max_tokens=12),
    ]

    def run() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    default = runner.overlap_masks
    try:
        runner.overlap_masks = True
        beside = run()
        assert runner._masks is not None  # the worker thread made them
        runner.overlap_masks = False
        after = run()
    finally:
        runner.overlap_masks = default
    assert beside == after
    jsonschema.validate(json.loads(llm.get_tokenizer().decode(beside[0])), SCHEMAS[3])


def test_states_are_copies_of_the_compiled_matcher(llm):
    """Each request advances its own copy; the cached matcher stays at the grammar's start."""
    manager = llm.engine.structured_outputs
    params = StructuredOutputsParams(choice=["yes", "no"])
    one, two = manager.new_state(params), manager.new_state(params)
    one.accept_all(llm.get_tokenizer().encode("yes", add_special_tokens=False))
    assert one.is_finished or not one.matcher.is_error()
    assert two.matcher.get_error() == "" and manager.compile(params).get_error() == ""
    assert manager.compile(params) is not one.matcher and manager.compile(params) is not two.matcher


def test_grammar_compilation_is_bounded(llm):
    """A constraint slower than the compile time limit, or larger than llguidance's limits, is a
    ParameterError naming the field; the manager keeps serving other constraints."""
    manager = llm.engine.structured_outputs
    big = StructuredOutputsParams(json={"enum": [f"value-{i}" for i in range(20000)]})  # ~0.1 s to compile
    limit = manager.compile_timeout
    manager.compile_timeout = 0.001
    try:
        with pytest.raises(ValueError, match="structured_outputs.json took longer than 0.001 s to compile"):
            manager.compile(big)
    finally:
        manager.compile_timeout = limit
    huge = StructuredOutputsParams(json={"enum": [f"value-{i}" for i in range(200000)]})
    with pytest.raises(ValueError, match="invalid structured_outputs.json: .*too big"):
        manager.compile(huge)
    assert manager.compile(StructuredOutputsParams(regex="[ab]{2}")).get_error() == ""


@pytest.mark.slow
def test_embedded_model_answers_in_json(tmp_path):
    """The real embedded model through its chat template: any JSON object, and a schema whose
    fields it fills with text of its own (greedy)."""
    real = LLM(show_progress=False)
    messages = [
        {"role": "user", "content": "Describe Paris as a JSON object with its country and population."}
    ]
    anything = SamplingParams(
        temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json_object=True)
    )
    out = real.chat(messages, anything, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["city", "country", "capital"],
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string"},
            "capital": {"type": "boolean"},
        },
    }
    out = real.chat(messages, SamplingParams(temperature=0, max_tokens=120,
                    structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)[0].outputs[0]  # fmt: skip
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    assert "paris" in value["city"].lower(), value
