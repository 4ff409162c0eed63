"""The GPU worker: one process per tensor-parallel rank. It owns the model (`model/`), weight
loading (`weights.py`), the paged KV cache, varlen attention, the sampler and `ModelRunner`,
which applies each iteration plan and returns the sampled tokens.

This package may import torch; `shared/` and the scheduling core may not."""
