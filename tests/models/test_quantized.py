"""Quantized models end to end: tiny random checkpoints loaded with `quantization` int8 / int4
against transformers running the same quantized weights (the checkpoint's weights quantized and
dequantized here, independently of the loader), the fused decode step against the layer-by-layer
path, GGUF files served quantized against the same files dequantized, and start-up errors."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from llmserve.config import ModelConfig
from llmserve.layers.attention import KVDtypes
from llmserve.layers.quantization import QuantizedLinear, cpu_kernels
from llmserve.layers.quantization.formats import PackedWeight, quantize
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.greedy import generate_greedy
from llmserve.model_executor.model_loader import load_model
from tests.gguf_writer import tiny_llama_gguf
from tests.models.tiny import TINY_CONFIGS, hf_greedy, make_tiny_model

_ORDER = ["avx512_vnni", "avx2", "torch"]
KERNEL_SETS = _ORDER[_ORDER.index(cpu_kernels.best_kernels()) :]  # every kernel set this CPU runs
PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 45, 67, 300, 12, 9, 8, 7, 6, 5, 4, 3, 2, 11, 400, 401, 402, 25], [42]]
LLAMA_FAMILY = [
    "llama",
    "llama3-rope-tied",
    "mistral-sliding",
    "qwen2",
    "qwen3",
    "phi3",
    "smollm3",
    "granite",
    "gemma3",  # sandwich norms, two RoPE bases, the tanh GELU
    "gemma2",  # soft-capped scores
    "olmo2",  # post-norm layers, q and k normed whole
    "exaone4",  # post-norm, per-head q/k norms, a NoPE global layer
    "starcoder2",  # LayerNorms with biases, a plain MLP, biases on every linear layer
]
MOE = ["mixtral", "qwen2-moe", "qwen3-moe", "granite-moe"]  # the fused decoder runs their experts too
_LINEAR = re.compile(r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|c_attn|c_proj|c_fc)\.weight$")
# transformers keeps a MoE layer's experts stacked in memory: [experts, out, in] (gate rows, then up)
_EXPERTS = re.compile(r"experts\.(gate_up_proj|down_proj)$")
_TABLE = re.compile(r"(embed_tokens|wte|lm_head)\.weight$")
# Activations are rounded to int16 per token inside each quantized matmul; over two tiny layers
# that moves logits (of magnitude ~1-10) by ~1e-4 at most.
TOL = 2e-3


def fake_quantize(
    state_dict: dict[str, torch.Tensor], method: str, input_major_experts: bool = False, gpt2: bool = False
) -> dict[str, torch.Tensor]:
    """The checkpoint as `method` stores it, dequantized: linear weights in q8 or q4 blocks along
    their input dimension, embedding and LM head tables in q8, everything else untouched.
    `input_major_experts`: stacked experts are [experts, in, out] (gpt-oss), not [experts, out, in];
    `gpt2`: GPT-2's Conv1D weights are [in, out] (StarCoder2's c_fc / c_proj are nn.Linear's)."""
    out = {}
    for name, w in state_dict.items():
        if _LINEAR.search(name) and w.dim() == 2:
            conv1d = gpt2 and name.split(".")[-2] in ("c_attn", "c_proj", "c_fc")
            rows = w.T if conv1d else w
            deq = quantize(rows, "q4" if method == "int4" else "q8").dequantize()
            out[name] = deq.T.contiguous() if conv1d else deq
        elif _EXPERTS.search(name):  # each expert's rows are blocks along `in`, as for any linear
            fmt = "q4" if method == "int4" else "q8"
            if input_major_experts:  # gpt-oss stacks [experts, in, out]
                out[name] = torch.stack([quantize(e.T, fmt).dequantize().T for e in w])
            else:
                out[name] = torch.stack([quantize(e, fmt).dequantize() for e in w])
        elif _TABLE.search(name):
            out[name] = quantize(w, "q8").dequantize()
        else:
            out[name] = w
    return out


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def arch(request):
    return request.param


@pytest.fixture(scope="module", params=["int8", "int4"])
def pair(request, arch, tmp_path_factory):
    """(transformers on the quantized weights, llmserve loading the float checkpoint quantized)."""
    folder = tmp_path_factory.mktemp(f"{arch}-{request.param}")
    hf = make_tiny_model(arch, folder)
    model_type = hf.config.model_type
    hf.load_state_dict(
        fake_quantize(hf.state_dict(), request.param, model_type == "gpt_oss", model_type == "gpt2")
    )
    ours = load_model(
        ModelConfig(
            model=str(folder), quantization=request.param, cpu_activations="int16", show_progress=False
        )
    )
    assert ours.quantization == request.param
    assert all(type(m).__name__ != "Linear" for m in ours.model.modules())  # every linear layer quantized
    return hf, ours


def assert_greedy_close(ours: list[int], theirs: list[int], logits: list[torch.Tensor]) -> None:
    """Token for token, except that the two may part at a near-tie: where they first differ,
    transformers must score our token within TOL of its own (vLLM's check_logprobs_close)."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            gap = float(logits[i][b] - logits[i][a])
            assert gap <= TOL, f"token {i}: ours {a}, transformers {b}, {gap:.4f} apart in its logits"
            return


def test_prefill_and_decode_logits_match_transformers(pair):
    """A batch of prompts, then three decode steps of all three sequences together (the fused
    decode step for Llama-family models), against transformers on the whole sequences."""
    hf, ours = pair
    runner = ForwardRunner(ours.model, num_blocks=32, block_size=4)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(PROMPTS))]
    seqs = [list(p) for p in PROMPTS]
    got = [
        [row]
        for row in runner.execute(
            [SequenceBatchEntry(s, len(s), t) for s, t in zip(seqs, tables, strict=True)]
        )
    ]
    for step in range(3):
        for s in seqs:
            s.append(7 + step)
        logits = runner.execute(
            [SequenceBatchEntry([s[-1]], len(s), t) for s, t in zip(seqs, tables, strict=True)]
        )
        for i, row in enumerate(logits):
            got[i].append(row)
    for s, rows in zip(seqs, got, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([s])).logits[0, len(s) - 4 :]
        torch.testing.assert_close(torch.stack(rows), ref, rtol=TOL, atol=TOL)


def test_chunked_prefill_through_the_cache(pair):
    """A prompt fed in chunks of 7 over blocks out of order: every position's logits."""
    hf, ours = pair
    prompt = PROMPTS[1] + PROMPTS[0] + PROMPTS[1]
    runner = ForwardRunner(ours.model, num_blocks=16, block_size=4)
    blocks = [9, 3, 12, 0, 5, 7, 1, 14, 2, 8, 6]
    pieces = [
        runner.execute(
            [SequenceBatchEntry(prompt[i : i + 7], min(i + 7, len(prompt)), blocks)], all_logits=True
        )
        for i in range(0, len(prompt), 7)
    ]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(torch.cat(pieces), ref, rtol=TOL, atol=TOL)


def test_greedy_matches_transformers_alone_and_batched(pair):
    hf, ours = pair
    expected = [hf_greedy(hf, p, 16) for p in PROMPTS]
    runner = ForwardRunner(ours.model, num_blocks=64, block_size=4)
    for p, (tokens, logits) in zip(PROMPTS, expected, strict=True):
        assert_greedy_close(generate_greedy(runner, [p], 16)[0], tokens, logits)
    for out, (tokens, logits) in zip(generate_greedy(runner, PROMPTS, 16), expected, strict=True):
        assert_greedy_close(out, tokens, logits)


def test_weights_take_their_quantized_size(pair):
    _, ours = pair
    groups = {(g.role, g.fmt): g.num_bytes for g in ours.weight_groups}
    fmt = "q4" if ours.quantization == "int4" else "q8"
    assert (("mlp", fmt) in groups) and (("attention", fmt) in groups) and ("embedding", "q8") in groups
    assert not any(f == "float32" and role != "other" for role, f in groups)
    assert f"quantization {ours.quantization}" in ours.summary()


# -- the fused decode step ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kv_cache_dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        KVDtypes(torch.int8, torch.float16),
        KVDtypes(torch.float16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("name", LLAMA_FAMILY + MOE)
def test_fused_decode_matches_layer_by_layer(tmp_path, name, kv_cache_dtype):
    """Three sequences of different lengths decode 12 steps (past the sliding window of the
    Mistral config, across blocks placed out of order) with the fused step and without."""
    make_tiny_model(name, tmp_path)
    loaded = load_model(
        ModelConfig(model=str(tmp_path), quantization="int4", cpu_activations="int16", show_progress=False)
    )
    logits = {}
    for fused in (True, False):
        runner = ForwardRunner(loaded.model, num_blocks=48, block_size=4, kv_cache_dtype=kv_cache_dtype)
        assert runner.fused is not None  # the runner picks the fused step for quantized Llama stacks
        runner.use_fused(fused)
        tables = [
            [47, 3, 20, 8, 30, 1, 12, 40],
            [5, 9, 33, 2, 41, 17, 25, 44],
            [0, 46, 11, 22, 36, 6, 14, 28],
        ]
        seqs = [list(p) for p in PROMPTS]
        runner.execute([SequenceBatchEntry(s, len(s), t) for s, t in zip(seqs, tables, strict=True)])
        steps = []
        for step in range(12):
            for i, s in enumerate(seqs):
                s.append((31 * step + 7 * i) % 500)
            steps.append(
                runner.execute(
                    [SequenceBatchEntry([s[-1]], len(s), t) for s, t in zip(seqs, tables, strict=True)]
                )
            )
        logits[fused] = torch.stack(steps)
    # Both paths round activations to int16 per token; summation orders differ, so an activation
    # can land on the other side of a rounding boundary: the same TOL as against transformers. A
    # prompt chunk's attention in the layer path uses its own K/V unrounded, the fused path reads
    # them back from the 16-bit cache: plus that rounding (2^-11 for float16, 2^-8 for bfloat16).
    # K and V apart (the C++ side reads each half in its own type): int8 keys' steps are 1/127 of
    # a group's largest value, so an activation on a rounding boundary moves a key by one step.
    tol = {torch.float32: TOL, torch.float16: 2 * TOL, torch.bfloat16: 10 * TOL}.get(kv_cache_dtype, 10 * TOL)
    torch.testing.assert_close(logits[True], logits[False], rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "kv_cache_dtype", [torch.float32, torch.float16, KVDtypes(torch.int8, torch.float16)]
)
@pytest.mark.parametrize("cpu_activations", ["int16", "int8"])
@pytest.mark.parametrize(
    "name", ["llama", "mistral-sliding", "qwen3", "qwen2-moe", "gemma3", "gemma2", "olmo2", "starcoder2"]
)
def test_fused_rows_do_not_depend_on_the_batch(tmp_path, name, cpu_activations, kv_cache_dtype):
    """A token's logits are the same to the bit whether it is decoded alone or among other tokens
    of its sequence and of another (a speculative step, a batch), over a context spanning several
    of the attention's 128-position chunks (and a sliding window): what makes speculative
    decoding's greedy output plain decoding's. (A float16 cache is read converting in registers
    by a token alone and through a converted block by several: the same values either way.)"""
    make_tiny_model(name, tmp_path)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf_config, "max_position_embeddings": 1024}))
    config = ModelConfig(model=str(tmp_path), quantization="int4", cpu_activations=cpu_activations, show_progress=False)  # type: ignore[arg-type]  # fmt: skip
    loaded = load_model(config)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 500, (400,), generator=g).tolist()
    other = torch.randint(0, 500, (150,), generator=g).tolist()
    new = torch.randint(0, 500, (6,), generator=g).tolist()
    table, other_table = list(range(110)), list(range(110, 150))

    def runner() -> ForwardRunner:
        r = ForwardRunner(loaded.model, num_blocks=150, block_size=4, kv_cache_dtype=kv_cache_dtype)
        assert r.fused is not None
        r.execute(
            [
                SequenceBatchEntry(prompt, len(prompt), table),
                SequenceBatchEntry(other, len(other), other_table),
            ]
        )
        return r

    alone = runner()
    one_by_one = torch.cat(
        [alone.execute([SequenceBatchEntry([t], len(prompt) + i + 1, table)]) for i, t in enumerate(new)]
    )
    together = runner().execute(
        [SequenceBatchEntry(new, len(prompt) + len(new), table), SequenceBatchEntry([7], len(other) + 1, other_table)],
        all_logits=True,
    )  # fmt: skip
    assert torch.equal(together[: len(new)], one_by_one)


def _load_on_avx2(config: ModelConfig, caplog):
    """The model loaded on the AVX2 kernel set (as on a Zen 3 CPU), warnings captured."""
    cpu_kernels.set_kernels("avx2")
    try:
        with caplog.at_level("WARNING", logger="llmserve"):
            return load_model(config)
    finally:
        cpu_kernels.set_kernels("auto")


@pytest.mark.skipif(not cpu_kernels.has_native_kernels(), reason="needs llmserve's C++ kernels")
def test_int8_activations_are_named_or_refused_with_a_warning(tmp_path, caplog):
    """The load report says when q4 takes int8 activations; where the kernel set has no int8 path
    (AVX2) the request is answered with a warning and int16."""
    make_tiny_model("llama", tmp_path)
    config = ModelConfig(
        model=str(tmp_path), quantization="int4", cpu_activations="int8", show_progress=False
    )
    if cpu_kernels.best_kernels() == "avx512_vnni":
        assert "q4 with int8 activations" in load_model(config).linear_kernel
    loaded = _load_on_avx2(config, caplog)
    assert "int8 activations" not in loaded.linear_kernel
    assert "cpu_activations int8 needs the avx512_vnni kernels (this process runs avx2)" in caplog.text


@pytest.mark.skipif(not cpu_kernels.has_native_kernels(), reason="needs llmserve's C++ kernels")
def test_auto_activations_are_int16_on_every_kernel_set(tmp_path, caplog):
    """The default, `auto`, keeps the float model's answers: int16 activations for q4 weights on
    the AVX-512 VNNI kernels as on AVX2 (no warning); int8 only when asked for; q8 weights always
    take int16."""

    def act_bits(loaded) -> set[int]:
        return {m.act_bits for m in loaded.model.modules() if hasattr(m, "act_bits")}

    make_tiny_model("llama", tmp_path)
    assert ModelConfig().cpu_activations == "auto"
    int4 = ModelConfig(model=str(tmp_path), quantization="int4", show_progress=False)
    loaded = load_model(int4)
    assert act_bits(loaded) == {16} and "int8 activations" not in loaded.linear_kernel
    assert act_bits(load_model(replace(int4, cpu_activations="int16"))) == {16}
    if cpu_kernels.best_kernels() == "avx512_vnni":
        assert act_bits(load_model(replace(int4, cpu_activations="int8"))) == {8}
    loaded = _load_on_avx2(int4, caplog)
    assert act_bits(loaded) == {16} and "int8 activations" not in loaded.linear_kernel
    assert "cpu_activations" not in caplog.text
    int8_weights = load_model(replace(int4, quantization="int8"))
    assert "int8 activations" not in int8_weights.linear_kernel


def test_float_models_do_not_take_the_fused_step(tmp_path):
    make_tiny_model("llama", tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), show_progress=False))
    assert loaded.quantization == "none"
    runner = ForwardRunner(loaded.model, num_blocks=8, block_size=4)
    runner.execute([SequenceBatchEntry([1, 2, 3], 3, [0])])
    runner.execute([SequenceBatchEntry([4], 4, [0])])
    assert runner.fused is None and "float linear" in runner.fused_unsupported


# -- GGUF files served quantized ----------------------------------------------------------------------

# Types per tensor of a tiny Llama GGUF: every type that is read straight into a block format.
GGUF_TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0,
              "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_1, "ffn_down": Q.Q5_K, "token_embd": Q.Q8_0, "output": Q.Q8_0}  # fmt: skip


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    """Every type that is read straight into a block format, mixed in one file."""
    return tiny_llama_gguf(tmp_path_factory.mktemp("qgguf"), GGUF_TYPES)


@pytest.fixture(scope="module")
def q4_0_gguf(tmp_path_factory):
    """Every matrix Q4_0, the tied embedding and the output too."""
    return tiny_llama_gguf(tmp_path_factory.mktemp("q4_0"), dict.fromkeys(GGUF_TYPES, Q.Q4_0))


def test_gguf_served_quantized_matches_dequantized(quantized_gguf):
    """auto keeps each tensor's blocks (Q4_x as q4; Q5_x, Q8_0 as q8): logits match the same
    file dequantized to float within the activation rounding (and the K types' half-float
    sub-block scales)."""
    quant = load_model(ModelConfig(model=str(quantized_gguf), cpu_activations="int16", show_progress=False))
    plain = load_model(ModelConfig(model=str(quantized_gguf), quantization="none", show_progress=False))
    assert quant.quantization == "auto" and plain.quantization == "none"
    layer = quant.model.model.layers[0]
    assert layer.self_attn.qkv_proj.fmt == "q4"  # Q4_K, Q4_0 and Q4_1 shards
    assert layer.self_attn.o_proj.fmt == layer.mlp.gate_up_proj.fmt == layer.mlp.down_proj.fmt == "q8"
    entry = [SequenceBatchEntry(PROMPTS[1], len(PROMPTS[1]), list(range(5)))]
    got = ForwardRunner(quant.model, num_blocks=8, block_size=4).execute(entry, all_logits=True)
    want = ForwardRunner(plain.model, num_blocks=8, block_size=4).execute(entry, all_logits=True)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_gguf_blocks_reach_the_layers_unchanged(quantized_gguf):
    """The q4 layer holds exactly the file's Q4_K, Q4_0 and Q4_1 values (the test file's Q4_K
    scales are powers of two times 6-bit multipliers: exact in half floats)."""
    from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint

    quant = load_model(ModelConfig(model=str(quantized_gguf), show_progress=False))
    qkv: QuantizedLinear = quant.model.model.layers[1].self_attn.qkv_proj
    floats = dict((n, t) for n, t, _ in GGUFCheckpoint([quantized_gguf]).iter_weights(torch.float32))
    prefix = "model.layers.1.self_attn."
    want = torch.cat([floats[prefix + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.logical_weight(), want)
    assert qkv.qweight is not None and qkv.qweight.m is not None  # Q4_K, Q4_1: Q4_0's -8 d stored too


# The GGUF types without a quantizer in gguf (random valid blocks instead) and MXFP4, by tensor kind.
TABLE_AND_LOW_BIT_TYPES = {"attn_q": Q.IQ4_NL, "attn_k": Q.IQ4_XS, "attn_v": Q.MXFP4, "attn_output": Q.Q2_K,
                           "ffn_gate": Q.Q3_K, "ffn_up": Q.IQ4_XS, "ffn_down": Q.Q2_K}  # fmt: skip


@pytest.fixture(scope="module")
def low_bit_gguf(tmp_path_factory):
    """The tiny Llama in TABLE_AND_LOW_BIT_TYPES: MXFP4 quantized by gguf from the float weights,
    the others (no quantizer in gguf) random valid blocks."""
    return tiny_llama_gguf(tmp_path_factory.mktemp("lowbit"), TABLE_AND_LOW_BIT_TYPES)


def test_low_bit_and_table_gguf_types_run_quantized(low_bit_gguf):
    """Q2_K, Q3_K (dequantized by gguf, requantized to q8), IQ4_NL, IQ4_XS and MXFP4 (read as q8
    rows: a table of int8 levels): served quantized, the logits are those of the same file
    dequantized to float, within q8's requantization of the 2- and 3-bit types; the load report
    names each type and what it became."""
    quant = load_model(ModelConfig(model=str(low_bit_gguf), cpu_activations="int16", show_progress=False))
    plain = load_model(ModelConfig(model=str(low_bit_gguf), quantization="none", show_progress=False))
    summary = quant.summary()
    for name in ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"):
        assert name in summary
    layer = quant.model.model.layers[0]
    assert layer.self_attn.qkv_proj.fmt == layer.mlp.down_proj.fmt == "q8"
    entry = [SequenceBatchEntry(PROMPTS[1], len(PROMPTS[1]), list(range(5)))]
    got = ForwardRunner(quant.model, num_blocks=8, block_size=4).execute(entry, all_logits=True)
    want = ForwardRunner(plain.model, num_blocks=8, block_size=4).execute(entry, all_logits=True)
    assert torch.isfinite(want).all() and want.abs().amax() > 0.1
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * want.abs().amax().item())


def _decode_logits(model: torch.nn.Module, fused: bool) -> torch.Tensor:
    """PROMPTS prefilled together, then 4 decode steps of all three: [5, 3, vocab] last-token logits."""
    runner = ForwardRunner(model, num_blocks=24, block_size=4)
    runner.use_fused(fused)
    assert (runner.fused is not None) == fused
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(PROMPTS))]
    seqs = [list(p) for p in PROMPTS]
    steps = []
    for step in range(5):
        entries = [
            SequenceBatchEntry(s if step == 0 else s[-1:], len(s), t)
            for s, t in zip(seqs, tables, strict=True)
        ]
        steps.append(runner.execute(entries))
        for s, row in zip(seqs, steps[-1], strict=True):
            s.append(int(row.argmax()))
    return torch.stack(steps)


@pytest.mark.parametrize("cpu_activations", ["int16", "int8"])
def test_q4_0_keeps_no_minimum_and_the_same_logits(q4_0_gguf, cpu_activations):
    """Q4_0 layers store no minimum (18 bytes a block of 32, as in the file; the load report counts
    that), and the kernels' m = -8 d gives the logits of the minimum stored as a half (how Q4_0 was
    held before) to the bit: fused and layer by layer, int16 and int8 activations, on every kernel
    set this CPU runs. (tests/unit/test_quantization.py shows the comparison sees one ulp.)"""
    config = ModelConfig(model=str(q4_0_gguf), cpu_activations=cpu_activations, show_progress=False)
    loaded = load_model(config)
    modules = [m for m in loaded.model.modules() if isinstance(getattr(m, "qweight", None), PackedWeight)]
    assert {type(m).__name__ for m in modules} >= {"QuantizedLinear", "QuantizedVocabEmbedding"}
    for m in modules:
        w = m.qweight
        assert w.fmt == "q4" and w.m is None
        assert w.nbytes() == -(-w.out_features // 16) * 16 * (w.in_features // 32) * 18
    groups = [g for g in loaded.weight_groups if g.fmt == "q4"]
    assert sum(g.num_bytes for g in groups) == sum(m.qweight.nbytes() for m in modules)
    if cpu_activations == "int8" and "avx512_vnni" in KERNEL_SETS:
        assert "int8 activations" in loaded.linear_kernel
    logits: dict[bool, dict[tuple[str, bool], torch.Tensor]] = {}
    try:
        for stored in (False, True):
            if stored:  # the representation before: the half -8 d in every block
                for m in modules:
                    m.qweight = replace(m.qweight, m=-8 * m.qweight.d)
            logits[stored] = {}
            for kernels in KERNEL_SETS:
                cpu_kernels.set_kernels(kernels)
                for fused in (True, False) if kernels != "torch" else (False,):
                    logits[stored][kernels, fused] = _decode_logits(loaded.model, fused)
    finally:
        cpu_kernels.set_kernels("auto")
    for key, got in logits[False].items():
        assert torch.equal(got, logits[True][key]), key


# -- start-up errors and the fallback kernels -------------------------------------------------------


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="'int3'"):
        ModelConfig(quantization="int3")  # type: ignore[arg-type]


def test_quantization_on_a_dtype_without_kernels_is_refused(tmp_path):
    make_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="'int4'.*float16"):
        load_model(
            ModelConfig(model=str(tmp_path), quantization="int4", dtype="float16", show_progress=False)
        )


def test_quantization_without_native_kernels_is_refused_unless_forced(tmp_path, monkeypatch):
    make_tiny_model("qwen2", tmp_path)
    reference = load_model(ModelConfig(model=str(tmp_path), quantization="int8", show_progress=False))
    monkeypatch.delenv("LLMSERVE_QUANT_KERNELS", raising=False)
    cpu_kernels.set_kernels("torch")
    try:
        with pytest.raises(ValueError, match="'int8'.*LLMSERVE_QUANT_KERNELS"):
            load_model(ModelConfig(model=str(tmp_path), quantization="int8", show_progress=False))
        auto = load_model(ModelConfig(model=str(tmp_path), show_progress=False))
        assert auto.quantization == "none"
        monkeypatch.setenv("LLMSERVE_QUANT_KERNELS", "torch")  # the user accepts the slow path
        forced = load_model(ModelConfig(model=str(tmp_path), quantization="int8", show_progress=False))
        assert "on torch" in forced.linear_kernel
        runner = ForwardRunner(forced.model, num_blocks=64, block_size=4)
        got = generate_greedy(runner, PROMPTS, 16)
        assert runner.fused is None  # the fused step needs the native kernels
    finally:
        cpu_kernels.set_kernels("auto")
    assert got == generate_greedy(ForwardRunner(reference.model, num_blocks=64, block_size=4), PROMPTS, 16)


def test_quantized_kv_path_on_cuda_is_refused(tmp_path):
    from llmserve.model_executor.model_loader.quant_plan import check_supported

    with pytest.raises(ValueError, match="'int8' runs on the CPU only"):
        check_supported("int8", torch.device("cuda"), torch.float32)
    check_supported("auto", torch.device("cuda"), torch.float16)  # auto stays float there


def test_int4_layers_hold_less_than_a_third_of_float(tmp_path):
    make_tiny_model("llama", Path(tmp_path))
    fp = load_model(ModelConfig(model=str(tmp_path), quantization="none", show_progress=False))
    q4 = load_model(ModelConfig(model=str(tmp_path), quantization="int4", show_progress=False))
    linear = lambda m: sum(g.num_bytes for g in m.weight_groups if g.role in ("attention", "mlp"))  # noqa: E731
    assert linear(q4) * 6 < linear(fp)  # 0.625 bytes a weight against 4


@pytest.mark.parametrize("window", [None, 300])
def test_fused_decode_splits_long_contexts(tmp_path, window):
    """Contexts of 700+ positions are cut into chunks spread over the threads (and merged with
    their softmax maxima); a 300-position sliding window starts mid-block and mid-chunk."""
    config = transformers.MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, sliding_window=window, initializer_range=0.15,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), quantization="int8", show_progress=False))
    prompts = [[(7 * i) % 500 for i in range(700)], [(3 * i + 1) % 500 for i in range(257)]]
    tables = [list(range(0, 50)), list(range(50, 70))]
    logits = {}
    for fused in (True, False):
        runner = ForwardRunner(loaded.model, num_blocks=80, block_size=16)
        runner.use_fused(fused)
        assert (runner.fused is not None) == fused
        runner.execute([SequenceBatchEntry(p, len(p), t) for p, t in zip(prompts, tables, strict=True)])
        logits[fused] = torch.stack(
            [
                runner.execute(
                    [
                        SequenceBatchEntry([k + i], len(p) + k + 1, t)
                        for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
                    ]
                )
                for k in range(4)
            ]
        )
    torch.testing.assert_close(logits[True], logits[False], rtol=TOL, atol=TOL)


def test_the_engine_says_whether_steps_run_in_the_fused_decoder(tmp_path, caplog):
    """One line at start-up: the fused CPU decoder runs the steps, or why it does not (a float model)."""
    import logging

    from llmserve.engine.llm import LLM

    make_tiny_model("gemma3", tmp_path)
    with caplog.at_level(logging.INFO, logger="llmserve.model_executor.model_runner"):
        LLM(str(tmp_path), quantization="int8", num_kv_blocks=16, show_progress=False)
        LLM(str(tmp_path), quantization="none", num_kv_blocks=16, show_progress=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "llmserve.model_executor.model_runner"]
    assert lines == [
        "steps run in the fused CPU decoder (one C++ call a step)",
        "steps run layer by layer (not in the fused CPU decoder: float linear layers)",
    ]
