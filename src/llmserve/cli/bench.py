"""`llmserve bench`: serving load tests, offline throughput and llama-bench-style latency.

    llmserve bench serve --base-url http://localhost:8000 --model M --max-concurrency 1 4 16 32
    llmserve bench serve --base-url URL --dataset sharegpt --dataset-path sg.json --request-rate 4
    llmserve bench throughput [MODEL] --num-prompts 200 --input-len 256 --output-len 128
    llmserve bench latency [MODEL] --prompt-lens 128 512 --gen-lens 128 --repetitions 3

`serve` talks to any OpenAI-compatible server. It writes a JSON result (default
bench-serve-<timestamp>.json) and PNG plots beside it; with several --max-concurrency values, one
run per value plus a sweep plot. It exits 1 when no request succeeded (the JSON still records every
error), 0 otherwise. `throughput` and `latency` load the model in this process and write JSON only
with --result-file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from llmserve.cli.engine_args import add_engine_args, llm_kwargs

DATASETS = ("random", "sharegpt", "prefix")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark a server, the offline engine, or prompt/decode speed")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    _add_serve_parser(bench_sub)
    _add_throughput_parser(bench_sub)
    _add_latency_parser(bench_sub)


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="random", choices=DATASETS)
    d.add_argument("--dataset-path", type=Path, help="ShareGPT JSON file (--dataset sharegpt)")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument(
        "--input-len", type=int, default=256, help="prompt tokens (prefix: the per-request suffix)"
    )
    d.add_argument(
        "--output-len", type=int, default=None, help="output tokens (default 128; sharegpt: each answer's)"
    )
    d.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- r)")
    d.add_argument("--prefix-len", type=int, default=256, help="shared prefix tokens (--dataset prefix)")
    d.add_argument("--seed", type=int, default=0)


def _add_output_args(p: argparse.ArgumentParser, default_note: str) -> None:
    o = p.add_argument_group("output")
    o.add_argument("--result-dir", type=Path, default=None, help="folder for results (default: cwd)")
    o.add_argument("--result-file", type=Path, default=None, help=f"JSON result file ({default_note})")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (llmserve, vLLM, llama-server)")
    s = p.add_argument_group("server")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    s.add_argument("--model", default=None, help="the model name to send (default: the server's first)")
    s.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key ($OPENAI_API_KEY)")
    _add_dataset_args(p)
    d = p.add_argument_group("prompts")
    d.add_argument("--tokenizer", default=None, help="counts prompt lengths (default: the embedded model)")
    d.add_argument(
        "--cache",
        default="cold",
        choices=["cold", "warm"],
        help="cold: a fresh salt starts every prompt, so nothing hits the server's prefix cache from an "
        "earlier run; warm: prompts depend on --seed only",
    )
    d.add_argument("--max-model-len", type=int, default=2048, help="sharegpt: skip longer prompt + output")
    t = p.add_argument_group("load")
    t.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)"
    )
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    t.add_argument(
        "--max-concurrency", type=int, nargs="+", default=None, help="in-flight cap; several values: a sweep"
    )
    t.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    t.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    _add_output_args(p, "default bench-serve-<timestamp>.json")
    p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True, help="PNG plots")
    p.set_defaults(func=run_serve)


def _add_throughput_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline engine throughput: all requests at once")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    _add_dataset_args(p)
    _add_output_args(p, "written only when given")
    add_engine_args(p)
    p.set_defaults(func=run_throughput)


def _add_latency_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="llama-bench style prompt processing (pp) and generation (tg) speed")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--prompt-lens", type=int, nargs="*", default=[512], help="pp tests: prompt tokens")
    p.add_argument("--gen-lens", type=int, nargs="*", default=[128], help="tg tests: generated tokens")
    p.add_argument("--batch-size", type=int, default=1, help="concurrent requests in tg tests")
    p.add_argument("--repetitions", type=int, default=3, help="runs per test (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    _add_output_args(p, "written only when given")
    add_engine_args(p)
    p.set_defaults(func=run_latency)


# -- shared helpers ------------------------------------------------------------------------------


def build_requests(args: argparse.Namespace, tokenizer: Any, salt: str | None, max_model_len: int) -> list:
    from llmserve.bench import datasets

    output_len = args.output_len if args.output_len is not None else 128
    if args.dataset == "sharegpt":
        if args.dataset_path is None:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE")
        return datasets.sharegpt_requests(
            tokenizer, args.dataset_path, args.num_prompts, args.output_len, max_model_len, args.seed, salt
        )
    if args.dataset == "prefix":
        return datasets.prefix_requests(
            tokenizer, args.num_prompts, args.prefix_len, args.input_len, output_len,
            args.range_ratio, args.seed, salt,
        )  # fmt: skip
    return datasets.random_requests(
        tokenizer, args.num_prompts, args.input_len, output_len, args.range_ratio, args.seed, salt
    )


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's arguments as JSON values (for the result file)."""
    config = {}
    for key, value in vars(args).items():
        if key in ("func", "api_key"):  # never write a secret into a result file
            continue
        config[key] = str(value) if isinstance(value, Path) else value
    return config


def _save(data: dict[str, Any], args: argparse.Namespace, kind: str) -> Path | None:
    """Write `data` to --result-file (in --result-dir), when one was given."""
    from llmserve.bench.report import default_result_path, write_json

    if args.result_file is None:
        return None
    path = write_json(data, default_result_path(kind, args.result_dir, args.result_file))
    print(f"results written to {path}", file=sys.stderr)
    return path


# -- bench serve ---------------------------------------------------------------------------------


def _server_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models."""
    import httpx

    from llmserve.bench.serve import _api_root

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(_api_root(base_url) + "/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot get a model name from {base_url}/v1/models ({e}); pass --model") from None


def _plot(fn: Any, *args: Any) -> bool:
    """Draw one plot; False (after one line on stderr) when matplotlib is missing."""
    from llmserve.bench.plots import MissingPlotDependency

    try:
        path = fn(*args)
    except MissingPlotDependency as e:
        print(f"llmserve bench: {e}", file=sys.stderr)
        return False
    print(f"plot written to {path}", file=sys.stderr)
    return True


def run_serve(args: argparse.Namespace) -> int:
    from llmserve.bench.datasets import load_bench_tokenizer, make_salt
    from llmserve.bench.report import default_result_path, format_serving, format_sweep, write_json
    from llmserve.bench.serve import benchmark_serving
    from llmserve.bench.stats import parse_goodput

    goodput = parse_goodput(args.goodput) or None
    # httpx logs every request at INFO: thousands of lines that would bury the progress bar
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    tokenizer = load_bench_tokenizer(args.tokenizer)
    model = args.model or _server_model(args.base_url, args.api_key)
    levels: list[int | None] = list(args.max_concurrency or [None])
    results = []
    for level in levels:
        # cold: a new salt per run, and each sweep level is a run of its own
        salt = make_salt() if args.cache == "cold" else None
        requests = build_requests(args, tokenizer, salt, args.max_model_len)
        result = asyncio.run(
            benchmark_serving(
                args.base_url, model, requests,
                endpoint=args.endpoint, max_concurrency=level, request_rate=args.request_rate,
                burstiness=args.burstiness, ignore_eos=args.ignore_eos, temperature=args.temperature,
                api_key=args.api_key, seed=args.seed, progress=not args.disable_tqdm, goodput=goodput,
                num_warmups=args.num_warmups, tokenizer=tokenizer,
            )
        )  # fmt: skip
        result.config = {**_config(args), "salt": salt}
        results.append(result.to_dict())
        print(format_serving(results[-1]))

    path = default_result_path("serve", args.result_dir, args.result_file)
    if len(results) == 1:
        data = results[0]
    else:
        print(format_sweep(results))
        data = {
            "sweep": "max_concurrency", "levels": levels, "base_url": args.base_url, "model": model,
            "config": _config(args), "results": results,
        }  # fmt: skip
    write_json(data, path)
    print(f"results written to {path}", file=sys.stderr)
    if args.plot:
        _write_plots(results, levels, path)
    return _exit_status(results)


def _write_plots(results: list[dict[str, Any]], levels: list[int | None], result_path: Path) -> None:
    """<stem>-latency.png for one run; <stem>-c<N>-latency.png per level and <stem>-sweep.png for a sweep."""
    from llmserve.bench import plots

    stem = result_path.with_suffix("")
    for level, result_dict in zip(levels, results, strict=True):
        suffix = "" if len(results) == 1 else f"-c{level}"
        if not _plot(plots.plot_latencies, result_dict, Path(f"{stem}{suffix}-latency.png")):
            return  # no matplotlib: said once
    if len(results) > 1:
        _plot(plots.plot_sweep, results, Path(f"{stem}-sweep.png"))


def _exit_status(results: list[dict[str, Any]]) -> int:
    if any(r["completed"] for r in results):
        return 0
    errors = [rec["error"] for r in results for rec in r["requests"] if rec["error"]]
    print(
        f"llmserve bench: every request failed; first error: {errors[0] if errors else '?'}", file=sys.stderr
    )
    return 1


# -- bench throughput / latency ------------------------------------------------------------------


def run_throughput(args: argparse.Namespace) -> int:
    from llmserve import LLM
    from llmserve.bench.offline import run_throughput as measure

    if args.model_tag is not None:
        args.model = args.model_tag
    llm = LLM(**llm_kwargs(args))
    requests = build_requests(args, llm.get_tokenizer(), None, llm.engine.max_model_len)
    result = measure(llm, requests, progress=not args.disable_tqdm)
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s "
        f"({result['num_requests']} requests in {result['elapsed_time']:.2f} s)"
    )
    _save({**result, "model": llm.engine.loaded.source.name, "config": _config(args)}, args, "throughput")
    return 0


def run_latency(args: argparse.Namespace) -> int:
    from llmserve.bench.offline import latency_tests
    from llmserve.bench.offline import run_latency as measure
    from llmserve.bench.report import format_llama_bench
    from llmserve.engine.llm import build_engine

    if args.model_tag is not None:
        args.model = args.model_tag
    tests = latency_tests(args.prompt_lens, args.gen_lens, args.batch_size)
    if not tests:
        raise ValueError("nothing to run: give --prompt-lens and/or --gen-lens")
    engine = build_engine(**llm_kwargs(args))
    rows = measure(engine, tests, args.repetitions, args.seed)
    print(format_llama_bench(rows))
    _save({"tests": rows, "config": _config(args)}, args, "latency")
    return 0
