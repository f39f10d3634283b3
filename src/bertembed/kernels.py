"""Removed: the alias of `bertembed.fast` (the fused kernels)."""

raise ImportError("bertembed.kernels was removed: import bertembed.fast instead (fused_embeddings, BACKENDS, ...)")
