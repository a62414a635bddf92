"""Tokenizers: text <-> token ids and chat templates for HF folders and GGUF files.

`load_tokenizer(source)` gives a `Tokenizer` for a resolved `ModelSource`.
"""

from llmserve.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
