"""4-bit vision projector files (Q4_0, Q4_1) for Gemma 3 and Qwen2.5-VL, against transformers
holding the file's dequantized weights.

llama.cpp's converter cannot write them (`--outtype` offers f32, f16, bf16, q8_0, tq1_0, tq2_0);
its `llama-quantize` quantizes a projector file (architecture `clip`) as a language model's: every
matrix named `*weight` but the patch and position embeddings, a matrix whose rows are not whole
blocks of 32 falling back to F16, vectors kept. The files come from llama-quantize where it is
built (benchmarks/peers/build_llama_server.sh), else from the gguf package's quantizer following
it; where both run the two are checked equal, tensor by tensor.

The tower's layers then run llmserve's 4-bit kernels on the file's blocks (activations rounded
to int16 per token) and Gemma's input projection, a bare parameter, is dequantized: the answers
are compared with the reference whose weights are the file's, within that activation rounding
(what the tiny random towers amplify it to), and differ from the F16 file's.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType as Q

from llmserve.engine.llm import LLM
from llmserve.sampling_params import SamplingParams
from tests.models import test_gemma3_mmproj as gemma
from tests.models import test_qwen2_5_vl_mmproj as qwen
from tests.models.test_gemma3_vision import _pixels
from tests.models.tiny import make_tiny_qwen2_5_vl

QUANTIZE = Path(
    os.environ.get("LLMSERVE_LLAMA_QUANTIZE", qwen.PEERS / "llama.cpp-0.3.36-build/bin/llama-quantize")
)
TYPES = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1}
ATOL = 1e-2  # logprobs: the 4-bit kernels round activations (measured: Qwen below 1e-2, Gemma 2e-3)


def quantize(src: Path, dst: Path, qtype: str, use_tool: bool) -> Path:
    """`src` quantized to `qtype` by llama-quantize (`use_tool`) or the fallback writer."""
    if not use_tool:
        return qwen._rewrite(src, dst, quantize=TYPES[qtype])
    env = dict(os.environ, LD_LIBRARY_PATH=str(QUANTIZE.parent))
    proc = subprocess.run(
        [str(QUANTIZE), str(src), str(dst), qtype.upper()],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dst


def _quantized_files(src: Path, folder: Path) -> dict[str, Path]:
    tool = QUANTIZE.is_file()
    return {t: quantize(src, folder / f"{src.stem}-{t}.gguf", t, tool) for t in TYPES}


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_5_vl_q4")
    hf = make_tiny_qwen2_5_vl(
        folder,
        vision_overrides={"patch_size": 14, "window_size": 112},
        pixels=(8 * qwen.CELL, 4096 * qwen.CELL),
    )
    text = qwen.write_text(folder, hf, folder / "model-f32.gguf")
    f32 = qwen.write_mmproj(hf, folder / "mmproj-f32.gguf", Q.F32)
    return hf, folder, text, f32, _quantized_files(f32, folder)


@pytest.fixture(scope="module")
def gemma_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3_q4")
    hf = gemma.make_hf_vlm(folder)
    text = gemma.text_gguf(folder / "model.gguf", hf, folder, keep_image_token=True)
    f16 = gemma.mmproj_gguf(folder / "mmproj-f16.gguf", hf)  # as the published projectors are
    return hf, folder, text, f16, _quantized_files(f16, folder)


@pytest.mark.parametrize("model", ["qwen", "gemma"])
def test_fallback_quantizer_writes_what_llama_quantize_writes(request, model, tmp_path) -> None:
    if not QUANTIZE.is_file():
        pytest.skip(f"no llama-quantize at {QUANTIZE} (benchmarks/peers/build_llama_server.sh)")
    _, _, _, src, files = request.getfixturevalue(f"{model}_files")
    for qtype, theirs in files.items():
        assert TYPES[qtype] in {t.tensor_type for t in gguf.GGUFReader(theirs).tensors}
        qwen.assert_same_gguf(quantize(src, tmp_path / f"w-{qtype}.gguf", qtype, use_tool=False), theirs)


@pytest.mark.parametrize("qtype", list(TYPES))
def test_qwen2_5_vl_q4_projector(qwen_files, qtype) -> None:
    hf, folder, text, _, files = qwen_files
    llm, outputs = qwen._generate(text, files[qtype])
    model = llm.engine.loaded.model
    assert type(model.visual.blocks[0].attn.qkv).__name__ == "QuantizedLinear"
    assert "q4" in llm.engine.loaded.linear_kernel
    qwen._check(qwen._with_projector_weights(hf, files[qtype]), folder, outputs, atol=ATOL)


@pytest.mark.parametrize("qtype", list(TYPES))
def test_gemma3_q4_projector(gemma_files, qtype) -> None:
    hf, folder, text, f16, files = gemma_files
    params = SamplingParams(max_tokens=gemma.NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
    image = gemma.make_image(0)
    runs = {}
    for name, mmproj in ((qtype, files[qtype]), ("f16", f16)):
        llm = LLM(str(text), mmproj=str(mmproj), block_size=4, show_progress=False)
        prompt = {"prompt": gemma.PROMPT, "multi_modal_data": {"image": image}}
        runs[name] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        if name == qtype:
            assert "q4" in llm.engine.loaded.linear_kernel
            ids = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    reference = qwen._with_projector_weights(hf, files[qtype])
    expected, logprobs = gemma.hf_greedy(reference, ids, _pixels(folder, image), gemma.NUM_TOKENS, 512)
    out = runs[qtype]
    assert out.token_ids == expected
    for lp, ref in zip(out.logprobs, logprobs, strict=True):
        assert all(abs(value[0] - float(ref[token])) < ATOL for token, value in lp.items())
    assert out.logprobs != runs["f16"].logprobs  # the 4-bit weights are what runs
