"""A step with a LoRA adapter on a quantized GGUF base (the embedded Q4_1 SmolLM2-135M): the fused
CPU decoder runs base-only steps, and a step with an adapter falls back to the model's layers. An
adapter whose B is zero changes nothing, so its greedy tokens must equal the base's, in a batch
that mixes it with base requests and alone; a non-zero adapter must change them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmserve.engine.llm import LLM
from llmserve.lora import LoRARequest
from llmserve.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


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


def test_the_layer_fallback_equals_the_fused_decoder(llm, tmp_path):
    assert llm.engine.runner.runner.fused is not None, "the base should run the fused CPU decoder"
    zero = LoRARequest("zero", 1, str(write_adapter(llm, tmp_path / "zero", 0.0)))
    params = SamplingParams(max_tokens=12, temperature=0.0)

    def tokens(loras):
        outs = llm.generate(PROMPTS, params, lora_request=loras, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    base = tokens(None)  # every step fused
    assert tokens([zero, None, zero]) == base  # mixed steps: the layer path for all three
    assert tokens(zero) == base
    strong = LoRARequest("strong", 2, str(write_adapter(llm, tmp_path / "strong", 0.5)))
    assert tokens(strong) != base
