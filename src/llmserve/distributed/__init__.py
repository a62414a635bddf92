"""Tensor parallelism: the process group that joins the ranks (group.py) and how a Llama-family
model is cut into per-rank shards (sharding.py). The driver/worker processes that run the shards
live in model_executor/ (tp_executor.py, tp_worker.py): they drive forward runners, which this
room does not know."""
