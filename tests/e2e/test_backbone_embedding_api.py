"""A decoder saved without its LM head (Qwen3-Embedding's layout: a `Qwen3ForCausalLM` config over
a backbone's tensors) served: `/v1/embeddings` gives transformers' last-token, normalised vectors
(its sentence-transformers config), generation requests are 400s naming the model, and the server
keeps serving."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.e2e.conftest import MODEL_NAME, ServerProcess
from tests.models.test_embeddings import _save_backbone

pytestmark = pytest.mark.e2e


def test_a_backbone_serves_embeddings_and_refuses_generation(tmp_path):
    backbone = _save_backbone(tmp_path, "qwen3", causal_lm_config=True)
    server = ServerProcess(tmp_path).start()
    try:
        client = server.client()
        prompt = [5, 17, 99, 3, 42]
        r = client.embeddings.create(model=MODEL_NAME, input=[prompt])
        with torch.no_grad():
            ref = torch.nn.functional.normalize(
                backbone(torch.tensor([prompt])).last_hidden_state[0, -1], dim=0
            )
        assert torch.nn.functional.cosine_similarity(torch.tensor(r.data[0].embedding), ref, dim=0) >= 0.9999
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4)
        assert "is an embedding model (a decoder without an LM head)" in e.value.message
        assert e.value.body["param"] == "model"
        with pytest.raises(openai.BadRequestError, match="is an embedding model"):
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}])
        assert (
            client.embeddings.create(model=MODEL_NAME, input=[prompt]).data[0].embedding
            == r.data[0].embedding
        )
    finally:
        server.stop()
