"""Building blocks shared by every architecture: linear, norms, rotary, activations, embedding,
and attention backends. A layer knows shapes and math, never which requests are in the batch."""
