"""Helpers for the explain tests (imported by tests/test_explain_*.py): a tiny random checkpoint with its own
WordPiece vocabulary, small enough that every analysis, the fine-tune and the report run in a second or two.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bertembed.config import EmbeddingConfig
from bertembed.embeddings import BertEmbeddings

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "cat", "dog", "sat", "on", "mat", "good", "bad",
         "film", "i", "loved", "it", "hated", "king", "queen", "was", "not", "fun", "##s", ".", ",", "quick", "fox"]
TINY_SENTENCES = (("i loved the film", 1), ("a good film", 1), ("i hated it", 0), ("the film was bad", 0))
POSITIONS = 16
HIDDEN = 10  # not a power of two


def make_tiny(folder: Path, seed: int = 0, **config) -> Path:
    """Save a random embedding layer (BERT's init: [PAD] row zero, LayerNorm made non-trivial) and its vocab."""
    torch.manual_seed(seed)
    cfg = EmbeddingConfig(**{"vocab_size": len(VOCAB), "hidden_size": HIDDEN, "max_position_embeddings": POSITIONS,
                             **config})
    layer = BertEmbeddings(cfg)
    with torch.no_grad():
        for table in (layer.word_embeddings, layer.position_embeddings, layer.token_type_embeddings):
            table.weight.mul_(25)  # norms near 1, like trained tables
        layer.word_embeddings.weight[cfg.pad_token_id].zero_()
        layer.LayerNorm.weight.uniform_(0.5, 1.5)
        layer.LayerNorm.bias.uniform_(-0.2, 0.2)
    layer.save_pretrained(folder)
    (Path(folder) / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return Path(folder)


def load_tables(folder) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint folder read independently of bertembed (safetensors directly)."""
    from safetensors.torch import load_file

    from bertembed.sources import resolve

    source = resolve(folder)
    tensors = load_file(str(source.folder / "model.safetensors"))
    prefix = next(k for k in tensors if k.endswith("word_embeddings.weight"))[: -len("word_embeddings.weight")]
    return {k[len(prefix):]: v.double() for k, v in tensors.items() if k.startswith(prefix)}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """Folder of the tiny random checkpoint."""
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_b(tmp_path_factory, tiny) -> tuple[Path, dict]:
    """A copy of `tiny` with known rows changed: word rows 7 and 19 (by 0.5 and 0.1), position row 3 (by 0.2)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("tiny_b")
    tensors = load_file(str(tiny / "model.safetensors"))
    changes = {("embeddings.word_embeddings.weight", 7): 0.5, ("embeddings.word_embeddings.weight", 19): 0.1,
               ("embeddings.position_embeddings.weight", 3): 0.2}
    for (key, row), amount in changes.items():
        tensors[key][row] += amount
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "vocab.txt"):
        (folder / name).write_bytes((tiny / name).read_bytes())
    return folder, changes


@pytest.fixture(scope="session")
def bundled():
    """The bundled all-MiniLM-L6-v2 tables, loaded once (numpy)."""
    from bertembed.numpy_layer import NumpyEmbeddings

    return NumpyEmbeddings.from_pretrained()
