"""Helpers of benchmarks/bench_cpu_scale.py, one role per module (never imported by the package):

plan     what one run measures: the model sizes (1b, 3b, smoke), the quants, the workload
files    the random Llama folder (gpu/model.py), its GGUF conversion (llama.cpp's converter, or the
         gguf package's writer when llama.cpp's sources are absent) and `llama-quantize`
memory   the machine's streaming read bandwidth, and a server's resident memory sampled from /proc
servers  `llmserve serve` and `llama-server` on one file, one at a time, driven by `llmserve bench serve`
report   the machine, one table per file, issue 30's targets, the plot
"""
