"""Every native architecture built and run on the `meta` device, without a GPU.

A tensor the model, the runner or the attention backend creates on the CPU at the first forward
(instead of on the model's device) meets the model's meta tensors and raises here, as it would
have crashed on CUDA (the RoPE table once did: "Expected all tensors to be on the same device").
A host sync in the forward (`.item()`, `.tolist()` on a device tensor) raises on meta too.
"""

from __future__ import annotations

import pytest
import torch

from llmserve.layers.attention import get_attention_backend
from llmserve.model_executor.device import build_profile
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.models import resolve_model_class
from tests.models.tiny import TINY_CONFIGS

META = torch.device("meta")


def build_on_meta(name: str) -> torch.nn.Module:
    config = TINY_CONFIGS[name]()
    with torch.device(META):
        model = resolve_model_class(config.architectures or [_arch(config)], name)(
            config, get_attention_backend("torch")
        )
    return model.eval()


def _arch(config) -> str:
    """The HF class name a saved checkpoint would list (configs built in code list none)."""
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "gpt2": "GPT2LMHeadModel",
            "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "gpt_oss": "GptOssForCausalLM", "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM", "gemma2": "Gemma2ForCausalLM", "granitemoe": "GraniteMoeForCausalLM", "starcoder2": "Starcoder2ForCausalLM", "exaone4": "Exaone4ForCausalLM",
            }[config.model_type]  # fmt: skip


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_forward_on_meta_creates_nothing_on_another_device(name: str) -> None:
    model = build_on_meta(name)
    assert {p.device for p in model.parameters()} | {b.device for b in model.buffers()} == {META}
    runner = ForwardRunner(model, num_blocks=16, block_size=4, profile=build_profile(META))
    assert runner.kv_caches[0].device == META and runner.fused is None
    vocab = model.config.vocab_size
    # a prefill from position 0, a chunk after a cached prefix, and two decodes in one batch
    batch = [
        SequenceBatchEntry(list(range(1, 10)), 9, [0, 1, 2]),
        SequenceBatchEntry([5, 6, 7], 12, [3, 4, 5]),
        SequenceBatchEntry([8], 7, [6, 7]),
        SequenceBatchEntry([9], 20, [8, 9, 10, 11, 12]),
    ]
    logits = runner.execute(batch)
    assert logits.device == META and tuple(logits.shape) == (4, vocab)
    every = runner.execute(batch, all_logits=True)
    assert tuple(every.shape) == (9 + 3 + 1 + 1, vocab)


def test_profile_of_meta_runs_the_reference_backend_eagerly() -> None:
    profile = build_profile(META)
    assert profile.attention_backend == "torch"
    assert not (profile.fused_cpu_decoder or profile.cuda_graphs or profile.pin_memory)


def test_gemma3_vision_on_meta_creates_nothing_on_another_device(tmp_path) -> None:
    """The image encoder, the projector and a step with an image's rows and span, all on meta."""
    import transformers

    from llmserve.models.gemma3_mm import Gemma3ForConditionalGeneration

    text = TINY_CONFIGS["gemma3"]()
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=32,
        patch_size=4,
    )
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16)
    with torch.device(META):
        model = Gemma3ForConditionalGeneration(config, get_attention_backend("torch")).eval()
    assert {p.device for p in model.parameters()} | {b.device for b in model.buffers()} == {META}
    vectors = model.embed_images(torch.empty(1, 3, 32, 32, device=META))
    assert vectors.device == META and tuple(vectors.shape) == (1, 16, text.hidden_size)
    runner = ForwardRunner(model, num_blocks=16, block_size=4, profile=build_profile(META))
    batch = [SequenceBatchEntry(list(range(1, 21)), 20, [0, 1, 2, 3, 4], image_rows=((2, vectors[0]),),
                                bidirectional=((2, 18),))]  # fmt: skip
    logits = runner.execute(batch, all_logits=True)
    assert logits.device == META and tuple(logits.shape) == (20, text.vocab_size)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_qwen_vl_on_meta_creates_nothing_on_another_device(tmp_path, kind: str) -> None:
    """Built under a default device that is not the CPU (as the loader builds on CUDA), the M-RoPE
    tables, the vision tower and a step with an image's rows stay on that device (M-RoPE's column
    map once mixed a default-device tensor with a CPU one: every Qwen VL model failed to load on
    CUDA)."""
    import transformers

    from tests.models import tiny

    make = {"qwen2_vl": tiny.make_tiny_qwen2_vl, "qwen2_5_vl": tiny.make_tiny_qwen2_5_vl,
            "qwen3_vl": tiny.make_tiny_qwen3_vl,
            "qwen3_vl_moe": lambda folder: tiny.make_tiny_qwen3_vl(folder, moe=True)}[kind]  # fmt: skip
    make(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device(META):
        model = resolve_model_class(config.architectures, kind)(config, get_attention_backend("torch")).eval()
    assert {p.device for p in model.parameters()} | {b.device for b in model.buffers()} == {META}
    vision = config.vision_config
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    vectors = model.visual(torch.empty(4 * 4, patch, device=META), (1, 4, 4))  # 16 patches, 4 tokens
    assert vectors.device == META and vectors.shape[0] == 4
    runner = ForwardRunner(model, num_blocks=16, block_size=4, profile=build_profile(META))
    logits = runner.execute([SequenceBatchEntry(list(range(1, 10)), 9, [0, 1, 2])], all_logits=True)
    assert logits.device == META and tuple(logits.shape) == (9, config.get_text_config().vocab_size)
