"""Mixture-of-experts models beyond the float / int8 / int4 parity with transformers that
test_parity.py and test_quantized.py run on the tiny Mixtral, Qwen2-MoE and Qwen3-MoE configs:
how the experts run (grouped, only the chosen ones), GGUF files whose stacked expert tensors stay
in their blocks, the offline engine, and the load report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from llmserve import LLM, SamplingParams
from llmserve.config import ModelConfig
from llmserve.layers.moe import SparseMoE
from llmserve.layers.quantization import QuantizedLinear
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model
from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint
from tests.gguf_writer import hf_metadata, with_placeholder_tokenizer, write_gguf, write_hf_model
from tests.models.test_quantized import TOL
from tests.models.tiny import make_tiny_model

H = 64


def _moe(num_experts: int = 8, top_k: int = 2, shared: int = 0, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(H, num_experts, top_k, 96, "silu", renormalize=True, shared_intermediate_size=shared)
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    return moe.eval()


def _run_counting(num_tokens: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Route and run `num_tokens` random tokens: (expert ids [T, k], per expert the number of
    rows of each call it got, from hooks on the experts)."""
    moe = _moe()
    calls: list[list[int]] = [[] for _ in moe.experts]
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, args, out, e=e: calls[e].append(args[0].shape[0]))
    x = torch.randn(num_tokens, H)
    with torch.no_grad():
        _, ids = moe.route(x)
        moe(x)
    return ids, calls


def test_batch_one_runs_only_the_chosen_experts() -> None:
    ids, calls = _run_counting(1)
    ran = {e for e, c in enumerate(calls) if c}
    assert ran == set(ids[0].tolist()) and len(ran) == 2
    assert all(c == [1] for c in calls if c)


def test_a_batch_runs_each_chosen_expert_once_over_its_tokens() -> None:
    ids, calls = _run_counting(12)
    counts = torch.bincount(ids.flatten(), minlength=8).tolist()
    assert [sum(c) for c in calls] == counts  # every (token, expert) pair once
    assert all(len(c) <= 1 for c in calls)  # one call per expert, never one per token


@pytest.mark.parametrize("shared", [0, 80])
def test_grouped_and_dense_paths_agree(shared: int) -> None:
    """The sync-free path (every expert, zero weights where unchosen) is the same function."""
    moe = _moe(shared=shared)
    x = torch.randn(9, H)
    with torch.no_grad():
        weights, ids = moe.route(x)
        grouped = moe.grouped_forward(x, weights, ids)
        dense = moe.dense_forward(x, weights, ids)
    torch.testing.assert_close(grouped, dense, rtol=1e-5, atol=1e-5)


def test_a_tokens_output_does_not_depend_on_its_batch() -> None:
    moe = _moe(shared=80)
    x = torch.randn(7, H)
    with torch.no_grad():
        batched = moe(x)
        alone = torch.cat([moe(x[i : i + 1]) for i in range(7)])
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)


def test_top_k_beyond_the_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok 5 .* num_experts 4"):
        SparseMoE(H, 4, 5, 96, "silu", renormalize=True)


# -- the engine and the load report ------------------------------------------------------------------


def test_offline_engine_matches_transformers_greedy(tmp_path: Path) -> None:
    hf = make_tiny_model("qwen2-moe", tmp_path)
    prompts = [[5, 17, 99, 3], [200, 1, 1, 45, 67, 300, 12, 9]]
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None)
            want.append(out[0, len(p) :].tolist())
    llm = LLM(str(tmp_path), show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want


def test_load_report_names_experts_and_active_parameters(tmp_path: Path) -> None:
    make_tiny_model("qwen3-moe", tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), quantization="int4", show_progress=False))
    c = loaded.hf_config
    expert = 3 * c.hidden_size * c.moe_intermediate_size
    idle = c.num_hidden_layers * (c.num_experts - c.num_experts_per_tok) * expert
    active = (loaded.num_params - idle) / 1e9
    assert (
        f"2 MoE layers, 8 experts (3 active), {active:.2f}B of {loaded.num_params / 1e9:.2f}B"
        in loaded.summary()
    )
    expert_layer = loaded.model.model.layers[0].mlp.experts[5].gate_up_proj
    assert isinstance(expert_layer, QuantizedLinear) and expert_layer.fmt == "q4"
    assert type(loaded.model.model.layers[0].mlp.gate).__name__ == "Router"  # the router stays float


# -- GGUF files: stacked expert tensors, kept in their blocks -------------------------------------------

GGUF_LABELS = {"qwen3moe": "qwen3moe", "mixtral": "llama"}


def moe_gguf(tmp: Path, label: str, expert_type: Q, tokenizer: bool = False) -> Path:
    """A tiny MoE (rows 256 wide: K-quant super-blocks) as llama.cpp writes it, its stacked
    expert tensors in `expert_type`, other matrices Q8_0 (auto would requantize F32 ones to q8)
    and vectors F32. `tokenizer`: placeholder tokens too, for an engine."""
    common = dict(
        vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, initializer_range=0.08, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    if label == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=256, num_local_experts=4)
    else:
        config = transformers.Qwen3MoeConfig(
            **common, intermediate_size=512, head_dim=64, num_experts=4, moe_intermediate_size=256,
            norm_topk_prob=True,
        )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp / "hf")
    from safetensors.torch import load_file

    arch = GGUF_LABELS[label]
    path = write_hf_model(tmp / "f32.gguf", arch, config, load_file(tmp / "hf" / "model.safetensors"))[0]
    tensors = {}
    for t in GGUFReader(path).tensors:
        arr = np.array(t.data).reshape(list(reversed(t.shape.tolist())))
        if "_exps" in t.name:
            tensors[t.name] = (arr, expert_type)
        else:
            tensors[t.name] = (arr, Q.Q8_0) if arr.ndim == 2 and "ffn_gate_inp" not in t.name else arr
    metadata = hf_metadata(arch, config)
    if tokenizer:
        metadata = with_placeholder_tokenizer(metadata, config.vocab_size)
    return write_gguf(tmp / "moe.gguf", arch, tensors, metadata)[0]


@pytest.mark.parametrize("label", sorted(GGUF_LABELS))
@pytest.mark.parametrize("expert_type", [Q.Q8_0, Q.Q4_0, Q.Q4_K], ids=lambda q: q.name)
def test_gguf_experts_stay_in_their_blocks(tmp_path: Path, label: str, expert_type: Q) -> None:
    """Each expert's slice of a stacked `*_exps` tensor reaches its layer as the file's blocks,
    and the model served that way matches the same file dequantized to float."""
    path = moe_gguf(tmp_path, label, expert_type)
    quant = load_model(ModelConfig(model=str(path), cpu_activations="int16", show_progress=False))
    plain = load_model(ModelConfig(model=str(path), quantization="none", show_progress=False))
    assert quant.quantization == "auto" and "MoE layers" in quant.summary()
    floats = {n: t for n, t, _ in GGUFCheckpoint([path]).iter_weights(torch.float32)}
    prefix, (gate, up) = (
        ("model.layers.1.block_sparse_moe.experts.3.", ("w1", "w3"))
        if label == "mixtral"
        else ("model.layers.1.mlp.experts.3.", ("gate_proj", "up_proj"))
    )
    layer = quant.model.model.layers[1].mlp.experts[3].gate_up_proj
    assert isinstance(layer, QuantizedLinear) and layer.fmt == ("q8" if expert_type == Q.Q8_0 else "q4")
    want = torch.cat([floats[prefix + gate + ".weight"], floats[prefix + up + ".weight"]])
    assert torch.equal(layer.logical_weight(), want)

    prompt = [5, 17, 99, 3, 200, 1, 1, 45, 67, 30, 12]
    entry = [SequenceBatchEntry(prompt, len(prompt), list(range(3)))]
    got = ForwardRunner(quant.model, num_blocks=8, block_size=4).execute(entry, all_logits=True)
    ref = ForwardRunner(plain.model, num_blocks=8, block_size=4).execute(entry, all_logits=True)
    torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL)
