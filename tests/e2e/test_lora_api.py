"""LoRA adapters over HTTP: `--enable-lora --lora-modules name=path`; a request picks the adapter
by `model`, and /v1/models lists it with its base model as `parent`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def lora_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Path]]:
    from tests.models.test_lora import ALL, make_adapter

    adapter = make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "sql", ALL, seed=1)
    proc = ServerProcess(tiny_model_dir, "--enable-lora", "--lora-modules", f"sql={adapter}").start()
    yield proc, adapter
    proc.stop()


def test_models_lists_the_adapter_with_its_parent(lora_server):
    proc, adapter = lora_server
    cards = {m.id: m for m in proc.client().models.list().data}
    assert cards["sql"].model_extra["parent"] == MODEL_NAME
    assert cards["sql"].model_extra["root"] == str(adapter)
    assert proc.client().models.retrieve("sql").model_extra["parent"] == MODEL_NAME


def test_a_request_picks_the_adapter_by_model(lora_server, tiny_model_dir):
    from llmserve.engine.llm import LLM
    from llmserve.lora import LoRARequest
    from llmserve.sampling_params import SamplingParams

    proc, adapter = lora_server
    client = proc.client()
    prompt = "The quick brown fox"
    texts = {}
    for model in (MODEL_NAME, "sql"):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert out.model == model
        texts[model] = out.choices[0].text
    assert texts["sql"] != texts[MODEL_NAME]
    llm = LLM(str(tiny_model_dir), enable_lora=True, show_progress=False)
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = llm.generate(prompt, params, lora_request=LoRARequest("sql", 1, str(adapter)), use_tqdm=False)
    assert texts["sql"] == expected[0].outputs[0].text
