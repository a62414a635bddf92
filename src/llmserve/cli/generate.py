"""`llmserve generate`: greedy continuations of prompts on one model, printed to stdout.

With a chat template (the default model has one) each prompt is sent as a user message; `--raw`
continues the text as is.
"""

from __future__ import annotations

import argparse
import sys
import time

from llmserve.config import ModelConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for prompts (greedy)")
    p.add_argument("prompts", nargs="*", help="prompts (default: one example prompt)")
    p.add_argument(
        "--model",
        default=None,
        help="model folder, .gguf file or bundled name (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument(
        "--raw", action="store_true", help="continue the prompt text instead of applying the chat template"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llmserve.model_executor.greedy import blocks_needed, generate_greedy
    from llmserve.model_executor.model_loader import load_model
    from llmserve.model_executor.model_runner import ModelRunner
    from llmserve.tokenizer import load_tokenizer

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1; got {args.max_tokens}")
    prompts = args.prompts or ["What is the capital of France?"]
    loaded = load_model(ModelConfig(model=args.model, dtype=args.dtype, device=args.device))
    tokenizer = load_tokenizer(loaded.source)

    use_chat = not args.raw and tokenizer.chat_template is not None
    prompt_ids: list[list[int]] = []
    for text in prompts:
        if use_chat:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
            ids = tokenizer.encode(rendered, add_special_tokens=False)
        else:
            ids = tokenizer.encode(text)
        if len(ids) + args.max_tokens > loaded.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens {args.max_tokens} exceeds max_model_len {loaded.max_model_len}"
            )
        prompt_ids.append(ids)

    block_size = 16
    num_blocks = sum(blocks_needed(len(p) + args.max_tokens, block_size) for p in prompt_ids)
    runner = ModelRunner(loaded.model, num_blocks=num_blocks, block_size=block_size)
    start = time.perf_counter()
    outputs = generate_greedy(runner, prompt_ids, args.max_tokens, stop_token_ids=tokenizer.eos_token_ids)
    elapsed = time.perf_counter() - start
    for text, out in zip(prompts, outputs, strict=True):
        print(f"### {text}\n{tokenizer.decode(out, skip_special_tokens=True)}\n")
    num_out = sum(len(o) for o in outputs)
    print(f"{num_out} tokens in {elapsed:.2f} s ({num_out / elapsed:.1f} tokens/s)", file=sys.stderr)
    return 0
