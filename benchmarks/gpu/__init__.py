"""Helpers of benchmarks/bench_gpu.py, one role per module (never imported by the package):

plan     what one run measures: the model's shape, devices, sizes (the H100 plan and --smoke's)
model    the random Llama folder (transformers `save_pretrained`) with SmolLM2's tokenizer beside it
floor    every weight matrix read once per step by cuBLAS matvecs, replayed from one CUDA graph
runs     `llmserve bench latency|throughput` and `llmserve serve` + `llmserve bench serve`, as
         subprocesses, each one's JSON read back
report   the machine and versions, the table, the issue's targets, the plot
"""
