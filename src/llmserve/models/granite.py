"""IBM Granite 3.x dense (`GraniteForCausalLM`): the Llama architecture with four multipliers
from its config, each read where llama.py applies it: `embedding_multiplier` (the embeddings),
`attention_multiplier` (the attention scale, in place of 1 / sqrt(head_dim)),
`residual_multiplier` (each sublayer's output before the residual add; the fused CPU decoder's
`residual_scale`), and here `logits_scaling`, which divides the logits."""

from __future__ import annotations

from typing import Any

import torch

from llmserve.layers.attention import AttentionBackend
from llmserve.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        logits = super().compute_logits(hidden)
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling
