"""bertembed: the input embedding layer of BERT and its family, exact, fast and explained.

Names and submodules (`bertembed.parallel`, ...) are imported on first use: `import bertembed` imports no torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from bertembed.sources import DEFAULT_MODEL

__version__ = "0.1.0"

_LAZY = {name: module for module, names in {
    "bertembed.config": ("EmbeddingConfig",),
    "bertembed.embeddings": ("BertEmbeddings", "Embeddings", "Decomposition", "sinusoidal_table"),
    "bertembed.tokenizer": ("Tokenizer", "Encoding"),
    "bertembed.checkpoint": ("load_checkpoint",),
    "bertembed.numpy_layer": ("NumpyEmbeddings",),
    "bertembed.dropin": ("patch", "unpatch"),
    "bertembed.onnx_export": ("export_onnx",),
}.items() for name in names}

__all__ = ["DEFAULT_MODEL", "__version__", *_LAZY]

if TYPE_CHECKING:
    from bertembed.checkpoint import load_checkpoint
    from bertembed.config import EmbeddingConfig
    from bertembed.dropin import patch, unpatch
    from bertembed.embeddings import BertEmbeddings, Decomposition, Embeddings, sinusoidal_table
    from bertembed.numpy_layer import NumpyEmbeddings
    from bertembed.onnx_export import export_onnx
    from bertembed.tokenizer import Encoding, Tokenizer


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    try:  # a submodule (`bertembed.parallel.shard_vocab(...)` after a plain `import bertembed`), imported on first use
        return import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":  # (the submodule exists but lacks one of its own imports)
            raise
    raise AttributeError(f"module 'bertembed' has no attribute {name!r}")
