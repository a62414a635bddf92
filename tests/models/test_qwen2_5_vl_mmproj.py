"""Qwen2.5-VL from two GGUF files, the language model (`qwen2vl`) and llama.cpp's vision projector
(`mmproj`, projector type qwen2.5vl_merger), against transformers' Qwen2_5_VLForConditionalGeneration
on the same tiny random checkpoint.

Both files come from llama.cpp's own convert_hf_to_gguf.py run on the saved folder (the outside
reference for names, the split Conv3d patch kernel, the split qkv, `rope.dimension_sections`,
`n_wa_pattern`): the text file F32, the projector F32, F16 and Q8_0 (`--mmproj --outtype`). Its
BPE pre-tokenizer check, which recognises real tokenizers by a hash, is told the tiny one is
Qwen2's. Skipped where llama.cpp's sources are not unpacked (benchmarks/peers/build_llama_server.sh).

The tiny tower has Qwen2.5-VL's patch 14 and window 112 (what clip.cpp uses: the files do not
store it), so a 224 x 168 image has 2 x 2 windows; the processor's pixel bounds are clip.cpp's
(8 and 4096 tokens), so the HF processor and the projector's metadata preprocess alike.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmserve.engine.llm import LLM
from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint
from llmserve.sampling_params import SamplingParams
from tests.models.test_qwen2_5_vl import PROMPT, _hf_images, hf_generate, make_image
from tests.models.tiny import assert_greedy_matches, make_tiny_qwen2_5_vl

NUM_TOKENS = 8
LLAMA_CPP = Path.home() / ".cache/llmserve/peers/llama_cpp_python-0.3.36/vendor/llama.cpp"
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


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"no llama.cpp sources at {LLAMA_CPP} (benchmarks/peers/build_llama_server.sh)")
    folder = tmp_path_factory.mktemp("qwen2_5_vl_gguf")
    hf = make_tiny_qwen2_5_vl(
        folder, vision_overrides={"patch_size": 14, "window_size": 112}, pixels=(8 * CELL, 4096 * CELL)
    )
    out = {"text": convert(folder, folder / "model-f32.gguf", "f32")}
    for outtype in ("f32", "f16", "q8_0"):
        out[outtype] = convert(folder, folder / f"mmproj-{outtype}.gguf", outtype, mmproj=True)
    return hf, folder, out


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


def test_f16_projector_is_exact_on_f16_weights(files) -> None:
    """The F16 file (matrices F16, the patch kernel and vectors F32, as the converter writes
    them) against the reference with those weights rounded to half floats: exact parity."""
    hf, folder, f = files
    _, outputs = _generate(f["text"], f["f16"])
    _check(_with_projector_weights(hf, f["f16"]), folder, outputs)


def test_q8_0_projector_within_its_quantization(files) -> None:
    """Q8_0 (its blocks kept: the tower's layers run llmserve's q8 kernels) against the float
    model: the same greedy tokens, logprobs within what 8-bit weights move them; against the
    reference holding the file's dequantized weights, the first token's logprobs within the
    kernels' int16 activation rounding (several times closer: the file's weights are what runs)."""
    hf, folder, f = files
    llm, outputs = _generate(f["text"], f["q8_0"])
    assert "q8" in llm.engine.loaded.linear_kernel
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
    """A copy of `hf` whose vision tower holds the projector file's weights, dequantized."""
    import copy

    ref = copy.deepcopy(hf)
    state = {name: t for name, t, _ in GGUFCheckpoint([mmproj]).iter_weights(torch.float32)}
    assert all(name.startswith("model.visual.") for name in state)
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if m.startswith("model.visual.")]
    return ref


def _rewrite(src: Path, dst: Path, drop: str = "", fields: dict | None = None) -> Path:
    """`src` copied with tensor `drop` left out and string `fields` replaced."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (fields or {}).get(key, field.contents())
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name != drop:
            shape = [int(x) for x in reversed(t.shape.tolist())]
            data = np.asarray(t.data)
            writer.add_tensor(t.name, data, raw_shape=data.shape if t.tensor_type > 1 else shape,
                              raw_dtype=t.tensor_type)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_mismatched_or_incomplete_projectors_are_refused(files, tmp_path) -> None:
    f = files[2]
    # a projector of another type than the language model's
    gemma_type = _rewrite(f["f32"], tmp_path / "gemma.gguf", fields={"clip.projector_type": "gemma3"})
    with pytest.raises(ValueError, match=r"gemma\.gguf: a 'gemma3' vision projector .* is 'qwen2vl'"):
        LLM(str(f["text"]), mmproj=str(gemma_type), show_progress=False)
    unknown = _rewrite(f["f32"], tmp_path / "u.gguf", fields={"clip.projector_type": "qwen2vl_merger"})
    with pytest.raises(
        ValueError, match=r"u\.gguf: vision projector type 'qwen2vl_merger' \(clip.projector_type\)"
    ):
        LLM(str(f["text"]), mmproj=str(unknown), show_progress=False)
    # tensors missing: a block's, and the second half of the patch kernel
    for name in ("v.blk.2.attn_k.weight", "v.patch_embd.weight.1", "mm.2.bias"):
        broken = _rewrite(f["f32"], tmp_path / "broken.gguf", drop=name)
        with pytest.raises(ValueError, match=r"broken\.gguf: .*" + re.escape(repr(name))):
            LLM(str(f["text"]), mmproj=str(broken), show_progress=False)
    # a projector for a text model of another width
    wide = _rewrite(f["f32"], tmp_path / "wide.gguf", fields={"clip.vision.projection_dim": 128})
    with pytest.raises(ValueError, match=r"wide\.gguf: the projector's output width 128"):
        LLM(str(f["text"]), mmproj=str(wide), show_progress=False)
    # the language model's file as the projector
    with pytest.raises(ValueError, match="not a vision projector"):
        LLM(str(f["text"]), mmproj=str(f["text"]), show_progress=False)
