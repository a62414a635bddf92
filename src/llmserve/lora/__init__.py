"""LoRA adapters (PEFT folders) applied beside the base model's linear layers.

    request.py  `LoRARequest`, the user's handle on an adapter (no torch: core/ may read it)
    adapter.py  loading and checking a PEFT folder into per-layer (A, B) pairs
    gguf_adapter.py  llama.cpp's GGUF LoRA files read as a PEFT folder's tensors
    layers.py   `LoRALinear`, the wrapper that adds the adapters' deltas to a base layer's output
    triton_lora.py  the same deltas as two Triton kernels (the GPU path)
    fused.py    `FusedLoRA`: adapters handed to the fused CPU decoder, which adds the deltas in C++
    manager.py  `LoRAManager`: installs the wrappers, caches adapters (LRU), builds a step's groups

Models stay architecture only: the runner installs the wrappers around their layers.
"""

from llmserve.lora.request import LoRARequest, module_requests

__all__ = ["LoRARequest", "module_requests"]
