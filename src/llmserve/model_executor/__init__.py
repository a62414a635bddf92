"""Everything between a model on disk and logits: weight loading, KV cache allocation, input batch
building and the forward pass. Knows nothing of scheduling policy or HTTP."""
