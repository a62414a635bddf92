"""Batched sampling: penalties, logit bias, temperature, top-k/top-p/min-p, seeded generators, logprobs.

state.py            RequestSamplingState (per request, across steps), make_generator
metadata.py         SamplingMetadata: one step's parameters as batched tensors, built in one host->device
                    copy; SamplingDevicePolicy: the sampler's device decisions
packing.py          HostPack: a step's per-row numbers in one (pinned) buffer, one copy
sampler.py          Sampler: logits [B, V] -> tokens [B] (+ logprobs); the order of operations;
                    SamplerOutput.to_host, the step's one device->host copy
processing.py       min_tokens ban, logit bias, repetition/frequency/presence penalties
random_sampling.py  temperature, the filters, the exponential race and its draws
filters.py          top-k/top-p/min-p from the largest few logits (a sort only for a top-p row
                    without top-k), equal to the sort-based reference
philox.py           counter-based Exp(1) draws keyed by (seed, output position), in torch ops
philox_triton.py    the same in one Triton launch for every seeded row
logprobs.py         compute_logprobs, LogprobsTensors (also used for prompt logprobs)
rejection.py        verify_proposals: speculative decoding's verification, each row picked as
                    plain decoding would pick it (pure sampling code, so it lives here)
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
