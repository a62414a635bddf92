"""Qwen2-VL from two GGUF files, the language model (`qwen2vl`) and llama.cpp's vision projector
(projector type qwen2vl_merger), against transformers' Qwen2VLForConditionalGeneration on the same
tiny random checkpoint.

The files come as in test_qwen2_5_vl_mmproj.py: llama.cpp's convert_hf_to_gguf.py where its sources
are unpacked, else the gguf writer following it, and the two checked equal where both run. What
differs from Qwen2.5-VL: LayerNorms with biases (ln1, ln2, post_ln), a two-layer quick-GELU MLP
(fc1 / fc2 as ffn_up / ffn_down), no windows, and a feed-forward length the converter writes as
the text width (Qwen2-VL's config has no `intermediate_size`): the tiny tower's MLP is 3x its
width, 96, so a loader that believed the key would build a 64-wide MLP and fail.
"""

from __future__ import annotations

import re

import pytest

from llmserve.engine.llm import LLM
from tests.models.test_qwen2_5_vl_mmproj import (
    _check,
    _generate,
    _rewrite,
    _with_projector_weights,
    tiny_model_files,
)
from tests.models.test_qwen2_5_vl_mmproj import (
    test_the_fallback_writer_writes_what_the_converter_writes as _same_files,
)
from tests.models.tiny import make_tiny_qwen2_vl


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tiny_model_files(tmp_path_factory.mktemp("qwen2_vl_gguf"), make_tiny_qwen2_vl, mlp_ratio=3)


def test_the_fallback_writer_writes_what_the_converter_writes(files) -> None:
    _same_files(files)


def test_f32_projector_matches_transformers(files) -> None:
    hf, folder, f = files
    llm, outputs = _generate(f["text"], f["f32"])
    _check(hf, folder, outputs)
    model = llm.engine.loaded.model
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert model.visual.blocks[0].mlp.fc1.weight.shape == (96, 32)  # the MLP's width from fc1, not the key
    assert outputs[0].prompt_token_ids.count(511) == 48  # 224 x 168: 16 x 12 patches, 8 x 6 tokens


@pytest.mark.parametrize("outtype", ["f16", "bf16"])
def test_16_bit_projector_is_exact_on_its_weights(files, outtype) -> None:
    hf, folder, f = files
    _, outputs = _generate(f["text"], f[outtype])
    _check(_with_projector_weights(hf, f[outtype]), folder, outputs)


def test_q8_0_projector_within_its_quantization(files) -> None:
    """Q8_0 (the tower's layers run llmserve's q8 kernels) against the reference holding the
    file's dequantized weights: the same greedy tokens, logprobs within the kernels' int16
    activation rounding. (Against the float model, this tiny random tower's 8-bit weights change
    a greedy token of one image's answer: the float model is no reference here.)"""
    hf, folder, f = files
    llm, outputs = _generate(f["text"], f["q8_0"])
    assert type(llm.engine.loaded.model.visual.blocks[0].mlp.fc1).__name__ == "QuantizedLinear"
    _check(_with_projector_weights(hf, f["q8_0"]), folder, outputs, atol=1e-2)


def test_incomplete_or_mismatched_projectors_are_refused(files, tmp_path) -> None:
    f = files[2]
    # a LayerNorm's bias, the MLP's second layer, the merger's LayerNorm
    for name in ("v.blk.1.ln2.bias", "v.blk.0.ffn_down.weight", "v.post_ln.bias"):
        broken = _rewrite(f["f32"], tmp_path / "broken.gguf", drop=name)
        with pytest.raises(ValueError, match=r"broken\.gguf: .*'qwen2vl_merger'.*" + re.escape(repr(name))):
            LLM(str(f["text"]), mmproj=str(broken), show_progress=False)
    # a Qwen2-VL projector's tensors under Qwen2.5-VL's type: its gated MLP is not there
    relabelled = _rewrite(
        f["f32"], tmp_path / "as25.gguf", fields={"clip.projector_type": "qwen2.5vl_merger"}
    )
    with pytest.raises(ValueError, match=r"as25\.gguf: .*lacks tensor 'v\.blk\.0\.ffn_gate\.weight'"):
        LLM(str(f["text"]), mmproj=str(relabelled), show_progress=False)
    # a tower width the MLP's rows are no multiple of
    narrow = _rewrite(f["f32"], tmp_path / "narrow.gguf", fields={"clip.vision.embedding_length": 40})
    with pytest.raises(
        ValueError, match=r"narrow\.gguf: v\.blk\.0\.ffn_up\.weight has 96 rows, not a multiple"
    ):
        LLM(str(f["text"]), mmproj=str(narrow), show_progress=False)
    # the language model's file as the projector
    with pytest.raises(ValueError, match="not a vision projector"):
        LLM(str(f["text"]), mmproj=str(f["text"]), show_progress=False)
