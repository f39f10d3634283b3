"""Never silently wrong (issue 31): other model families, unreadable tables, index paths outside the checkpoint,
ambiguous names, badly typed configs, half-done loads and inconsistent saves are all refused with a clear error.
(Atomic saves are tested in test_checkpoint.py.)"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from bertembed import BertEmbeddings, EmbeddingConfig, NumpyEmbeddings, load_checkpoint
from bertembed.sources import Source
from conftest import make_hf_model

NAMES = ["word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
         "LayerNorm.weight", "LayerNorm.bias"]
SMALL = dict(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37)
SUPPORTED = r"supported: bert, roberta, xlm-roberta"

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"  # (a commit hash, as the hub names snapshots)


def _family_model(family: str):
    """A model of another family, built by transformers itself (the independent reference for its layout)."""
    import transformers as tf

    torch.manual_seed(0)
    return {
        "roberta": lambda: tf.RobertaModel(tf.RobertaConfig(max_position_embeddings=514, **SMALL)),
        "roberta-mlm": lambda: tf.RobertaForMaskedLM(tf.RobertaConfig(max_position_embeddings=514, **SMALL)),
        "distilbert": lambda: tf.DistilBertModel(tf.DistilBertConfig(vocab_size=99, dim=32, n_layers=1, n_heads=2,
                                                                     hidden_dim=37)),
        "albert": lambda: tf.AlbertModel(tf.AlbertConfig(embedding_size=16, **SMALL)),
        "electra": lambda: tf.ElectraModel(tf.ElectraConfig(embedding_size=16, **SMALL)),
    }[family]()


@pytest.fixture(scope="module")
def family_folder(tmp_path_factory):
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = tmp_path_factory.mktemp(family)
            _family_model(family).save_pretrained(cache[family])
        return cache[family]

    return get


def _copy(source, target, edit=None):
    shutil.copytree(source, target)
    if edit is not None:
        config = json.loads((target / "config.json").read_text())
        edit(config)
        (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("model_type", ["gpt2", "funnel", "longformer", ["bert"]])
def test_members_bertembed_does_not_read_are_refused_naming_those_it_does(tmp_path, model_type):
    _tiny(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": model_type, "architectures": None}))
    for read in (BertEmbeddings.from_pretrained, NumpyEmbeddings.from_pretrained):
        with pytest.raises(ValueError, match=f"model_type .*which bertembed does not read; {SUPPORTED}"):
            read(tmp_path)


@pytest.mark.parametrize("family,found", [("roberta", "padding row of a RoBERTa-style table"),
                                          ("roberta-mlm", "'roberta.embeddings.*a tensor of roberta/"),
                                          ("distilbert", "q_lin.*a tensor of distilbert checkpoints"),
                                          ("albert", "embedding_hidden_mapping_in.*a tensor of albert checkpoints"),
                                          ("electra", "embeddings_project.*a tensor of electra checkpoints")])
def test_disguised_families_are_refused_by_their_tensors(family_folder, tmp_path, family, found):
    """config.json edited to say BERT, or deleted: the tensors' names and layout still tell."""
    keys = load_file(family_folder(family) / "model.safetensors").keys()
    assert "embeddings.word_embeddings.weight" in keys or "roberta.embeddings.word_embeddings.weight" in keys
    only_type = _copy(family_folder(family), tmp_path / "type", lambda c: c.update(model_type="bert"))
    with pytest.raises(ValueError, match="says model_type 'bert' but names architecture .*inconsistent"):
        BertEmbeddings.from_pretrained(only_type)
    as_bert = _copy(family_folder(family), tmp_path / "bert",
                    lambda c: c.update(model_type="bert", architectures=["BertModel"]))
    without = _copy(family_folder(family), tmp_path / "none")
    (without / "config.json").unlink()
    for folder in (as_bert, without):
        for read in (BertEmbeddings.from_pretrained, NumpyEmbeddings.from_pretrained):
            with pytest.raises(ValueError, match=found):
                read(folder)


@pytest.mark.parametrize("key,family", [("embeddings.tok_embeddings.weight", "modernbert"),
                                        ("emb_ln.weight", "nomic_bert")])
def test_names_of_other_layouts_are_refused(tmp_path, key, family):
    state = {f"embeddings.{n}": v for n, v in BertEmbeddings(EmbeddingConfig(vocab_size=20, hidden_size=8,
                                                                             max_position_embeddings=16)).state_dict().items()}
    save_file({**state, key: torch.ones(8)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"{key}.*{family} checkpoints.*{SUPPORTED}"):
        BertEmbeddings.from_pretrained(tmp_path)


@pytest.mark.parametrize("model_class", ["BertModel", "BertForMaskedLM"])
def test_bert_checkpoints_still_load_exactly(tmp_path, model_class, bundled_hf_embeddings):
    import transformers

    model = make_hf_model("tiny-odd", seed=4, model_class=getattr(transformers, model_class))
    model.save_pretrained(tmp_path)
    hf = model.bert.embeddings if hasattr(model, "bert") else model.embeddings
    layer = BertEmbeddings.from_pretrained(tmp_path)
    ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(layer(ids), hf(ids))
    bundled = BertEmbeddings.from_pretrained()
    for name in NAMES:
        assert torch.equal(layer.state_dict()[name], hf.state_dict()[name]), name
        assert torch.equal(bundled.state_dict()[name], bundled_hf_embeddings.state_dict()[name]), name


@pytest.mark.parametrize("table", ["position_embeddings", "token_type_embeddings"])
def test_a_missing_table_is_not_bert_layout(tmp_path, table):
    """No position table under an absolute config (NomicBERT's rotary layout), or no token type table (DistilBERT's,
    MPNet's): refused, as the config says there is one."""
    _tiny(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state[f"embeddings.{table}.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"missing embedding tensor.*{table}.*that its config \\(bert\\) implies"):
        BertEmbeddings.from_pretrained(tmp_path)


def test_a_bert_position_table_extended_with_zeros_still_loads(tmp_path):
    """Zero rows only at the end (positions added for longer inputs, not trained yet) are no padding row."""
    layer = _tiny(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    key = "embeddings.position_embeddings.weight"
    state[key] = torch.cat([state[key], torch.zeros(8, 8)])
    save_file(state, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 24}))
    loaded = BertEmbeddings.from_pretrained(tmp_path)
    assert torch.equal(loaded.position_embeddings.weight[:16], layer.position_embeddings.weight)


def _tiny(folder, seed=0, **config):
    torch.manual_seed(seed)
    layer = BertEmbeddings(EmbeddingConfig(vocab_size=20, hidden_size=8, max_position_embeddings=16, **config))
    with torch.no_grad():
        layer.LayerNorm.weight.uniform_(0.5, 1.5)
    layer.save_pretrained(folder)
    return layer


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool])
@pytest.mark.parametrize("form", ["safetensors", "bin"])
def test_integer_and_bool_tables_are_refused(tmp_path, dtype, form):
    _tiny(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["embeddings.token_type_embeddings.weight"] = state["embeddings.token_type_embeddings.weight"].to(dtype)
    if form == "bin":
        (tmp_path / "model.safetensors").unlink()
        torch.save(state, tmp_path / "pytorch_model.bin")
    else:
        save_file(state, tmp_path / "model.safetensors")
    for read in (BertEmbeddings.from_pretrained, NumpyEmbeddings.from_pretrained):
        with pytest.raises(ValueError, match=f"token_type_embeddings.weight is stored as "
                                             f"{str(dtype).removeprefix('torch.')}"):
            read(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_float_tables_of_any_width_are_read(tmp_path, dtype):
    layer = _tiny(tmp_path / "f32")
    (tmp_path / "other").mkdir()
    shutil.copy(tmp_path / "f32" / "config.json", tmp_path / "other")
    save_file({f"embeddings.{k}": v.to(dtype) for k, v in layer.state_dict().items()},
              tmp_path / "other" / "model.safetensors")
    loaded = BertEmbeddings.from_pretrained(tmp_path / "other")
    arrays = load_checkpoint(tmp_path / "other", framework="np").tensors  # numpy: bfloat16 arrives as float32
    for name, value in layer.state_dict().items():
        expected = value.to(dtype).float()
        assert torch.equal(loaded.state_dict()[name], expected), name
        assert torch.equal(torch.from_numpy(arrays[name]).float(), expected), name


def _sharded(folder):
    """A two-shard checkpoint of a tiny layer: the word table in one shard, the rest in the other."""
    layer = _tiny(folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    word = "embeddings.word_embeddings.weight"
    save_file({word: state.pop(word)}, folder / "a.safetensors")
    save_file(state, folder / "b.safetensors")
    weight_map = {word: "a.safetensors", **{k: "b.safetensors" for k in state}}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return layer, weight_map


def _point_word_shard_to(folder, name):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["embeddings.word_embeddings.weight"] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_index_shards_outside_the_folder_are_not_followed(tmp_path):
    _sharded(tmp_path / "ckpt")
    assert BertEmbeddings.from_pretrained(tmp_path / "ckpt")
    shutil.copy(tmp_path / "ckpt" / "a.safetensors", tmp_path / "outside.safetensors")  # a readable file out there
    (tmp_path / "ckpt" / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    for name in ("../outside.safetensors", str(tmp_path / "outside.safetensors"), "link.safetensors",
                 "sub/../../outside.safetensors"):
        _point_word_shard_to(tmp_path / "ckpt", name)
        with pytest.raises(ValueError, match="outside the checkpoint's folder|not a file inside the checkpoint"):
            BertEmbeddings.from_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "sub").mkdir()
    (tmp_path / "ckpt" / "a.safetensors").rename(tmp_path / "ckpt" / "sub" / "a.safetensors")
    _point_word_shard_to(tmp_path / "ckpt", "sub/a.safetensors")  # a subfolder is inside
    assert BertEmbeddings.from_pretrained(tmp_path / "ckpt")


def test_hub_index_is_confined_to_the_snapshot(tmp_path, monkeypatch):
    """A hub index naming '../..' is refused before anything is asked of the hub; a hub cache snapshot opened as a
    local folder, whose files link into the repository's blobs, still loads."""
    snapshot = tmp_path / "models--acme--bert" / "snapshots" / "0123"
    blobs = tmp_path / "models--acme--bert" / "blobs"
    layer, weight_map = _sharded(tmp_path / "files")
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in (tmp_path / "files").iterdir():
        shutil.move(path, blobs / path.name)
        (snapshot / path.name).symlink_to(os.path.relpath(blobs / path.name, snapshot))
    loaded = BertEmbeddings.from_pretrained(snapshot)
    assert torch.equal(loaded.word_embeddings.weight, layer.word_embeddings.weight)
    asked = []

    def hub_file(repo, filename, revision, local_files_only):
        asked.append(filename)
        return snapshot / filename if (snapshot / filename).exists() else None

    monkeypatch.setattr("bertembed.sources._hub_file", hub_file)
    _point_word_shard_to(blobs.parent / "blobs", "../../blobs/a.safetensors")  # (the index is a blob too)
    with pytest.raises(ValueError, match="not a file inside the checkpoint"):
        BertEmbeddings.from_pretrained(Source("hub", "acme/bert", snapshot))
    assert not any(".." in name for name in asked)


def test_legacy_and_current_names_together_are_ambiguous(tmp_path):
    _tiny(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["embeddings.LayerNorm.gamma"] = state["embeddings.LayerNorm.weight"] + 1
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="both 'embeddings.LayerNorm.(weight|gamma)' and "
                                         "'embeddings.LayerNorm.(gamma|weight)'.*ambiguous"):
        BertEmbeddings.from_pretrained(tmp_path)


@pytest.mark.parametrize("field,value", [
    ("pad_token_id", 1.0), ("pad_token_id", True), ("pad_token_id", "0"), ("vocab_size", 20.0),
    ("initializer_range", "0.02"), ("initializer_range", True), ("initializer_range", float("inf")),
    ("layer_norm_eps", "1e-12"), ("layer_norm_eps", float("nan")), ("layer_norm_eps", False),
    ("hidden_dropout_prob", "0.1"), ("hidden_dropout_prob", [0.1]), ("position_embedding_type", ["absolute"]),
])
def test_config_types_are_checked_on_every_path(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"{field}"):
        EmbeddingConfig(**{field: value})
    _tiny(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    for read in (BertEmbeddings.from_pretrained, NumpyEmbeddings.from_pretrained, EmbeddingConfig.from_hf_config):
        with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}: .*{field}"):
            read(tmp_path)


def _quantized(value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch 2.13 deprecates quantized tensors; checkpoints may still hold them)
        return torch.quantize_per_tensor(value, 0.1, 0, torch.qint8)


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")  # (torch.load of a quantized tensor)
@pytest.mark.parametrize("kind", ["sparse", "meta", "quantized", "int64", "ndarray"])
def test_a_failed_load_changes_nothing(tmp_path, kind):
    layer = _tiny(tmp_path)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    changed = {k: v + 1 for k, v in before.items()}
    last = list(changed)[-1]  # torch copies in order: only the last key fails, after the others were copied
    changed[last] = {"sparse": lambda v: v.to_sparse(), "meta": lambda v: v.to("meta"), "quantized": _quantized,
                     "int64": lambda v: v.long(), "ndarray": lambda v: v.numpy()}[kind](changed[last])
    with pytest.raises(ValueError, match=f"nothing was loaded.*{last} is "):
        layer.load_state_dict(changed)
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), key
    if kind != "ndarray":  # the same state dict as a checkpoint file
        torch.save(changed, tmp_path / "weights.pt")
        with pytest.raises(ValueError, match=last):
            layer.load_pretrained_weights(tmp_path / "weights.pt")
        for key, value in layer.state_dict().items():
            assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("break_it,message", [
    (lambda layer: setattr(layer.word_embeddings, "weight", torch.nn.Parameter(torch.zeros(20, 17))),
     r"word_embeddings.weight is \(20, 17\), but layer.config says \(20, 8\)"),
    (lambda layer: setattr(layer.position_embeddings, "weight", torch.nn.Parameter(torch.zeros(30, 8))),
     r"position_embeddings.weight is \(30, 8\)"),
    (lambda layer: setattr(layer.token_type_embeddings, "weight", torch.nn.Parameter(torch.zeros(2, 8).long(),
                                                                                     requires_grad=False)),
     "token_type_embeddings.weight is of dtype torch.int64"),
    (lambda layer: setattr(layer.LayerNorm, "eps", 1e-5), "LayerNorm.eps is 1e-05, but layer.config says 1e-12"),
])
def test_an_inconsistent_layer_is_not_saved(tmp_path, break_it, message):
    layer = _tiny(tmp_path / "old")
    before = {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()}
    break_it(layer)
    for folder in (tmp_path / "new", tmp_path / "old"):
        with pytest.raises(ValueError, match=f"{message}.*nothing was written"):
            layer.save_pretrained(folder)
    assert not (tmp_path / "new").exists()
    assert {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # no temporary folder left beside it



def test_a_name_no_file_system_takes_is_a_clear_error():
    """A name over 255 bytes made `Path.is_dir()` raise a raw OSError (errno 36) out of `from_pretrained`."""
    for load in (BertEmbeddings.from_pretrained, lambda n: load_checkpoint(n, framework="np")):
        with pytest.raises(FileNotFoundError, match="cannot be a file or folder .*too long"):
            load("a" * 300)
        with pytest.raises(FileNotFoundError, match="neither an existing file or folder nor a hub model id"):
            load("org/" + "b" * 300)  # (no folder "org": the name is not a path, and too long for a hub id)
        for name in ("bert..base", "org/a--b"):  # (the hub's rules: huggingface_hub's own error came out)
            with pytest.raises(FileNotFoundError, match="neither an existing file or folder nor a hub model id"):
                load(name)


@pytest.fixture(scope="module")
def linked_checkpoint(tmp_path_factory):
    """A checkpoint whose config differs from BERT's defaults (eps 1e-5, padding id 3), with every tokenizer file,
    laid out as huggingface_hub's cache lays it out: snapshot files are relative links into the repository's blobs."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertModel

    root = tmp_path_factory.mktemp("linked")
    torch.manual_seed(0)
    BertModel(BertConfig(layer_norm_eps=1e-5, pad_token_id=3, **SMALL)).save_pretrained(root / "files")
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, **{f"w{i}": i for i in range(4, 99)}}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.save(str(root / "files" / "tokenizer.json"))
    (root / "files" / "vocab.txt").write_text("".join(f"{t}\n" for t in vocab))
    (root / "files" / "tokenizer_config.json").write_text('{"do_lower_case": false, "model_max_length": 20}')
    repo = root / "hub" / "models--acme--linked"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    (repo / "snapshots" / SNAPSHOT).mkdir(parents=True)
    shutil.copytree(root / "files", repo / "blobs")
    for path in (repo / "blobs").iterdir():
        (repo / "snapshots" / SNAPSHOT / path.name).symlink_to(f"../../blobs/{path.name}")
    return root


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                                  "vocab.txt"])
@pytest.mark.parametrize("where", ["folder", "hub cache"])
def test_a_link_to_nothing_is_a_broken_checkpoint_not_a_missing_file(linked_checkpoint, tmp_path, monkeypatch, name,
                                                                     where):
    """A file that is a link to nothing (a hub snapshot whose blob was deleted, a link that loops) was read as absent:
    a dangling config.json gave BERT's defaults (eps 1e-12, padding id 0) with an INFO line, a dangling tokenizer.json
    fell back to vocab.txt. Each file a layer or its tokenizer reads is refused, naming it, in a folder or the cache."""
    from bertembed import Tokenizer

    if where == "folder":
        src = tmp_path / "ckpt"
        shutil.copytree(linked_checkpoint / "files", src)
        (src / name).unlink()
        (src / name).symlink_to(name)  # a loop
    else:
        src = tmp_path / "hub" / "models--acme--linked"
        shutil.copytree(linked_checkpoint / "hub" / "models--acme--linked", src, symlinks=True)
        (src / "blobs" / name).unlink()
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
        src = "acme/linked"
    if name == "vocab.txt":  # (read where there is no tokenizer.json)
        os.unlink(tmp_path / "ckpt" / "tokenizer.json" if where == "folder" else
                  tmp_path / "hub" / "models--acme--linked" / "snapshots" / SNAPSHOT / "tokenizer.json")
    layer, tokenizer = name in ("config.json", "model.safetensors"), name != "model.safetensors"
    for load in [BertEmbeddings.from_pretrained] * layer + [Tokenizer.from_pretrained] * tokenizer:
        with pytest.raises(ValueError, match=rf"{name} is a link to .*, which does not exist \(or loops back\)"):
            load(src)
