"""Qwen2.5-VL from two GGUF files, the language model (`qwen2vl`) and llama.cpp's vision projector
(`mmproj`, projector type qwen2.5vl_merger), against transformers' Qwen2_5_VLForConditionalGeneration
on the same tiny random checkpoint.

The files come from llama.cpp's own convert_hf_to_gguf.py run on the saved folder where its sources
are unpacked (benchmarks/peers/build_llama_server.sh): the outside reference for names, the split
Conv3d patch kernel, the split qkv, `rope.dimension_sections`, `n_wa_pattern`. The text file F32,
the projector F32, F16 and Q8_0 (`--mmproj --outtype`). Its BPE pre-tokenizer check, which
recognises real tokenizers by a hash, is told the tiny one is Qwen2's. Elsewhere (CI) the gguf
package's writer writes them following the converter; where both can run, the two are checked
equal, tensor by tensor and key by key.

The tiny tower has Qwen2.5-VL's patch 14 and window 112 (what clip.cpp uses: the files do not
store it), so a 224 x 168 image has 2 x 2 windows; the processor's pixel bounds are clip.cpp's
(8 and 4096 tokens), so the HF processor and the projector's metadata preprocess alike.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from llmserve.engine.llm import LLM
from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint
from llmserve.multimodal.qwen_vl import CLIP_MEAN, CLIP_STD
from llmserve.sampling_params import SamplingParams
from tests.gguf_writer import add_bpe_vocab, convert_state_dict, hf_metadata, hf_vocab, write_gguf
from tests.models.test_qwen2_5_vl import PROMPT, _hf_images, hf_generate, make_image
from tests.models.tiny import QWEN_VL_TEMPLATE, assert_greedy_matches, make_tiny_qwen2_5_vl

NUM_TOKENS = 8
PEERS = Path(os.environ.get("LLMSERVE_PEERS_DIR", Path.home() / ".cache/llmserve/peers"))  # as benchmarks/
LLAMA_CPP = PEERS / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
CELL = 28 * 28  # pixels a token: patch 14, merge 2
IMAGES = ((0, (224, 168)), (1, (60, 40)))  # 2 x 2 windows; one scaled up to min_pixels
# convert_hf_to_gguf.py with the tiny tokenizer taken as Qwen2's pre-tokenizer
_CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(folder: Path, out: Path, outtype: str, mmproj: bool = False) -> Path:
    args = [str(LLAMA_CPP), str(folder), "--outtype", outtype, "--outfile", str(out)]
    cmd = [sys.executable, "-c", _CONVERT, *args, *(["--mmproj"] if mmproj else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def convert_missing() -> str | None:
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        return f"no llama.cpp sources at {LLAMA_CPP} (benchmarks/peers/build_llama_server.sh)"
    return None


def write_text(folder: Path, hf, out: Path) -> Path:
    """The language model as Qwen2VLModel converts it: Qwen2's tensors, M-RoPE's sections padded
    to four, the folder's tokenizer as a gpt2 vocabulary with Qwen2's pre-tokenizer."""
    config = hf.config.text_config
    state = {k.replace("model.language_model.", "model."): v for k, v in hf.state_dict().items()}
    state = {k: v for k, v in state.items() if not k.startswith("model.visual.")}
    tensors = convert_state_dict("qwen2vl", config, state)
    tokens, types, merges = hf_vocab(folder)
    base = hf_metadata("qwen2vl", config)

    def metadata(w: gguf.GGUFWriter) -> None:
        base(w)
        w.add_type(gguf.GGUFType.MODEL)
        add_bpe_vocab(w, (tokens, types, merges), "qwen2")
        w.add_rope_dimension_sections([*config.rope_parameters["mrope_section"], 0])
        w.add_chat_template(QWEN_VL_TEMPLATE)

    return write_gguf(out, "qwen2vl", dict(tensors), metadata)[0]


def _projector_type(name: str, w: torch.Tensor, outtype: Q) -> Q:
    """The converter's choice: vectors F32; the patch kernel F16 in F16 files, else F32; Q8_0's
    matrices F16 where a row is not whole blocks of 32."""
    if w.dim() == 1 or outtype == Q.F32:
        return Q.F32
    if "patch_embd" in name:
        return Q.F16 if outtype == Q.F16 else Q.F32
    return Q.F16 if outtype == Q.Q8_0 and w.shape[-1] % 32 else outtype


def write_mmproj(hf, out: Path, outtype: Q) -> Path:
    """The vision tower and merger as Qwen2VLVisionModel converts them (MmprojModel's keys): qkv
    cut into q, k, v; the Conv3d patch kernel into one 2-D kernel per frame. Qwen2-VL's config
    names the tower's width `embed_dim` and has no `intermediate_size`: the converter writes its
    `hidden_size` (the text width) as the feed-forward length, and no activation or windows."""
    vision, text = hf.config.vision_config, hf.config.text_config
    qwen2 = hf.config.model_type == "qwen2_vl"
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.depth)
    tensors: dict[str, tuple[np.ndarray, Q]] = {}
    for name, w in hf.state_dict().items():
        if not name.startswith("model.visual."):
            continue
        name, w = name.removeprefix("model."), w.detach().float()
        if "patch_embed" in name:  # [C, 3, T, P, P] -> T kernels [C, 3, P, P]
            pieces = [("v.patch_embd.weight", w[:, :, 0]), ("v.patch_embd.weight.1", w[:, :, 1])]
        else:
            cut = (
                zip((name.replace("qkv", x) for x in "qkv"), w.chunk(3), strict=True)
                if ".qkv." in name
                else [(name, w)]
            )
            pieces = [(name_map.get_name(n, try_suffixes=(".weight", ".bias")), t) for n, t in cut]
        for gguf_name, t in pieces:
            tensors[gguf_name] = (np.ascontiguousarray(t.numpy()), _projector_type(gguf_name, t, outtype))

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_type(gguf.GGUFType.MMPROJ)
        w.add_clip_has_vision_encoder(True)
        w.add_vision_projection_dim(text.hidden_size)
        w.add_vision_image_size(560)  # the converter's default; clip.cpp warms up with it only
        w.add_vision_patch_size(vision.patch_size)
        w.add_vision_embedding_length(vision.embed_dim if qwen2 else vision.hidden_size)
        w.add_vision_feed_forward_length(vision.hidden_size if qwen2 else vision.intermediate_size)
        w.add_vision_block_count(vision.depth)
        w.add_vision_head_count(vision.num_heads)
        w.add_vision_image_mean(list(CLIP_MEAN))
        w.add_vision_image_std(list(CLIP_STD))
        if qwen2:
            w.add_clip_projector_type(gguf.VisionProjectorType.QWEN2VL)
        else:
            w.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
            w.add_vision_use_silu(True)
            w.add_vision_n_wa_pattern(vision.fullatt_block_indexes[0] + 1)
        w.add_vision_attention_layernorm_eps(1e-6)

    return write_gguf(out, "clip", tensors, metadata)[0]  # type: ignore[arg-type]


OUTTYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}


def make_files(folder: Path, hf, use_converter: bool) -> dict[str, Path]:
    if use_converter:
        out = {"text": convert(folder, folder / "model-f32.gguf", "f32")}
        return out | {t: convert(folder, folder / f"mmproj-{t}.gguf", t, mmproj=True) for t in OUTTYPES}
    out = {"text": write_text(folder, hf, folder / "w-model-f32.gguf")}
    return out | {t: write_mmproj(hf, folder / f"w-mmproj-{t}.gguf", q) for t, q in OUTTYPES.items()}


def tiny_model_files(folder: Path, make_tiny, **vision_overrides) -> tuple[Any, Path, dict[str, Path]]:
    """A tiny model made by `make_tiny` in `folder` with patch 14 and clip.cpp's pixel bounds,
    and its GGUF files (`make_files`: the converter's where it runs)."""
    hf = make_tiny(
        folder, vision_overrides={"patch_size": 14, **vision_overrides}, pixels=(8 * CELL, 4096 * CELL)
    )
    return hf, folder, make_files(folder, hf, convert_missing() is None)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tiny_model_files(tmp_path_factory.mktemp("qwen2_5_vl_gguf"), make_tiny_qwen2_5_vl, window_size=112)


def test_the_fallback_writer_writes_what_the_converter_writes(files) -> None:
    """Every tensor (name, type, shape, bytes) and metadata value alike, but the converter's
    naming and size labels."""
    if why := convert_missing():
        pytest.skip(why)
    hf, folder, converted = files
    written = make_files(folder, hf, use_converter=False)
    for kind in ("text", *OUTTYPES):
        assert_same_gguf(written[kind], converted[kind])


def assert_same_gguf(ours: Path, theirs: Path) -> None:
    """Two GGUF files alike: every metadata value but the tool's naming, size and type labels,
    every tensor's name, type, shape and bytes."""
    mine, other = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)
    skip = ("general.name", "general.size_label", "general.file_type", "general.quantization_version")
    fields = {k: f.contents() for k, f in other.fields.items() if not k.startswith(("GGUF.", *skip))}
    assert {k: mine.fields[k].contents() for k in fields if k in mine.fields} == fields, ours
    assert not {k for k in mine.fields if not k.startswith(("GGUF.", *skip))} - fields.keys(), ours
    tensors = {t.name: t for t in mine.tensors}
    assert sorted(tensors) == sorted(t.name for t in other.tensors), ours
    for t in other.tensors:
        got = tensors[t.name]
        assert (got.tensor_type, got.shape.tolist()) == (t.tensor_type, t.shape.tolist()), (ours, t.name)
        assert np.array_equal(np.asarray(got.data), np.asarray(t.data)), (ours, t.name)


def _generate(text: Path, mmproj: Path, **kw):
    llm = LLM(str(text), mmproj=str(mmproj), block_size=4, show_progress=False, **kw)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": make_image(s, size)}} for s, size in IMAGES]
    return llm, llm.generate(prompts, params, use_tqdm=False)


def _check(hf, folder, outputs, atol: float = 1e-4) -> None:
    for out, (seed, size) in zip(outputs, IMAGES, strict=True):
        images = _hf_images(folder, [make_image(seed, size)])
        assert out.prompt_token_ids.count(511) == int(images["image_grid_thw"][0].prod()) // 4
        assert_greedy_matches(
            out.outputs[0], *hf_generate(hf, out.prompt_token_ids, images, NUM_TOKENS), atol
        )


def test_f32_projector_matches_transformers(files) -> None:
    hf, folder, f = files
    llm, outputs = _generate(f["text"], f["f32"])
    _check(hf, folder, outputs)
    assert type(llm.engine.loaded.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert outputs[0].prompt_token_ids.count(511) == 48  # 224 x 168: 16 x 12 patches, 8 x 6 tokens
    # the GGUF's chat template and vocabulary give the HF folder's prompt ids for a chat with an image
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "fox?"}]}]
    params, image = SamplingParams(max_tokens=1), [make_image(*IMAGES[0])]
    ids = [
        engine.process_inputs(engine.tokenizer.apply_chat_template(messages), params, image).token_ids
        for engine in (llm.engine, LLM(str(folder), show_progress=False).engine)
    ]
    assert ids[0] == ids[1] and ids[0].count(511) == 48


@pytest.mark.parametrize("outtype", ["f16", "bf16"])
def test_16_bit_projector_is_exact_on_its_weights(files, outtype) -> None:
    """The F16 / BF16 file (matrices 16-bit, vectors F32, as the converter writes them) against
    the reference with those weights rounded alike: exact parity."""
    hf, folder, f = files
    _, outputs = _generate(f["text"], f[outtype])
    _check(_with_projector_weights(hf, f[outtype]), folder, outputs)


def test_q8_0_projector_within_its_quantization(files) -> None:
    """Q8_0 (its blocks kept: the tower's layers run llmserve's q8 kernels) against the float
    model: the same greedy tokens, logprobs within what 8-bit weights move them; against the
    reference holding the file's dequantized weights, the first token's logprobs within the
    kernels' int16 activation rounding (several times closer: the file's weights are what runs)."""
    hf, folder, f = files
    llm, outputs = _generate(f["text"], f["q8_0"])
    model = llm.engine.loaded.model  # the tower's layers from the file's blocks; the F32 text stays float
    assert type(model.visual.blocks[0].attn.qkv).__name__ == "QuantizedLinear"
    assert type(model.model.layers[0].self_attn.qkv_proj).__name__ == "Linear"
    _check(hf, folder, outputs, atol=0.1)
    dequantized = _with_projector_weights(hf, f["q8_0"])
    for out, (seed, size) in zip(outputs, IMAGES, strict=True):
        images = _hf_images(folder, [make_image(seed, size)])
        (ref,) = hf_generate(dequantized, out.prompt_token_ids, images, 1)[1]
        (ref_float,) = hf_generate(hf, out.prompt_token_ids, images, 1)[1]
        got = out.outputs[0].logprobs[0]
        error = max(abs(v[0] - float(ref[t])) for t, v in got.items())
        assert error < 1e-2
        assert error < max(abs(v[0] - float(ref_float[t])) for t, v in got.items())


def test_language_model_alone_is_qwen2(files) -> None:
    """The `qwen2vl` text file without a projector: text positions are equal on M-RoPE's three
    axes, which is plain RoPE; it answers text prompts as the VL model does."""
    hf, _, f = files
    llm = LLM(str(f["text"]), block_size=4, show_progress=False)
    assert type(llm.engine.loaded.model).__name__ == "Qwen2ForCausalLM"
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
    out = llm.generate("The lazy dog", params, use_tqdm=False)[0]
    assert_greedy_matches(out.outputs[0], *hf_generate(hf, out.prompt_token_ids, {}, NUM_TOKENS))


def _with_projector_weights(hf, mmproj: Path):
    """A copy of `hf` whose vision tower (and projector) holds the projector file's weights,
    dequantized: every tensor of the file, and every one of the model's outside its language model."""
    import copy

    ref = copy.deepcopy(hf)
    state = {name: t for name, t, _ in GGUFCheckpoint([mmproj]).iter_weights(torch.float32)}
    # transformers 5 names Gemma 3's SigLIP `model.vision_tower.*` (the loader reads 4's names)
    state = {k.replace("vision_tower.vision_model.", "vision_tower."): v for k, v in state.items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert (
        state and not unexpected and all(m.startswith(("model.language_model.", "lm_head.")) for m in missing)
    )
    return ref


def _rewrite(
    src: Path, dst: Path, drop: str = "", fields: dict | None = None, quantize: Q | None = None
) -> Path:
    """`src` copied with the tensor or metadata key `drop` left out and `fields` replaced;
    `quantize`: the tensors llama-quantize quantizes (`llama_quantizable`) in that type."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", drop):
            continue
        value = (fields or {}).get(key, field.contents())
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name == drop:
            continue
        shape = [int(x) for x in reversed(t.shape.tolist())]
        data, qtype = np.asarray(t.data), t.tensor_type
        if quantize is not None and llama_quantizable(t.name, shape):
            data = dequantize(data, qtype).reshape(shape)
            qtype = quantize if shape[-1] % 32 == 0 else Q.F16  # llama-quantize's fallback
            data = gguf.quants.quantize(data, qtype)
        writer.add_tensor(t.name, data, raw_shape=data.shape if qtype > 1 else shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def llama_quantizable(name: str, shape: list[int]) -> bool:
    """What llama-quantize quantizes in a projector file: matrices named `*weight`, but the patch
    and position embeddings (a norm here is a vector)."""
    return (
        len(shape) == 2
        and name.endswith("weight")
        and not any(x in name for x in (".position_embd", ".patch_embd", ".patch_merger"))
    )


def test_mismatched_or_incomplete_projectors_are_refused(files, tmp_path) -> None:
    f = files[2]
    # a projector of another type than the language model's
    gemma_type = _rewrite(f["f32"], tmp_path / "gemma.gguf", fields={"clip.projector_type": "gemma3"})
    with pytest.raises(ValueError, match=r"gemma\.gguf: a 'gemma3' vision projector .* is 'qwen2vl'"):
        LLM(str(f["text"]), mmproj=str(gemma_type), show_progress=False)
    unknown = _rewrite(f["f32"], tmp_path / "u.gguf", fields={"clip.projector_type": "qwen3vl_merger"})
    with pytest.raises(
        ValueError, match=r"u\.gguf: vision projector type 'qwen3vl_merger' \(clip.projector_type\)"
    ):
        LLM(str(f["text"]), mmproj=str(unknown), show_progress=False)
    # tensors missing: a block's, and the second half of the patch kernel
    for name in ("v.blk.2.attn_k.weight", "v.patch_embd.weight.1", "mm.2.bias"):
        broken = _rewrite(f["f32"], tmp_path / "broken.gguf", drop=name)
        with pytest.raises(ValueError, match=r"broken\.gguf: .*" + re.escape(repr(name))):
            LLM(str(f["text"]), mmproj=str(broken), show_progress=False)
    # a key the projector type needs (clip.cpp requires it too)
    broken = _rewrite(f["f32"], tmp_path / "no-key.gguf", drop="clip.vision.n_wa_pattern")
    with pytest.raises(ValueError, match=r"no-key\.gguf: GGUF metadata lacks clip\.vision\.n_wa_pattern"):
        LLM(str(f["text"]), mmproj=str(broken), show_progress=False)
    # a projector for a text model of another width
    wide = _rewrite(f["f32"], tmp_path / "wide.gguf", fields={"clip.vision.projection_dim": 128})
    with pytest.raises(ValueError, match=r"wide\.gguf: the projector's output width 128"):
        LLM(str(f["text"]), mmproj=str(wide), show_progress=False)
    # the language model's file as the projector
    with pytest.raises(ValueError, match="not a vision projector"):
        LLM(str(f["text"]), mmproj=str(f["text"]), show_progress=False)
