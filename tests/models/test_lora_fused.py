"""LoRA adapters inside the fused CPU decoder (csrc/decoder_lora.cpp, lora/fused.py).

On tiny random int8 models (llama, qwen2 with its qkv bias): a step mixing three adapters and the
base runs in the fused decoder, never entering the model's layers; each sequence's logits equal
those of a batch of its adapter alone to the bit, and the layer path's within the int16 activation
rounding; greedy tokens equal PEFT's merged model. An adapter on a layer the fused decoder has no
LoRA for (an MoE layer's shared expert) runs layer by layer, and `unsupported_reason` names it.

On the embedded Q4_1 SmolLM2-135M: an adapter whose B is zero changes nothing, so its greedy tokens
must equal the base's, in a batch that mixes it with base requests and alone; a non-zero adapter
must change them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmserve.engine.llm import LLM
from llmserve.layers.quantization import cpu_kernels
from llmserve.lora import LoRARequest
from llmserve.sampling_params import SamplingParams
from tests.models.test_lora import ALL, PROMPTS, base, make_adapter, make_runner, peft_reference, run_mixed  # noqa: F401
from tests.models.tiny import make_tiny_model

pytest.importorskip("peft")

FOUR = [*PROMPTS, [9, 8, 7, 6, 5]]

TEXT_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


def write_adapter(llm: LLM, folder: Path, b_scale: float) -> Path:
    """A PEFT folder (rank 4) on every q_proj and down_proj of the served model; B = b_scale * noise."""
    config = llm.engine.loaded.hf_config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shapes = {
        "self_attn.q_proj": (config.hidden_size, config.num_attention_heads * head_dim),
        "mlp.down_proj": (config.intermediate_size, config.hidden_size),
    }
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, n_in, generator=gen) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, 4, generator=gen) * b_scale
    folder.mkdir()
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return folder


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(enable_lora=True, show_progress=False)


def test_a_zero_adapter_leaves_the_embedded_models_tokens(llm, tmp_path):
    assert llm.engine.runner.runner.fused is not None, "the base should run the fused CPU decoder"
    zero = LoRARequest("zero", 1, str(write_adapter(llm, tmp_path / "zero", 0.0)))
    params = SamplingParams(max_tokens=12, temperature=0.0)

    def tokens(loras):
        outs = llm.generate(TEXT_PROMPTS, params, lora_request=loras, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    base_tokens = tokens(None)  # every step fused, with or without the adapter
    assert tokens([zero, None, zero]) == base_tokens
    assert tokens(zero) == base_tokens
    strong = LoRARequest("strong", 2, str(write_adapter(llm, tmp_path / "strong", 0.5)))
    assert tokens(strong) != base_tokens


def _no_layers(runner) -> None:
    """Make the model's layer-by-layer forward fail: a step that enters it did not run fused."""

    def fail(*args, **kwargs):
        raise AssertionError("the step ran the model's layers, not the fused decoder")

    runner.model.forward = fail


@pytest.fixture(scope="module")
def three(base):  # noqa: F811
    """An int8 runner (the fused decoder) serving the two `base` adapters and a third, rsLoRA one
    on o_proj and up_proj only."""
    return _three_runner(base)


def _three_runner(base):  # noqa: F811
    _, folder, adapters = base
    third = folder / "lora-third"
    if not third.exists():
        make_adapter(folder, third, ["o_proj", "up_proj"], seed=3, use_rslora=True)
    runner, manager = make_runner(folder, "int8")
    for i, path in enumerate([*adapters, third], start=1):
        manager.add(LoRARequest(f"a{i}", i, str(path)))
    assert runner.fused is not None
    return runner


def test_a_mixed_batch_runs_fused_and_equals_each_alone_to_the_bit(three):
    runner = three
    layers = runner.model.forward
    _no_layers(runner)
    try:
        mixed = run_mixed(runner, [1, 2, 3, 0], prompts=FOUR)
        for i, lora_id in enumerate([1, 2, 3, 0]):
            alone = run_mixed(runner, [lora_id] * 4, prompts=FOUR)[i]
            assert torch.equal(mixed[i], alone), f"sequence {i} (adapter {lora_id})"
    finally:
        runner.model.forward = layers
    base_only = run_mixed(runner, [0] * 4, prompts=FOUR)
    for i in range(3):
        assert (mixed[i] - base_only[i]).abs().max() > 0.1, f"adapter {i + 1} barely changes the logits"


def test_ranks_off_the_shrinks_blocks_keep_mixed_equal_to_alone_and_to_the_layer_path(base):  # noqa: F811
    """Rank 13 on every projection: the shrink's 16-rank blocks end part-filled (qkv's 39 ranks:
    16 + 16 + 7 in one vector; gate_up's 26: 16 + 10; o's and down's 13), as do the expand's."""
    _, folder, _ = base
    odd = [folder / "lora-r13-a", folder / "lora-r13-b"]
    for seed, path in enumerate(odd, start=5):
        if not path.exists():
            make_adapter(folder, path, ALL, seed=seed, r=13)
    runner, manager = make_runner(folder, "int8")
    for i, path in enumerate(odd, start=1):
        manager.add(LoRARequest(f"r13-{i}", i, str(path)))
    assert runner.fused is not None
    mixed = run_mixed(runner, [1, 2, 1, 0], prompts=FOUR)
    for i, lora_id in enumerate([1, 2, 1, 0]):
        alone = run_mixed(runner, [lora_id] * 4, prompts=FOUR)[i]
        assert torch.equal(mixed[i], alone), f"sequence {i} (adapter {lora_id})"
    runner.use_fused(False)
    layered = run_mixed(runner, [1, 2, 1, 0], prompts=FOUR)
    for got, expected in zip(mixed, layered, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_the_fused_deltas_equal_the_layer_paths(three):
    """The same steps through the model's layers (masked matmul pair per layer): equal within the
    int16 activation rounding (a 1e-7 change moves a rounding step: ~3e-4 in the logits)."""
    runner = three
    fused = run_mixed(runner, [1, 2, 3, 0], prompts=FOUR)
    runner.use_fused(False)
    try:
        layered = run_mixed(runner, [1, 2, 3, 0], prompts=FOUR)
    finally:
        runner.use_fused(True)
    for got, expected in zip(fused, layered, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_greedy_tokens_equal_pefts_merged_model(base):  # noqa: F811
    _, folder, adapters = base
    llm = LLM(
        str(folder), quantization="int8", cpu_activations="int16", enable_lora=True, show_progress=False
    )
    assert llm.engine.runner.runner.fused is not None
    params = SamplingParams(max_tokens=8, temperature=0.0)
    requests = [LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(adapters, start=1)]
    prompts = [FOUR[0], FOUR[1], FOUR[0]]
    outs = llm.generate(prompts, params, lora_request=[*requests, None], use_tqdm=False)
    for out, prompt, adapter in zip(outs, prompts, [*adapters, None], strict=True):
        ref = peft_reference(folder, adapter, "int8")
        if adapter is not None:
            ref = ref.merge_and_unload()
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert out.outputs[0].token_ids == expected[0, len(prompt) :].tolist()


def test_an_adapter_outside_the_fused_layers_runs_layer_by_layer(tmp_path):
    """Qwen2-MoE: the fused decoder runs the experts but has no LoRA for them; an adapter on the
    shared expert runs layer by layer (and still matches PEFT), one on the attention runs fused."""
    make_tiny_model("qwen2-moe", tmp_path)
    shared = make_adapter(tmp_path, tmp_path / "shared", ["q_proj", "shared_expert.gate_proj"], seed=1)
    attention = make_adapter(tmp_path, tmp_path / "attention", ["q_proj", "v_proj"], seed=2)
    runner, manager = make_runner(tmp_path, "int8")
    assert runner.fused is not None
    one = manager.add(LoRARequest("shared", 1, str(shared)))
    manager.add(LoRARequest("attention", 2, str(attention)))
    reason = runner.fused_lora().unsupported_reason(one)
    assert reason is not None and "shared_expert" in reason
    got = run_mixed(runner, [1, 0, 1], steps=1)
    ref_model = peft_reference(tmp_path, shared, "int8")
    for i in (0, 2):
        with torch.no_grad():
            ref = ref_model(torch.tensor([[*PROMPTS[i], 7]])).logits[0]
        torch.testing.assert_close(got[i], ref, rtol=2e-3, atol=2e-3)
    _no_layers(runner)
    run_mixed(runner, [2, 0, 2], steps=1)  # the attention adapter: fused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_a_16_bit_copy_of_the_adapters(base, dtype):  # noqa: F811
    """`lora_dtype`: the adapters kept in 16 bits, widened to float32 as they are read. The fused
    and layer paths read the same rounded weights (equal within the activation rounding, and a
    mixed batch still equals each alone to the bit); against float32 adapters the logits move by
    the weights' rounding only."""
    _, folder, adapters = base
    exact, exact_manager = make_runner(folder, "int8")
    runner, manager = make_runner(folder, "int8", lora_dtype=str(dtype).removeprefix("torch."))
    for i, path in enumerate(adapters, start=1):
        exact_manager.add(LoRARequest(f"a{i}", i, str(path)))
        adapter = manager.add(LoRARequest(f"a{i}", i, str(path)))
        assert {p.a_t.dtype for p in adapter.layers.values()} == {dtype}
    got = run_mixed(runner, [1, 2, 0])
    for i, lora_id in enumerate([1, 2, 0]):
        assert torch.equal(got[i], run_mixed(runner, [lora_id] * 3)[i])
    reference = run_mixed(exact, [1, 2, 0])
    runner.use_fused(False)
    layered = run_mixed(runner, [1, 2, 0])
    for i in range(3):
        torch.testing.assert_close(got[i], layered[i], rtol=1e-3, atol=1e-3)
        moved = (got[i] - reference[i]).abs().max().item()
        assert moved < 0.05, f"sequence {i}: 16-bit adapters moved the logits by {moved}"


def test_the_avx2_kernel_set_keeps_mixed_equal_to_alone_and_close_to_the_layer_path(base):  # noqa: F811
    """With the matmuls' AVX2 kernel set (what an AVX2-only CPU runs), a token's result is still
    the same alone or batched, and the fused steps within the layer path's tolerance."""
    if cpu_kernels.best_kernels() != "avx512_vnni":
        pytest.skip("the default run covers AVX2 on this CPU")
    runner = _three_runner(base)  # a fresh one: `three`'s fused decoder was rebuilt by other tests
    cpu_kernels.set_kernels("avx2")
    try:
        mixed = run_mixed(runner, [1, 2, 3, 0], prompts=FOUR)
        for i, lora_id in enumerate([1, 2, 3, 0]):
            alone = run_mixed(runner, [lora_id] * 4, prompts=FOUR)[i]
            assert torch.equal(mixed[i], alone), f"sequence {i} (adapter {lora_id})"
        runner.use_fused(False)
        try:
            layered = run_mixed(runner, [1, 2, 3, 0], prompts=FOUR)
        finally:
            runner.use_fused(True)
    finally:
        cpu_kernels.set_kernels("auto")
    for got, expected in zip(mixed, layered, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("arch", ["gemma3", "olmo2", "starcoder2"])
def test_adapters_on_sandwich_and_post_norm_stacks_run_fused_as_in_the_layer_path(tmp_path, arch):
    """Gemma 3 (its o and down outputs normed before they join the stream), OLMo 2 (post-norm
    layers) and StarCoder2 (LayerNorms, a plain MLP: c_fc's delta in gate_up's place): an adapter's
    delta joins each projection's output before that norm, in the fused decoder as in the model's
    layers; a mixed batch never enters the layers, and an adapter moves the logits."""
    make_tiny_model(arch, tmp_path)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"] if arch == "starcoder2" else ALL
    adapter = make_adapter(tmp_path, tmp_path / "lora", targets, seed=1)
    runner, manager = make_runner(tmp_path, "int8")
    manager.add(LoRARequest("a", 1, str(adapter)))
    assert runner.fused is not None, runner.fused_unsupported
    layers = runner.model.forward
    _no_layers(runner)
    try:
        fused = run_mixed(runner, [1, 0, 1])
    finally:
        runner.model.forward = layers
    runner.use_fused(False)
    layered = run_mixed(runner, [1, 0, 1])
    for got, expected in zip(fused, layered, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    assert (fused[0] - run_mixed(runner, [0, 0, 0])[0]).abs().max() > 0.1
