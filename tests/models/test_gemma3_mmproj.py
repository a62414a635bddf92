"""Gemma 3 from two GGUF files, the language model and llama.cpp's vision projector (`mmproj`),
against transformers' Gemma3ForConditionalGeneration on the same tiny random checkpoint.

The files are written the way llama.cpp's convert_hf_to_gguf.py writes them (Gemma3Model for
the text, Gemma3VisionModel for the projector): gguf's own HF -> GGUF name map, Gemma's norms
stored as 1 + w (the projector's soft-embedding norm only; SigLIP's LayerNorms as they are), the
projector as the published `mmproj-*-f16.gguf` files are (`--outtype f16`: the tower's matrices and
the input projection F16, the patch and position embeddings forced to F32, vectors F32), the text
model F32; the reference's F16 tensors are rounded to half floats first, so the parity is exact. Two
vocabularies: with the image placeholder, and without it, as Gemma 3's own GGUF files are (the
loader then adds it as the next id, transformers' id for it)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from llmserve.engine.llm import LLM
from llmserve.sampling_params import SamplingParams
from tests.gguf_writer import add_bpe_vocab, convert_state_dict, hf_metadata, hf_vocab, write_gguf
from tests.models.test_gemma3_vision import PROMPT, _pixels, make_image
from tests.models.tiny import GEMMA3_VLM_TEMPLATE, make_tiny_gemma3_vlm

NUM_TOKENS = 8


def text_gguf(path: Path, hf, folder: Path, keep_image_token: bool) -> Path:
    """The language model as Gemma3Model converts it, with the folder's tokenizer as a gpt2
    vocabulary (tokenizer.json's tokens, added ones CONTROL or USER_DEFINED, its merges)."""
    config = hf.config.text_config
    tokens, types, merges = hf_vocab(folder)
    if not keep_image_token:  # Gemma 3's GGUF: the placeholder (the last id) is not in the vocabulary
        assert tokens[-1] == "<image_soft_token>"
        tokens, types = tokens[:-1], types[:-1]
    state = {
        k.replace("model.language_model.", "model."): v
        for k, v in hf.state_dict().items()
        if k.startswith("model.language_model.")
    }
    tensors = convert_state_dict("gemma3", config, state)
    tensors["token_embd.weight"] = tensors["token_embd.weight"][: len(tokens)]  # "remove OOV rows"
    base = hf_metadata("gemma3", config)

    def metadata(w: gguf.GGUFWriter) -> None:
        base(w)
        add_bpe_vocab(w, (tokens, types, merges), "gpt-2")
        w.add_chat_template(GEMMA3_VLM_TEMPLATE)

    return write_gguf(path, "gemma3", dict(tensors), metadata)[0]


def mmproj_gguf(path: Path, hf, matrices: Q = Q.F16) -> Path:
    """The vision tower and projector as Gemma3VisionModel converts them (MmprojModel's keys).
    `matrices`: the tower's matrices' type (`--outtype f16` or `q8_0`; Q8_0 falls back to F16
    for rows that are not whole blocks of 32, as the converter does)."""
    vision, text = hf.config.vision_config, hf.config.text_config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    tensors: dict[str, tuple[np.ndarray, Q]] = {}
    for name, w in hf.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            continue
        # the converter reads transformers 4's names: `vision_tower.vision_model.*`
        name = name.removeprefix("model.").replace("vision_tower.", "vision_tower.vision_model.")
        name = name.replace("_weight", ".weight")
        w = w.detach().float()
        if "soft_emb_norm.weight" in name:
            w = w + 1
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        qtype = Q.F16 if _stored_f16(name, w) else Q.F32
        if matrices == Q.Q8_0 and qtype == Q.F16 and "input_projection" not in name and w.shape[-1] % 32 == 0:
            qtype = Q.Q8_0  # (the input projection: F16 whatever the outtype, tensor_force_quant)
        tensors[gguf_name] = (np.ascontiguousarray(w.numpy()), qtype)

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_type(gguf.GGUFType.MMPROJ)
        w.add_clip_has_vision_encoder(True)
        w.add_vision_projection_dim(text.hidden_size)
        w.add_vision_image_size(vision.image_size)
        w.add_vision_patch_size(vision.patch_size)
        w.add_vision_embedding_length(vision.hidden_size)
        w.add_vision_feed_forward_length(vision.intermediate_size)
        w.add_vision_block_count(vision.num_hidden_layers)
        w.add_vision_head_count(vision.num_attention_heads)
        w.add_vision_image_mean([0.5, 0.5, 0.5])
        w.add_vision_image_std([0.5, 0.5, 0.5])
        w.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
        w.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
        w.add_vision_use_gelu(True)
        # 8 patches a side pooled to 4 tokens a side: written because it is not 4
        w.add_vision_projector_scale_factor((vision.image_size // vision.patch_size) // 4)

    return write_gguf(path, "clip", tensors, metadata)[0]  # type: ignore[arg-type]


def make_gguf_vlm(folder: Path, keep_image_token: bool = False) -> tuple[object, Path, Path]:
    """The tiny VLM in `folder` (the HF reference, returned) and as `model.gguf` + `mmproj.gguf` there."""
    hf = make_hf_vlm(folder)
    text = text_gguf(folder / "model.gguf", hf, folder, keep_image_token)
    return hf, text, mmproj_gguf(folder / "mmproj.gguf", hf)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-vlm-last")
    return make_hf_vlm(folder), folder


def make_hf_vlm(folder: Path):
    # a text config a GGUF file describes whole: llama.cpp hard-codes every 6th layer global and
    # query_pre_attn_scalar = head_dim (gguf_config.gemma3_config)
    text = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        max_position_embeddings=512, initializer_range=0.15,
    )  # fmt: skip
    hf = make_tiny_gemma3_vlm(folder, image_token_last=True, text=text)
    with torch.no_grad():  # what the converter stores as F16, rounded in the reference too
        for name, w in hf.state_dict().items():
            if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) and _stored_f16(
                name, w
            ):
                w.copy_(w.half().float())
    return hf


def _stored_f16(name: str, w: torch.Tensor) -> bool:
    """--outtype f16: matrices F16, vectors F32; Gemma3VisionModel.tensor_force_quant: the
    embeddings F32, the input projection F16 (whatever the outtype)."""
    return "input_projection" in name or (w.dim() >= 2 and ".embeddings." not in name)


def hf_greedy(hf, ids: list[int], pixels: torch.Tensor, n: int, vocab: int):
    """transformers' greedy tokens and log-probabilities over the first `vocab` ids (a GGUF file
    without the placeholder has one logit fewer)."""
    x, out, logprobs = torch.tensor([ids]), [], []
    with torch.no_grad():
        for _ in range(n):
            token_type_ids = (x == hf.config.image_token_id).long()
            logits = hf(input_ids=x, pixel_values=pixels, token_type_ids=token_type_ids).logits[0, -1, :vocab]
            logprobs.append(torch.log_softmax(logits.float(), -1))
            out.append(int(logits.argmax()))
            x = torch.cat([x, torch.tensor([[out[-1]]])], dim=1)
    return out, logprobs


@pytest.mark.parametrize("keep_image_token", [True, False], ids=["placeholder-in-vocab", "gemma3-vocab"])
def test_gguf_with_mmproj_matches_transformers(checkpoint, tmp_path, keep_image_token) -> None:
    hf, folder = checkpoint
    text = text_gguf(tmp_path / "model.gguf", hf, folder, keep_image_token)
    mmproj = mmproj_gguf(tmp_path / "mmproj-model.gguf", hf)
    llm = LLM(str(text), mmproj=str(mmproj), block_size=4, show_progress=False)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
    images = [make_image(0), make_image(1, (90, 7))]
    outputs = llm.generate(
        [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images], params, use_tqdm=False
    )
    vocab = 512 if keep_image_token else 511
    for out, image in zip(outputs, images, strict=True):
        expected, logprobs = hf_greedy(hf, out.prompt_token_ids, _pixels(folder, image), NUM_TOKENS, vocab)
        assert out.outputs[0].token_ids == expected
        for lp, ref in zip(out.outputs[0].logprobs, logprobs, strict=True):
            assert all(abs(value[0] - float(ref[token])) < 1e-4 for token, value in lp.items())
    assert outputs[0].prompt_token_ids.count(511) == 16  # the placeholder is transformers' id

    # the chat template and the image tokens give the HF folder's prompt ids
    folder_llm = LLM(str(folder), block_size=4, show_progress=False)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "fox?"}]}]
    for engine in (llm.engine, folder_llm.engine):
        text = engine.tokenizer.apply_chat_template(messages)
        ids = engine.process_inputs(text, params, [images[0]], add_special_tokens=False).token_ids
        if engine is llm.engine:
            gguf_ids = ids
    assert gguf_ids == ids


def test_mmproj_refusals(checkpoint, tmp_path) -> None:
    hf, folder = checkpoint
    text = text_gguf(tmp_path / "model.gguf", hf, folder, False)
    mmproj = mmproj_gguf(tmp_path / "mmproj.gguf", hf)
    with pytest.raises(ValueError, match="not a vision projector"):
        LLM(str(text), mmproj=str(text), show_progress=False)
    with pytest.raises(ValueError, match="for GGUF models"):
        LLM(str(folder), mmproj=str(mmproj), show_progress=False)
    with pytest.raises(ValueError, match="must be a .gguf file"):
        LLM(str(text), mmproj=str(folder), show_progress=False)
    # a typed placeholder without an image: refused, as transformers refuses it
    llm = LLM(str(text), mmproj=str(mmproj), show_progress=False)
    with pytest.raises(ValueError, match="image placeholder token 511"):
        llm.generate("a <image_soft_token> b", SamplingParams(max_tokens=2), use_tqdm=False)


def test_q8_0_mmproj_within_its_quantization(checkpoint, tmp_path) -> None:
    """A Q8_0 projector (blocks kept: the tower's layers run llmserve's q8 kernels) beside the F32
    language model (which stays float): transformers' greedy tokens, logprobs within what 8-bit
    weights move them, and not the F16 file's answers (the blocks are what runs)."""
    hf, folder = checkpoint
    text = text_gguf(tmp_path / "model.gguf", hf, folder, True)
    q8 = mmproj_gguf(tmp_path / "mmproj-q8_0.gguf", hf, Q.Q8_0)
    assert sum(t.tensor_type == Q.Q8_0 for t in gguf.GGUFReader(q8).tensors) >= 8  # the blocks' matrices
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
    runs = {}
    for name, mmproj in (("q8_0", q8), ("f16", mmproj_gguf(tmp_path / "mmproj-f16.gguf", hf))):
        llm = LLM(str(text), mmproj=str(mmproj), block_size=4, show_progress=False)
        runs[name] = llm.generate(
            {"prompt": PROMPT, "multi_modal_data": {"image": make_image(0)}}, params, use_tqdm=False
        )[0]
        if name == "q8_0":
            assert "q8" in llm.engine.loaded.linear_kernel and "float" in llm.engine.loaded.linear_kernel
    out = runs["q8_0"]
    expected, logprobs = hf_greedy(hf, out.prompt_token_ids, _pixels(folder, make_image(0)), NUM_TOKENS, 512)
    assert out.outputs[0].token_ids == expected
    errors = [
        abs(v[0] - float(ref[t]))
        for lp, ref in zip(out.outputs[0].logprobs, logprobs, strict=True)
        for t, v in lp.items()
    ]
    assert 0 < max(errors) < 0.1
    assert out.outputs[0].logprobs != runs["f16"].outputs[0].logprobs
