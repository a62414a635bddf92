"""`llmserve serve model.gguf --mmproj mmproj-q8_0.gguf` for Qwen2.5-VL and Qwen2-VL (llama-server's
flag): chat images through the `openai` client answer as the offline engine on the same two files
(whose parity with transformers tests/models/test_qwen2_5_vl_mmproj.py and test_qwen2_vl_mmproj.py
check); an image the processor refuses is a 400 naming its field, and the server keeps serving."""

from __future__ import annotations

import io

import openai
import pytest

from llmserve.engine.llm import LLM
from tests.e2e.conftest import ServerProcess
from tests.e2e.test_vision_api import chat, data_url, expected_text, png
from tests.models.test_qwen2_5_vl import make_image
from tests.models.test_qwen2_5_vl_mmproj import CELL, make_files
from tests.models.tiny import make_tiny_qwen2_5_vl, make_tiny_qwen2_vl

pytestmark = pytest.mark.e2e
MODELS = {
    "qwen2_5_vl": (make_tiny_qwen2_5_vl, {"window_size": 112}),  # projector type qwen2.5vl_merger
    "qwen2_vl": (make_tiny_qwen2_vl, {"mlp_ratio": 3}),  # qwen2vl_merger
}


@pytest.mark.parametrize("model", list(MODELS))
def test_gguf_qwen_vl_with_a_q8_0_mmproj_serves_images(tmp_path, model) -> None:
    make_tiny, overrides = MODELS[model]
    hf = make_tiny(tmp_path, vision_overrides={"patch_size": 14, **overrides}, pixels=(8 * CELL, 4096 * CELL))
    files = make_files(tmp_path, hf, use_converter=False)  # the gguf package's writer, as the converter
    offline = LLM(str(files["text"]), mmproj=str(files["q8_0"]), show_progress=False)
    proc = ServerProcess(files["text"], "--mmproj", str(files["q8_0"])).start()
    try:
        client = proc.client()
        assert chat(client, data_url(png(1))) == expected_text(offline, "What is this?", 1)
        buf = io.BytesIO()  # a 2 x 500 image: past the processor's aspect-ratio limit
        make_image(0, (2, 500)).save(buf, format="PNG")
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, data_url(buf.getvalue()))
        assert "aspect ratio" in e.value.body["message"]
        assert chat(client, data_url(png(2))) == expected_text(offline, "What is this?", 2)  # still serving
    finally:
        proc.stop()
