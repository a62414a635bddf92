"""`llmserve generate` end to end on the embedded model: chat template, greedy decoding and
detokenization give llama.cpp's reference text; bad input exits 2 with one clear line."""

from __future__ import annotations

from llmserve.cli.main import main


def test_generate_chat_matches_llamacpp_text(capsys, llamacpp_reference):
    case = next(g for g in llamacpp_reference["greedy"] if g["weights"] == "f32" and g["kind"] == "chat")
    assert main(["generate", "--max-tokens", "32", case["prompt"]]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == case["greedy_text"]


def test_generate_raw_prompt(capsys, llamacpp_reference):
    case = next(g for g in llamacpp_reference["greedy"] if g["weights"] == "f32" and g["kind"] == "raw")
    assert main(["generate", "--raw", "--max-tokens", "32", case["prompt"]]) == 0
    out = capsys.readouterr().out
    assert out.split("\n", 1)[1].startswith(case["greedy_text"])


def test_generate_bad_input_exits_2(capsys):
    assert main(["generate", "--model", "/no/such/model.gguf", "hi"]) == 2
    err = capsys.readouterr().err
    assert "/no/such/model.gguf" in err and "Traceback" not in err
    assert main(["generate", "--max-tokens", "0", "hi"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
