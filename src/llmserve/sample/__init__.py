"""Batched sampling: penalties, logit bias, temperature, top-k/top-p/min-p, seeded generators, logprobs.

state.py            RequestSamplingState (per request, across steps), make_generator
metadata.py         SamplingMetadata: one step's parameters as batched tensors
sampler.py          Sampler: logits [B, V] -> tokens [B] (+ logprobs); the order of operations
processing.py       min_tokens ban, logit bias, repetition/frequency/presence penalties
random_sampling.py  temperature, top-k/top-p/min-p, the exponential race
logprobs.py         compute_logprobs, LogprobsTensors (also used for prompt logprobs)
"""

from llmserve.sample.logprobs import LogprobsTensors, compute_logprobs
from llmserve.sample.metadata import PenaltyTensors, SamplingMetadata
from llmserve.sample.sampler import Sampler, SamplerOutput
from llmserve.sample.state import RequestSamplingState, make_generator

__all__ = [
    "LogprobsTensors",
    "PenaltyTensors",
    "RequestSamplingState",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_logprobs",
    "make_generator",
]
