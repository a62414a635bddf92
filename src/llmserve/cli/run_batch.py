"""`llmserve run-batch`: an OpenAI batch file run offline, without a server.

    llmserve run-batch -i requests.jsonl -o results.jsonl
    llmserve run-batch -i requests.jsonl -o results.jsonl --model ./my-model --served-model-name m

Input lines as the Batches API takes them (`custom_id`, `method`, `url`: /v1/chat/completions or
/v1/completions, `body`); output lines in its output format, successes and failures in one file,
in the order they finish. Each line runs through the same serving code as the server's endpoint
(server/batches/lines.py), so its body is the one the server would answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

from tqdm import tqdm

from llmserve.cli.engine_args import add_engine_args, llm_kwargs
from llmserve.cli.serve import model_specs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline")
    p.add_argument("-i", "--input-file", type=Path, required=True, help="the batch file (JSONL)")
    p.add_argument("-o", "--output-file", type=Path, required=True, help="where the results go (JSONL)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the responses")
    p.add_argument(
        "--max-concurrency", type=int, default=64, help="lines in flight at once (the engine batches them)"
    )
    add_engine_args(p)
    p.set_defaults(func=run, model_tag=[], config=None, preload="first")


def run(args: argparse.Namespace) -> int:
    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1; got {args.max_concurrency}")
    try:
        data = args.input_file.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read --input-file: {e}") from None
    return asyncio.run(_run(args, data))


async def _run(args: argparse.Namespace, data: bytes) -> int:
    from llmserve.config import ServerConfig
    from llmserve.server.batches.lines import ENDPOINTS, parse_lines, result_line, run_line
    from llmserve.server.models import ModelManager

    lines, errors = parse_lines(data, ENDPOINTS)
    if errors:
        raise ValueError(f"{args.input_file}: {'; '.join(e['message'] for e in errors[:5])}")
    models = ModelManager(model_specs(args), ServerConfig(max_queued_requests=None), llm_kwargs(args))
    try:
        await models.ensure_loaded(models.default, timeout=math.inf)
        if models.default.error is not None:
            raise ValueError(f"cannot load the model: {models.default.error}")
        limit = asyncio.Semaphore(args.max_concurrency)
        num_failed = 0
        with open(args.output_file, "w") as out, tqdm(total=len(lines), unit="line") as bar:

            async def one(line) -> None:
                nonlocal num_failed
                async with limit:
                    status, body = await run_line(models, line)
                out.write(json.dumps(result_line(line.custom_id, status, body)) + "\n")
                num_failed += not 200 <= status < 300
                bar.update()

            await asyncio.gather(*(one(line) for line in lines))
    finally:
        await models.close()
    print(f"{len(lines) - num_failed} lines answered, {num_failed} failed -> {args.output_file}")
    return 0
