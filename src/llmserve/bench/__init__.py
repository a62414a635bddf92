"""`llmserve bench`: measure a server, the offline engine, or raw prompt/decode speed.

    datasets.py  the request lists: random token text of exact lengths, ShareGPT, shared prefix
    arrival.py   when each request is sent (Poisson / gamma inter-arrival times)
    client.py    one streamed OpenAI request, timed from the client side -> RequestRecord
    stats.py     RequestRecords -> vLLM-style summary metrics (mean/median/std/p90/p99, goodput)
    serve.py     `benchmark_serving`: a load generator for any OpenAI-compatible server
    offline.py   `llmserve bench throughput` and `latency` on the in-process engine
    plots.py     PNG latency distributions and throughput-vs-TTFT sweeps (matplotlib, optional)
    report.py    printed tables and JSON result files

Owns: workloads, timing and reporting. Does not know the server's internals: `serve.py` speaks
only HTTP, so it measures vLLM or llama.cpp's llama-server the same way it measures llmserve.
"""
