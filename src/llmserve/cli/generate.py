"""`llmserve generate`: completions for prompts given as arguments or a JSONL file.

    llmserve generate "What is the capital of France?"                # chat template, greedy
    llmserve generate --raw --temperature 0.8 --seed 1 "Once upon a time"
    llmserve generate --input prompts.jsonl --output results.jsonl

Each input line is an object with one of `prompt` (text), `messages` (a chat) or
`prompt_token_ids`, and optionally `id`. Text prompts go through the chat template when the model
has one (unless --raw). Output lines: id, prompt, outputs (text, token_ids, finish_reason),
prompt and cached token counts. Without --output, texts are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from llmserve.cli.engine_args import add_engine_args, llm_kwargs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions offline (arguments or JSONL)")
    p.add_argument("prompts", nargs="*", help="prompts (default: one example prompt)")
    p.add_argument("--input", type=Path, help="JSONL file of prompts")
    p.add_argument("--output", type=Path, help="write results as JSONL here")
    p.add_argument("--raw", action="store_true", help="continue text prompts as is (no chat template)")
    s = p.add_argument_group("sampling (defaults: greedy, 64 tokens)")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--n", type=int, default=1, help="completions per prompt")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=run)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    items = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read --input {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        if (
            not isinstance(item, dict)
            or sum(k in item for k in ("prompt", "messages", "prompt_token_ids")) != 1
        ):
            raise ValueError(
                f"{path}:{n}: expected an object with exactly one of prompt, messages, prompt_token_ids"
            )
        items.append(item)
    return items


def run(args: argparse.Namespace) -> int:
    from llmserve import LLM, SamplingParams

    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos,
    )  # fmt: skip
    items = _read_jsonl(args.input) if args.input else []
    items += [{"prompt": p} for p in args.prompts]
    if not items:
        items = [{"prompt": "What is the capital of France?"}]

    llm = LLM(**llm_kwargs(args))
    tokenizer = llm.get_tokenizer()
    use_chat = not args.raw and tokenizer.chat_template is not None
    prompts: list[str | list[int]] = []
    for item in items:
        if "prompt_token_ids" in item:
            prompts.append(list(item["prompt_token_ids"]))
        elif "messages" in item or use_chat:
            messages = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
            prompts.append(
                tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
            )
        else:
            prompts.append(item["prompt"])

    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - start
    out_file = args.output.open("w") if args.output else None
    for i, (item, out) in enumerate(zip(items, outputs, strict=True)):
        if out_file is not None:
            record = {
                "id": item.get("id", i),
                "prompt": item.get("prompt", item.get("messages", item.get("prompt_token_ids"))),
                "outputs": [
                    {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                    for c in out.outputs
                ],
                "num_prompt_tokens": len(out.prompt_token_ids),
                "num_cached_tokens": out.num_cached_tokens,
            }
            out_file.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            label = item.get("prompt", f"item {item.get('id', i)}")
            for c in out.outputs:
                print(f"### {label}\n{c.text}\n")
    if out_file is not None:
        out_file.close()
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(
        f"{len(outputs)} prompts, {num_out} tokens in {elapsed:.2f} s ({num_out / elapsed:.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0
