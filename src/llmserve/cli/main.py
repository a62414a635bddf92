"""`llmserve` entry point: one subcommand per job.

llmserve generate [PROMPT ...] [--model M] [--max-tokens N] [--raw]
llmserve serve [MODEL] [--host H] [--port P] [--api-key KEY]
llmserve bench serve|throughput|latency ...
llmserve run-batch -i in.jsonl -o out.jsonl [--model M]
llmserve eval perplexity [--model M] [--quantization Q] [--reference same|none|PATH]
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from llmserve import __version__
from llmserve.cli import bench, eval, generate, run_batch, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description="LLM inference engine and server.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--version", action="version", version=f"llmserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    eval.add_parser(sub)
    run_batch.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except ValueError as e:  # bad user input: one clear line, no traceback
        print(f"llmserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
