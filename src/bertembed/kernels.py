"""The fused kernels' former home, kept as an alias: `from bertembed.kernels import fused_embeddings` still works.
New code imports `bertembed.fast`."""

from bertembed.fast import BACKENDS, check_backend, fused_embeddings, select_backend

__all__ = ["BACKENDS", "check_backend", "fused_embeddings", "select_backend"]
