"""`llmserve generate` end to end on the embedded model: chat template, greedy decoding and
detokenization give llama.cpp's reference text; bad input exits 2 with one clear line. The
reference is llama.cpp on the file's float weights, which int16 activations reproduce token for
token on any CPU (`EXACT`; the default takes int8 activations on AVX-512 VNNI CPUs)."""

from __future__ import annotations

import json

from llmserve.cli.main import main

EXACT = ["--cpu-activations", "int16"]


def test_generate_chat_matches_llamacpp_text(capsys, llamacpp_reference):
    case = next(g for g in llamacpp_reference["greedy"] if g["weights"] == "f32" and g["kind"] == "chat")
    assert main(["generate", *EXACT, "--max-tokens", "32", case["prompt"]]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == case["greedy_text"]


def test_generate_raw_prompt(capsys, llamacpp_reference):
    case = next(g for g in llamacpp_reference["greedy"] if g["weights"] == "f32" and g["kind"] == "raw")
    assert main(["generate", *EXACT, "--raw", "--max-tokens", "32", case["prompt"]]) == 0
    out = capsys.readouterr().out
    assert out.split("\n", 1)[1].startswith(case["greedy_text"])


def test_generate_on_the_blas_kernel(capsys, llamacpp_reference):
    """--cpu-gemm blas (torch's bmm instead of oneDNN) reaches the model and still gives llama.cpp's text."""
    case = next(g for g in llamacpp_reference["greedy"] if g["weights"] == "f32" and g["kind"] == "raw")
    assert (
        main(["generate", *EXACT, "--cpu-gemm", "blas", "--raw", "--max-tokens", "32", case["prompt"]]) == 0
    )
    assert capsys.readouterr().out.split("\n", 1)[1].startswith(case["greedy_text"])


def test_generate_with_a_float16_kv_cache_in_static_batches(capsys, caplog, llamacpp_reference):
    """--kv-cache-dtype and --batching-mode reach the engine; float16 K/V (llama.cpp's own
    default cache type) and prompt-padded static batches still give llama.cpp's text."""
    cases = [g for g in llamacpp_reference["greedy"] if g["weights"] == "f32" and g["kind"] == "raw"]
    args = [
        "generate",
        *EXACT,
        "--kv-cache-dtype",
        "float16",
        "--batching-mode",
        "static",
        "--raw",
        "--max-tokens",
        "32",
    ]
    with caplog.at_level("INFO", logger="llmserve"):
        assert main(args + [c["prompt"] for c in cases]) == 0
    assert "KV cache (float16)" in caplog.text
    out = capsys.readouterr().out
    for case in cases:
        assert case["greedy_text"] in out


def test_generate_bad_input_exits_2(capsys):
    assert main(["generate", "--model", "/no/such/model.gguf", "hi"]) == 2
    err = capsys.readouterr().err
    assert "/no/such/model.gguf" in err and "Traceback" not in err
    assert main(["generate", "--max-tokens", "0", "hi"]) == 2
    assert "max_tokens must be >= 1" in capsys.readouterr().err


def test_generate_jsonl_in_and_out(tmp_path, capsys, llamacpp_reference):
    chat, raw = (
        next(g for g in llamacpp_reference["greedy"] if g["weights"] == "f32" and g["kind"] == kind)
        for kind in ("chat", "raw")
    )
    src = tmp_path / "in.jsonl"
    lines = [
        {"id": "a", "messages": [{"role": "user", "content": chat["prompt"]}]},
        {"id": "b", "prompt_token_ids": raw["prompt_ids"]},
        {"prompt": chat["prompt"]},  # a text prompt goes through the chat template
    ]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    dst = tmp_path / "out.jsonl"
    assert main(["generate", *EXACT, "--input", str(src), "--output", str(dst), "--max-tokens", "32"]) == 0
    records = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b", 2]
    assert records[0]["outputs"][0]["text"] == chat["greedy_text"]
    assert records[0]["outputs"][0]["finish_reason"] == "stop"
    assert records[1]["outputs"][0]["token_ids"] == raw["greedy_ids"]
    assert records[2]["outputs"][0]["text"] == chat["greedy_text"]
    assert records[2]["num_cached_tokens"] > 0  # same chat prompt as "a": its blocks were reused


def test_generate_rejects_bad_jsonl(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "ok"}\n{"prompt": \n')
    assert main(["generate", "--input", str(src)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    src.write_text('{"text": "no prompt key"}\n')
    assert main(["generate", "--input", str(src)]) == 2
    assert "exactly one of prompt" in capsys.readouterr().err
