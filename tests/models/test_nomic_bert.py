"""nomic-bert in GGUF (llama.cpp's `nomic-bert`, how Ollama ships nomic-embed-text): a tiny random
model written as llama.cpp's converter writes nomic's checkpoint (its tensor names from the gguf
package's own map, a WordPiece vocabulary in the converter's spelling), then embedded. No library
runs nomic-bert offline (its HF code is nomic's `trust_remote_code`), so the reference is the
architecture written out below in plain torch; where llama.cpp is built
(benchmarks/peers/build_llama_server.sh), llama-server's embeddings of the same file are compared too."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch

from llmserve import LLM, PoolingParams
from tests.gguf_writer import convert_state_dict, write_gguf
from tests.models.test_cross_encoder import write_tokenizer
from tests.models.test_gguf_bert import phantom_vocab

H, HEADS, LAYERS, INNER, VOCAB, ROPE_BASE, EPS = 48, 4, 2, 96, 120, 1000.0, 1e-12
TEXTS = ["w3 w17 w5", "w60 w61 w3 w17 w5 w61 w9 w8 w7", "w1", "W17 w90, w91"]


def random_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """nomic's checkpoint names (NomicBertModel), random weights; norms near 1."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    state = {
        "embeddings.word_embeddings.weight": rand(VOCAB, H, scale=1.0),
        "embeddings.token_type_embeddings.weight": rand(2, H, scale=1.0),
        "emb_ln.weight": 1 + rand(H, scale=0.1),
        "emb_ln.bias": rand(H, scale=0.1),
    }
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        state |= {
            p + "attn.Wqkv.weight": rand(3 * H, H), p + "attn.out_proj.weight": rand(H, H),
            p + "mlp.fc11.weight": rand(INNER, H), p + "mlp.fc12.weight": rand(INNER, H),
            p + "mlp.fc2.weight": rand(H, INNER),
            p + "norm1.weight": 1 + rand(H, scale=0.1), p + "norm1.bias": rand(H, scale=0.1),
            p + "norm2.weight": 1 + rand(H, scale=0.1), p + "norm2.bias": rand(H, scale=0.1),
        }  # fmt: skip
    return state


def reference(state: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """nomic-bert's forward, written out: the mean of the final states, normalised."""

    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (H,), state[f"{name}.weight"], state[f"{name}.bias"], EPS)

    def rope(x: torch.Tensor) -> torch.Tensor:  # [T, heads, D], GPT-NeoX halves (not interleaved)
        D = x.shape[-1]
        inv = ROPE_BASE ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv  # [T, D/2]
        cos, sin = (torch.cat([f(angles)] * 2, -1)[:, None, :].float() for f in (torch.cos, torch.sin))
        half = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
        return x * cos + half * sin

    T, D = len(ids), H // HEADS
    x = ln(
        state["embeddings.word_embeddings.weight"][ids] + state["embeddings.token_type_embeddings.weight"][0],
        "emb_ln",
    )
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        q, k, v = (x @ state[p + "attn.Wqkv.weight"].T).view(T, 3, HEADS, D).unbind(1)
        q, k = rope(q), rope(k)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, H)
        x = ln(x + attn @ state[p + "attn.out_proj.weight"].T, p + "norm1")
        up, gate = x @ state[p + "mlp.fc11.weight"].T, x @ state[p + "mlp.fc12.weight"].T
        x = ln(x + (up * torch.nn.functional.silu(gate)) @ state[p + "mlp.fc2.weight"].T, p + "norm2")
    return torch.nn.functional.normalize(x.mean(0), dim=0)


def write_nomic_gguf(folder: Path, state: dict[str, torch.Tensor]) -> Path:
    """The file llama.cpp's converter writes for nomic's checkpoint (NomicBertModel -> `nomic-bert`)."""
    write_tokenizer(folder)  # a tiny BERT WordPiece vocabulary ([CLS] a [SEP])
    config = type("C", (), {"num_hidden_layers": LAYERS})()
    tensors = convert_state_dict("nomic-bert", config, state)
    tokens, types = phantom_vocab(folder)

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_block_count(LAYERS)
        w.add_context_length(512)
        w.add_embedding_length(H)
        w.add_feed_forward_length(INNER)
        w.add_head_count(HEADS)
        w.add_layer_norm_eps(EPS)
        w.add_rope_freq_base(ROPE_BASE)
        w.add_causal_attention(False)
        w.add_pooling_type(gguf.PoolingType.MEAN)
        w.add_token_type_count(2)
        w.add_tokenizer_model("bert")
        w.add_tokenizer_pre("jina-v2-en")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(3)
        w.add_unk_token_id(1)
        w.add_sep_token_id(3)
        w.add_pad_token_id(0)
        w.add_mask_token_id(4)

    (path,) = write_gguf(folder / "nomic.gguf", "nomic-bert", dict(tensors), metadata)
    return path


@pytest.fixture(scope="module")
def nomic(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], list]:
    folder = tmp_path_factory.mktemp("nomic-bert")
    state = random_state()
    path = write_nomic_gguf(folder, state)
    llm = LLM(str(path), show_progress=False, device="cpu")
    assert type(llm.engine.loaded.model).__name__ == "NomicBertModel"
    assert llm.engine.default_pooling == PoolingParams("mean", True)
    return path, state, llm.embed(TEXTS, use_tqdm=False)


def test_embeddings_match_the_architecture_written_out(nomic):
    """[CLS] text [SEP], mean-pooled and normalised, as the plain-torch forward gives them."""
    _, state, outs = nomic
    for out in outs:
        assert out.prompt_token_ids[0] == 2 and out.prompt_token_ids[-1] == 3
        ref = reference(state, out.prompt_token_ids)
        torch.testing.assert_close(torch.tensor(out.embedding), ref, rtol=1e-4, atol=1e-5)
    # RoPE matters: the same tokens reordered embed differently (a bag of words would not)
    assert torch.tensor(outs[0].embedding) @ reference(state, [2, 10, 8, 22, 3]) < 0.9999


def _llama_server() -> Path | None:
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    try:
        from cpu_scale import files
    finally:
        sys.path.pop(0)
    binary = files.llama_cpp_binary("llama-server")
    return binary if binary.is_file() else None


def test_embeddings_match_llama_server(nomic, tmp_path):
    """llama-server `--embedding` on the same file: the same tokens, cosine >= 0.99999."""
    binary = _llama_server()
    if binary is None:
        pytest.skip("llama-server is not built here (benchmarks/peers/build_llama_server.sh)")
    path, _, outs = nomic
    port = 18000 + (int(time.time() * 1000) % 2000)
    log = (tmp_path / "llama-server.log").open("w")
    proc = subprocess.Popen([str(binary), "-m", str(path), "--embedding", "--port", str(port), "-c", "512",
                             "-t", "1"], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        data = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS}, timeout=60).json()["data"]
        for out, theirs, text in zip(outs, data, TEXTS, strict=True):
            tokens = httpx.post(
                f"{url}/tokenize", json={"content": text, "add_special": True}, timeout=10
            ).json()
            assert tokens["tokens"] == out.prompt_token_ids
            cosine = np.dot(out.embedding, theirs["embedding"]) / np.linalg.norm(theirs["embedding"])
            assert cosine >= 0.99999
    finally:
        proc.terminate()
        proc.wait(timeout=30)
