"""An alias of `bertembed.fast`: `from bertembed.kernels import fused_embeddings` works as before."""

from bertembed.fast import BACKENDS, check_backend, fused_embeddings, select_backend

__all__ = ["BACKENDS", "check_backend", "fused_embeddings", "select_backend"]
