"""Scheduling and KV-cache bookkeeping: pure Python, no torch, no devices, no tokenizers.

It consumes model-runner outputs as data (`sched_output.py`) and is unit-tested with fakes."""
