"""Structured outputs: `StructuredOutputsParams` (JSON schema, JSON object, regex, choice, grammar)
compiled into a grammar for the model's tokenizer, a matcher per request that says which tokens
may come next, and the bitmask that the sampler applies to the logits.

    manager.py       StructuredOutputManager: compile + validate (ParameterError), cache by
                     constraint, one GrammarState per request
    ll_tokenizer.py  build_ll_tokenizer: the vocabulary as llguidance reads it (special tokens
                     are never text under a grammar)
    bitmask.py       apply_bitmask: packed allowed-token bits -> -inf logits

The grammar engine is llguidance (Microsoft's Rust library, the one vLLM and llama.cpp also use):
grammars are built lazily, so compiling a schema costs little, and a token mask takes tens of
microseconds. Knows nothing of scheduling or HTTP.
"""

from llmserve.structured_output.bitmask import apply_bitmask, bitmask_words, to_device_async
from llmserve.structured_output.manager import GrammarState, StructuredOutputManager

__all__ = ["GrammarState", "StructuredOutputManager", "apply_bitmask", "bitmask_words", "to_device_async"]
