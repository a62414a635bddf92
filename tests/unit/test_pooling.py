"""Embedding pooling's pure parts: parameter checks, the model's sentence-transformers choice,
and the accumulator across prefill chunks (CPU tensors, no model)."""

from __future__ import annotations

import json

import pytest
import torch

from llmserve.model_executor.pooler import PoolingState, default_pooling_params, finish, model_pooling
from llmserve.pooling_params import PoolingParams


def write_st(folder, pooling_config: dict, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"pooling_mode_lasttoken": True}, "last"),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean"),
        ({"pooling_mode_cls_token": True}, "cls"),
    ],
)
def test_the_models_own_pooling_is_read(tmp_path, config, expected):
    write_st(tmp_path, config, normalize=True)
    assert model_pooling(tmp_path) == (expected, True)
    assert default_pooling_params("auto", None, tmp_path) == PoolingParams(expected, True)  # type: ignore[arg-type]
    assert default_pooling_params("last", False, tmp_path) == PoolingParams("last", False)


def test_no_or_unknown_config_falls_back_to_last_normalised(tmp_path):
    assert model_pooling(tmp_path) is None and model_pooling(None) is None
    assert default_pooling_params("auto", None, tmp_path) == PoolingParams("last", True)
    write_st(tmp_path, {"pooling_mode_max_tokens": True}, normalize=False)  # max: not implemented
    assert model_pooling(tmp_path) is None


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_chunks_pool_as_the_whole_prompt(pooling):
    hidden = torch.randn(10, 8)
    params = PoolingParams(pooling, normalize=False)  # type: ignore[arg-type]
    state = PoolingState(params, num_prompt_tokens=10)
    for start, end in ((0, 4), (4, 9), (9, 10)):
        state.add_chunk(hidden[start:end], start)
    expected = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    torch.testing.assert_close(torch.tensor(finish([state])[0]), expected)


def test_dimensions_cut_before_normalising():
    state = PoolingState(PoolingParams("cls", dimensions=3), num_prompt_tokens=1)
    state.add_chunk(torch.tensor([[3.0, 0.0, 4.0, 100.0]]), 0)
    assert finish([state]) == [pytest.approx([0.6, 0.0, 0.8])]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pooling": "max"}, "pooling"),
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
    ],
)
def test_bad_pooling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kwargs)


@pytest.mark.parametrize("pooling", ["last", "cls"])
def test_a_kept_row_survives_its_buffer_being_reused(pooling):
    """The runner's output buffer may be overwritten by the next step (a CUDA graph's static
    output) before a chunked prompt ends: the accumulator holds a copy."""
    buffer = torch.ones(4, 2)
    state = PoolingState(PoolingParams(pooling, normalize=False), num_prompt_tokens=4)  # type: ignore[arg-type]
    state.add_chunk(buffer, 0)  # all four rows in one chunk: both keep a row of it
    buffer.fill_(7.0)
    assert finish([state]) == [[1.0, 1.0]]
