"""YaRN RoPE (gpt-oss, and any config whose `rope_type` is yarn) against transformers' own
`_compute_yarn_parameters`: the blended frequencies and the attention factor that scales cos/sin."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from llmserve.layers.rotary_embedding import RotaryEmbedding, rope_parameters

CASES = {
    "gpt-oss": {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096},
    "truncated": {"factor": 4.0, "original_max_position_embeddings": 64},
    "mscale": {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 128},
    "attention_factor": {"factor": 8.0, "attention_factor": 1.5, "beta_fast": 16.0,
                         "original_max_position_embeddings": 256},
}  # fmt: skip


@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_yarn_matches_transformers(params: dict) -> None:
    config = transformers.GptOssConfig(
        hidden_size=64, num_attention_heads=4, head_dim=32, max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **params},
    )  # fmt: skip
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = RotaryEmbedding(32, 32, 512, rope_parameters(config))
    positions = torch.arange(512, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    want = torch.cat([freqs.cos() * factor, freqs.sin() * factor], dim=-1)
    torch.testing.assert_close(rope.cos_sin_cache, want, rtol=0, atol=1e-6)
    assert factor != 1.0
