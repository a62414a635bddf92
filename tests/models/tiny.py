"""Tiny random HF models for parity tests: built with transformers' config classes, saved with
`save_pretrained` (safetensors), so llmserve loads them exactly as it loads a real checkpoint."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

# A larger init than HF's 0.02 so logits are well separated: greedy choices among near-ties
# would make token-for-token comparisons flaky for reasons unrelated to correctness.
_COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, initializer_range=0.15)
_LLAMA_LIKE = dict(
    _COMMON, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256
)


def _llama() -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(**_LLAMA_LIKE, rope_theta=10000.0, tie_word_embeddings=False)


def _llama3_scaled_tied() -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(
        **_LLAMA_LIKE,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )


def _mistral() -> transformers.PretrainedConfig:
    return transformers.MistralConfig(**_LLAMA_LIKE, sliding_window=8)


def _qwen2() -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(**_LLAMA_LIKE, tie_word_embeddings=True)


def _qwen3() -> transformers.PretrainedConfig:
    return transformers.Qwen3Config(**_LLAMA_LIKE, head_dim=32, tie_word_embeddings=False)


def _gemma3() -> transformers.PretrainedConfig:
    return transformers.Gemma3TextConfig(
        **_LLAMA_LIKE,
        head_dim=32,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,  # != head_dim, so a wrong attention scale shows
    )


def _phi3() -> transformers.PretrainedConfig:
    # Phi-4-mini's partial rotary factor (a quarter of each head unrotated here) and Phi-3-mini-4k's
    # window on every layer; q, k, v and gate, up stored fused.
    return transformers.Phi3Config(
        **_LLAMA_LIKE, partial_rotary_factor=0.75, sliding_window=16, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip


def _smollm3() -> transformers.PretrainedConfig:
    # the second layer without RoPE (NoPE), as every fourth of SmolLM3's (two layers, not four: the
    # 16-bit cache tests' bounds are for two layers' rounding)
    return transformers.SmolLM3Config(
        **_LLAMA_LIKE, no_rope_layers=[1, 0], tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=0, pad_token_id=None,
    )  # fmt: skip


def _granite() -> transformers.PretrainedConfig:
    # Granite 3.1-8B's multipliers (attention 1/128 there is 1/64 here, not 1/sqrt(head_dim))
    return transformers.GraniteConfig(
        **_LLAMA_LIKE, embedding_multiplier=12.0, attention_multiplier=1 / 64, residual_multiplier=0.22,
        logits_scaling=8.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip


def _olmo2() -> transformers.PretrainedConfig:
    return transformers.Olmo2Config(
        **_LLAMA_LIKE, tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=None
    )


def _gemma2() -> transformers.PretrainedConfig:
    # soft caps low enough to bend this random model's scores and logits (Gemma 2's: 50 and 30)
    return transformers.Gemma2Config(
        **_LLAMA_LIKE, head_dim=32, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
    )  # fmt: skip


def _granite_moe() -> transformers.PretrainedConfig:
    return transformers.GraniteMoeConfig(
        **_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
        attention_multiplier=1 / 64, residual_multiplier=0.22, logits_scaling=8.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip


def _starcoder2() -> transformers.PretrainedConfig:
    return transformers.Starcoder2Config(
        **_LLAMA_LIKE, sliding_window=16, bos_token_id=None, eos_token_id=0, pad_token_id=None
    )


def _exaone4() -> transformers.PretrainedConfig:
    # the 32B's hybrid attention in two layers: a sliding layer with RoPE, a global one without
    return transformers.Exaone4Config(
        **_LLAMA_LIKE, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip


def _gpt2() -> transformers.PretrainedConfig:
    return transformers.GPT2Config(
        vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.15
    )


def _mixtral() -> transformers.PretrainedConfig:
    return transformers.MixtralConfig(**_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2)


def _qwen2_moe() -> transformers.PretrainedConfig:
    # A dense layer after a sparse one (mlp_only_layers), a shared expert, weights not renormalised.
    return transformers.Qwen2MoeConfig(
        **_LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False,
    )  # fmt: skip


def _qwen3_moe() -> transformers.PretrainedConfig:
    return transformers.Qwen3MoeConfig(
        **_LLAMA_LIKE, head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        norm_topk_prob=True,
    )  # fmt: skip


def _gpt_oss() -> transformers.PretrainedConfig:
    # Sliding layers of 8 positions (the parity prompts cross them), YaRN from an original context
    # of 32 (so its ramp and attention factor both show), widths that MXFP4's 32-element blocks
    # divide. 4 experts, top 2: with 8, this seed put a second and third choice so close that a
    # 16-bit KV cache or int4 weights flipped one token's routing (a jump, not drift).
    return transformers.GptOssConfig(
        **_LLAMA_LIKE, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 32,
        },
    )  # fmt: skip


TINY_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama": _llama,
    "llama3-rope-tied": _llama3_scaled_tied,
    "mistral-sliding": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "smollm3": _smollm3,
    "granite": _granite,
    "granite-moe": _granite_moe,
    "olmo2": _olmo2,
    "gemma2": _gemma2,
    "starcoder2": _starcoder2,
    "exaone4": _exaone4,
    "gpt2": _gpt2,
    "mixtral": _mixtral,
    "qwen2-moe": _qwen2_moe,
    "qwen3-moe": _qwen3_moe,
    "gpt-oss": _gpt_oss,
}


def _gpt_neox() -> transformers.PretrainedConfig:
    return transformers.GPTNeoXConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=256, rotary_pct=0.5, initializer_range=0.15, use_parallel_residual=True,
    )  # fmt: skip


def _phi() -> transformers.PretrainedConfig:
    return transformers.PhiConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=256, partial_rotary_factor=0.5, initializer_range=0.15,
    )  # fmt: skip


FALLBACK_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "gpt_neox": _gpt_neox,
    "phi": _phi,
}
"""Architectures with no native implementation: they run on transformers' modelling code."""


def save_tiny_tokenizer(folder: Path, vocab_size: int = 512, special: tuple[str, ...] = ()) -> None:
    """A byte-level BPE tokenizer trained on a few sentences and padded to exactly `vocab_size`
    ids (every id a sampler can pick decodes), with `<|endoftext|>` = 0 as EOS; `special`: added
    special tokens, the last ids in order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["The quick brown fox jumps over the lazy dog. 0123456789 naïve café."] * 50
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    extra = vocab_size - len(special) - tok.get_vocab_size()
    tok.add_tokens([f"<extra_{i}>" for i in range(extra)])
    tok.add_special_tokens(list(special))
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        '{"eos_token": "<|endoftext|>", "bos_token": null, "add_bos_token": false}'
    )


def reference_attention(config: transformers.PretrainedConfig) -> dict[str, str]:
    """transformers' attention kernel for a reference model: Gemma 2's soft cap on the scores runs
    only in its eager attention, and transformers before 5.2x (the GPU image's 5.17) picks SDPA
    for Gemma 2 by default, which drops the cap."""
    return {"attn_implementation": "eager"} if config.model_type == "gemma2" else {}


def make_tiny_model(
    name: str, folder: Path, seed: int = 0, special: tuple[str, ...] = ()
) -> transformers.PreTrainedModel:
    """Build, save (safetensors + a tokenizer, with `special` tokens last) and return the HF
    reference model for `name`."""
    torch.manual_seed(seed)
    config = {**TINY_CONFIGS, **FALLBACK_CONFIGS}[name]()
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, **reference_attention(config)
    )
    model.eval()
    if name == "starcoder2":  # its LayerNorms start at (1, 0): moved, so a path that drops a bias shows
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    save_tiny_tokenizer(Path(folder), config.vocab_size, special)
    return model


def assert_greedy_matches(got, expected: list[int], logprobs: list[torch.Tensor], atol: float = 1e-4) -> None:
    """An engine's `CompletionOutput` (greedy, with logprobs) against a reference's tokens and its
    log-softmax rows: the same tokens, every returned logprob within `atol`."""
    assert got.token_ids == expected
    for step, (lp, ref) in enumerate(zip(got.logprobs, logprobs, strict=True)):
        for token, value in lp.items():
            assert abs(value[0] - float(ref[token])) < atol, (step, token)


def make_tiny_model_eos0(folder: Path, special: tuple[str, ...] = ()) -> None:
    """The tiny Llama with EOS = the tokenizer's <|endoftext|> (0) only (transformers' Llama
    config defaults to eos 2, which this tokenizer spells '"', so a grammar's quote would end
    the output) and a 2048-token context; `special`: added special tokens, the last ids."""
    make_tiny_model("llama", folder, special=special)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            config = json.loads(path.read_text())
            config.update(eos_token_id=0, bos_token_id=None)
            if name == "config.json":  # room for tool descriptions in the prompt (RoPE takes any length)
                config["max_position_embeddings"] = 2048
            path.write_text(json.dumps(config))


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and the logits each was chosen from."""
    ids, logits = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            logits.append(hf(ids).logits[0, -1])
            ids = torch.cat([ids, logits[-1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist(), logits


IMAGE_TOKENS = ("<image_soft_token>", "<start_of_image>", "<end_of_image>")
"""The tiny VLM's image placeholder, begin and end tokens (Gemma 3's names), ids 509, 510, 511."""
GEMMA3_VLM_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
"""Gemma 3's chat template, cut to what the tiny VLM needs: an image part is `<start_of_image>`."""


def make_tiny_gemma3_vlm(
    folder: Path,
    seed: int = 0,
    image_token_last: bool = False,
    text: transformers.PretrainedConfig | None = None,
) -> transformers.PreTrainedModel:
    """A Gemma3ForConditionalGeneration: the tiny Gemma 3 text model and a 2-layer SigLIP tower
    on 32x32 images (8x8 patches, pooled to 16 image tokens), saved with a tokenizer whose last
    ids are the image tokens, a chat template with image parts, and a preprocessor_config.json.
    `image_token_last`: the placeholder is the last id (511, after boi 509 and eoi 510), as in
    Gemma 3's own vocabulary (262144, past the 262144 ids its GGUF files keep). `text`: another
    text config (vocabulary 512) than the tiny Gemma 3's."""
    torch.manual_seed(seed)
    text = text or _gemma3()
    text.max_position_embeddings = 512
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=32, patch_size=4, vision_use_head=False,
    )  # fmt: skip
    special = (IMAGE_TOKENS[1], IMAGE_TOKENS[2], IMAGE_TOKENS[0]) if image_token_last else IMAGE_TOKENS
    ids = {token: 509 + i for i, token in enumerate(special)}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=16, image_token_index=ids[IMAGE_TOKENS[0]],
        boi_token_index=ids[IMAGE_TOKENS[1]], eoi_token_index=ids[IMAGE_TOKENS[2]], initializer_range=0.15,
    )  # fmt: skip
    config.text_config.eos_token_id = 0
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF zero-initialises the projector: random weights, so images matter
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.3)
    model.save_pretrained(folder)
    save_tiny_tokenizer(Path(folder), text.vocab_size, special)
    path = Path(folder) / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    tok_config["chat_template"] = GEMMA3_VLM_TEMPLATE
    path.write_text(json.dumps(tok_config))
    (Path(folder) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "do_resize": True, "size": {"height": 32, "width": 32},
        "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
    }))  # fmt: skip
    return model


QWEN_VL_TOKENS = ("<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
"""The tiny Qwen VL models' video pad, vision start, end and image pad tokens, ids 508 to 511."""
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-VL's chat template, cut to what the tiny model needs (its im_start/end are plain text)."""


def make_tiny_qwen2_5_vl(
    folder: Path,
    seed: int = 0,
    tied: bool = False,
    vision_overrides: dict[str, Any] | None = None,
    pixels: tuple[int, int] = (16 * 16, 48 * 48),
) -> transformers.PreTrainedModel:
    """A Qwen2_5_VLForConditionalGeneration: a 2-layer Qwen2 text model with M-RoPE and a 4-block
    vision tower (patch 4, merge 2, windows of 2 x 2 merged cells; blocks 1 and 3 attend over the
    whole image, 0 and 2 within windows), saved with a tokenizer whose last ids are the vision
    tokens, a chat template with image parts, and a preprocessor_config.json (images resized to
    between 16 x 16 and 48 x 48 pixels' worth, multiples of 8). `tied`: the LM head is the
    embedding (the top-level config's flag, as Qwen2.5-VL 3B has it). `vision_overrides`: vision
    config values to change; `pixels`: the processor's (min_pixels, max_pixels)."""
    torch.manual_seed(seed)
    vision = dict(
        depth=4, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
        spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1, 3], out_hidden_size=64,
        initializer_range=0.15, tokens_per_second=2,
    ) | (vision_overrides or {})  # fmt: skip
    return _save_qwen_vl(folder, transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration,
                         vision, tied, pixels)  # fmt: skip


def make_tiny_qwen2_vl(
    folder: Path,
    seed: int = 0,
    vision_overrides: dict[str, Any] | None = None,
    pixels: tuple[int, int] = (16 * 16, 48 * 48),
) -> transformers.PreTrainedModel:
    """A Qwen2VLForConditionalGeneration: the text model, tokenizer and preprocessing of
    `make_tiny_qwen2_5_vl` with Qwen2-VL's 3-block vision tower (LayerNorms, a quick-GELU MLP).
    `vision_overrides` and `pixels` as there."""
    torch.manual_seed(seed)
    vision = dict(
        depth=3, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=4,
        temporal_patch_size=2, spatial_merge_size=2, hidden_act="quick_gelu", initializer_range=0.15,
    ) | (vision_overrides or {})  # fmt: skip
    return _save_qwen_vl(
        folder,
        transformers.Qwen2VLConfig,
        transformers.Qwen2VLForConditionalGeneration,
        vision,
        pixels=pixels,
    )


def make_tiny_qwen3_vl(folder: Path, seed: int = 0, moe: bool = False) -> transformers.PreTrainedModel:
    """A Qwen3VLForConditionalGeneration: a 2-layer Qwen3 text model (q/k norms) with interleaved
    M-RoPE and a 3-block vision tower (LayerNorms, a GELU(tanh) MLP, a 4 x 4 table of learned
    position embeddings) whose blocks 0 and 2 feed DeepStack into text layers 0 and 1; the
    tokenizer and preprocessing of `make_tiny_qwen2_5_vl`. `moe`: a Qwen3VLMoeForConditionalGeneration,
    each text layer 4 experts of 24 units, 2 a token (its experts saved stacked)."""
    torch.manual_seed(seed)
    vision = dict(
        depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 2],
        hidden_act="gelu_pytorch_tanh", initializer_range=0.15,
    )  # fmt: skip
    text: dict[str, Any] = {"head_dim": 16, "mrope_interleaved": True}
    if not moe:
        classes = (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration)
        return _save_qwen_vl(folder, *classes, vision, text=text)
    text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
    classes = (transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration)
    return _save_qwen_vl(folder, *classes, vision, text=text)


def _save_qwen_vl(
    folder: Path,
    config_cls,
    model_cls,
    vision: dict,
    tied: bool = False,
    pixels: tuple[int, int] = (16 * 16, 48 * 48),
    text: dict | None = None,
) -> transformers.PreTrainedModel:
    extra = dict(text or {})
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    if extra.pop("mrope_interleaved", False):
        rope["mrope_interleaved"] = True
    text = dict(
        _LLAMA_LIKE, max_position_embeddings=512, eos_token_id=0, bos_token_id=None, rope_parameters=rope, **extra
    )  # fmt: skip
    config = config_cls(
        text_config=text, vision_config=vision, image_token_id=511, video_token_id=508,
        vision_start_token_id=509, vision_end_token_id=510, tie_word_embeddings=tied,
    )  # fmt: skip
    model = model_cls(config).eval()
    model.save_pretrained(folder)
    save_tiny_tokenizer(Path(folder), 512, QWEN_VL_TOKENS)
    path = Path(folder) / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    tok_config["chat_template"] = QWEN_VL_TEMPLATE
    path.write_text(json.dumps(tok_config))
    (Path(folder) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": pixels[0], "max_pixels": pixels[1],
        "patch_size": vision["patch_size"], "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    }))  # fmt: skip
    (Path(folder) / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen2VLVideoProcessor", "size": {"shortest_edge": pixels[0], "longest_edge": pixels[1]},
        "patch_size": vision["patch_size"], "temporal_patch_size": 2, "merge_size": 2,
    }))  # fmt: skip
    return model
