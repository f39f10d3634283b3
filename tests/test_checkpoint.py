"""Loading the embedding tensors from every kind of checkpoint, saving them, and failing cleanly."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bertembed import BertEmbeddings, load_checkpoint
from conftest import hub_cache, make_hf_model

NAMES = ["word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
         "LayerNorm.weight", "LayerNorm.bias"]


def assert_same_weights(layer: BertEmbeddings, hf_embeddings) -> None:
    for name in NAMES:
        assert torch.equal(layer.state_dict()[name], hf_embeddings.state_dict()[name]), name


def test_folder_safetensors(hf_checkpoint):
    folder, model = hf_checkpoint("tiny-odd")
    layer = BertEmbeddings.from_pretrained(folder)
    assert_same_weights(layer, model.embeddings)
    assert layer.source.kind == "folder"


def test_a_loaded_layer_is_in_eval_mode_as_transformers_models_are(hf_checkpoint):
    """transformers' from_pretrained returns a model in eval mode; a loaded layer must not apply dropout either."""
    folder, _ = hf_checkpoint("tiny-odd")
    from transformers import BertModel

    hf = BertModel.from_pretrained(folder)
    layer = BertEmbeddings.from_pretrained(folder)
    assert layer.training == hf.training == hf.embeddings.training is False
    ids = torch.randint(1, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(layer(ids), hf.embeddings(ids), rtol=0, atol=1e-6)


def test_bin_folder_and_single_files(tmp_path):
    model = make_hf_model("tiny-odd", seed=3)
    (tmp_path / "bin").mkdir()
    model.config.to_json_file(tmp_path / "bin" / "config.json")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")  # as transformers 4 wrote it
    assert_same_weights(BertEmbeddings.from_pretrained(tmp_path / "bin"), model.embeddings)
    # a lone weights file: config.json beside it is used; without one, sizes come from the shapes
    assert_same_weights(BertEmbeddings.from_pretrained(tmp_path / "bin" / "pytorch_model.bin"), model.embeddings)
    lone = tmp_path / "lone" / "weights.pt"
    lone.parent.mkdir()
    torch.save(model.state_dict(), lone)
    layer = BertEmbeddings.from_pretrained(lone)
    assert (layer.config.hidden_size, layer.config.vocab_size, layer.config.max_position_embeddings) == (30, 1000, 64)
    assert_same_weights(layer, model.embeddings)


def test_sharded_reads_only_the_shards_it_needs(tmp_path):
    from transformers import BertConfig, BertModel

    torch.manual_seed(1)
    model = BertModel(BertConfig(hidden_size=128, num_hidden_layers=8, intermediate_size=512, num_attention_heads=2))
    model.save_pretrained(tmp_path, max_shard_size="4MB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    needed = {index["weight_map"][f"embeddings.{n}"] for n in NAMES}
    assert len(shards) > len(needed)
    for shard in shards - needed:  # only the embedding shards must exist
        (tmp_path / shard).unlink()
    assert_same_weights(BertEmbeddings.from_pretrained(tmp_path), model.embeddings)


def test_prefixes_and_legacy_names(tmp_path):
    from transformers import BertForPreTraining

    model = make_hf_model("tiny-odd", seed=2, model_class=BertForPreTraining)
    model.save_pretrained(tmp_path / "pretraining")  # keys start with "bert.embeddings."
    assert_same_weights(BertEmbeddings.from_pretrained(tmp_path / "pretraining"), model.bert.embeddings)
    # a TF-era checkpoint: LayerNorm.gamma / LayerNorm.beta
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in model.state_dict().items()}
    (tmp_path / "legacy").mkdir()
    torch.save(state, tmp_path / "legacy" / "pytorch_model.bin")
    shutil.copy(tmp_path / "pretraining" / "config.json", tmp_path / "legacy")
    assert_same_weights(BertEmbeddings.from_pretrained(tmp_path / "legacy"), model.bert.embeddings)


def test_stored_position_ids_buffer_is_ignored(bundled_path):
    keys = load_file(bundled_path / "model.safetensors").keys()
    assert "embeddings.position_ids" in keys  # the bundled checkpoint stores it
    assert "position_ids" not in load_checkpoint().tensors


def test_save_then_load_both_ways(tmp_path, hf_checkpoint):
    folder, model = hf_checkpoint("tiny-odd")
    layer = BertEmbeddings.from_pretrained(folder)
    layer.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["config.json", "model.safetensors"]
    again = BertEmbeddings.from_pretrained(tmp_path / "saved")
    assert again.config == layer.config
    for name in NAMES:
        assert torch.equal(again.state_dict()[name], layer.state_dict()[name])
    from transformers import BertModel  # transformers reads the embedding-only checkpoint too

    hf = BertModel.from_pretrained(tmp_path / "saved")
    assert_same_weights(layer, hf.embeddings)


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_saving_the_layer_over_a_whole_model_is_refused(tmp_path, shard):
    """Into the folder of the model it came from, the embedding-only model.safetensors would replace the model's (or,
    beside shards or a .bin, be what transformers reads): refused, nothing written. Its own folder it replaces."""
    model = make_hf_model("tiny-odd")
    model.save_pretrained(tmp_path / "model", **({"max_shard_size": shard} if shard else {}))
    before = {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()}
    layer = BertEmbeddings.from_pretrained(tmp_path / "model")
    found = "model.safetensors.index.json" if shard else r"a model.safetensors of \d+ tensors beyond an embedding"
    with pytest.raises(ValueError, match=f"it holds {found}.*nothing was written"):
        layer.save_pretrained(tmp_path / "model")
    assert {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()} == before
    layer.save_pretrained(tmp_path / "layer")
    with torch.no_grad():
        layer.word_embeddings.weight.add_(1.0)
    layer.save_pretrained(tmp_path / "layer")  # (a layer's own save, replaced)
    assert torch.equal(BertEmbeddings.from_pretrained(tmp_path / "layer").word_embeddings.weight,
                       layer.word_embeddings.weight)


def test_failed_save_leaves_old_files(tmp_path, monkeypatch):
    layer = BertEmbeddings.from_pretrained()
    layer.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def broken_save(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken_save)
    with torch.no_grad():
        layer.word_embeddings.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        layer.save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # intact, and no temp files left


def _corrupt(tmp_path: Path, source: Path, edit) -> Path:
    target = tmp_path / "broken"
    shutil.copytree(source, target)
    edit(target)
    return target


@pytest.mark.parametrize("case,message", [
    ("missing tensor", "missing embedding tensor"),
    ("shape disagrees", "disagrees with its config"),
    ("truncated", "truncated or corrupt"),
    ("garbage", "truncated or corrupt"),
    ("unknown format", "none of model.safetensors"),
    ("bad json", "not valid JSON"),
])
def test_bad_checkpoints_raise_clear_errors(tmp_path, hf_checkpoint, case, message):
    folder, _ = hf_checkpoint("tiny-odd")
    weights = "model.safetensors"

    def edit(target: Path) -> None:
        path = target / weights
        if case == "missing tensor":
            state = load_file(path)
            del state["embeddings.token_type_embeddings.weight"]
            save_file(state, path)
        elif case == "shape disagrees":
            config = json.loads((target / "config.json").read_text())
            (target / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
        elif case == "truncated":
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        elif case == "garbage":
            path.write_bytes(b"\x00" * 64)
        elif case == "unknown format":
            path.rename(target / "model.h5")
        elif case == "bad json":
            (target / "config.json").write_text("{not json")

    broken = _corrupt(tmp_path, folder, edit)
    error = FileNotFoundError if case == "unknown format" else ValueError
    with pytest.raises(error, match=message):
        BertEmbeddings.from_pretrained(broken)


def test_unknown_single_file_format_and_missing_paths(tmp_path):
    (tmp_path / "weights.h5").write_bytes(b"x")
    with pytest.raises(ValueError, match="unknown weights format"):
        BertEmbeddings.from_pretrained(tmp_path / "weights.h5")
    with pytest.raises(FileNotFoundError, match="neither an existing file"):
        BertEmbeddings.from_pretrained(tmp_path / "nowhere")
    for relative in ("tf/nothing.h5", "org/model.safetensors", "some/config.json"):  # paths, not hub ids
        with pytest.raises(FileNotFoundError, match="neither an existing file"):
            BertEmbeddings.from_pretrained(relative)
    with pytest.raises(FileNotFoundError, match="none of"):
        BertEmbeddings.from_pretrained(tmp_path)


def test_failed_load_leaves_layer_unchanged(tmp_path, hf_checkpoint):
    folder, _ = hf_checkpoint("tiny-odd")
    layer = BertEmbeddings.from_pretrained(folder)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    broken = _corrupt(tmp_path, folder, lambda t: (t / "model.safetensors").write_bytes(b"\x01" * 100))
    with pytest.raises(ValueError):
        layer.load_pretrained_weights(broken)
    bad_state = {k: v + 1 for k, v in before.items()}
    bad_state["LayerNorm.bias"] = torch.zeros(31)  # one wrong shape: torch would copy the others first
    with pytest.raises(ValueError, match="nothing was loaded"):
        layer.load_state_dict(bad_state)
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_hub_id_from_the_local_cache(tmp_path, bundled_path, hub_home):
    """huggingface_hub's cache and offline mode are honoured: the model is found in the cache, offline."""
    from bertembed import Tokenizer

    folder = tmp_path / "src"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(bundled_path / name, folder)
    hub_cache(tmp_path / "home", "acme/mini-bert", folder)
    hub_home(tmp_path / "home")
    layer, tokenizer = BertEmbeddings.from_pretrained("acme/mini-bert"), Tokenizer.from_pretrained("acme/mini-bert")
    expected = load_file(bundled_path / "model.safetensors")["embeddings.word_embeddings.weight"][7592]
    assert layer.source.kind == "hub" and layer.config.hidden_size == 384
    assert tokenizer("hello").input_ids == [101, 7592, 102]
    assert torch.equal(layer.word_embeddings.weight[7592], expected)
    import huggingface_hub
    from packaging.version import Version

    # (the command the installed release has: `hf` came in 0.34, the oldest supported has `huggingface-cli` alone)
    cli = "hf" if Version(huggingface_hub.__version__) >= Version("0.34") else "huggingface-cli"
    with pytest.raises(FileNotFoundError, match=rf"offline mode is on and it is not in the local cache \(.*`{cli} "
                                                r"download acme/not-cached`: the whole snapshot, tokenizer files"):
        BertEmbeddings.from_pretrained("acme/not-cached")
    with pytest.raises(FileNotFoundError, match=rf"not in the local cache at revision 'v2' .*`{cli} download "
                                                r"acme/mini-bert --revision v2`"):  # (cached at main only)
        BertEmbeddings.from_pretrained("acme/mini-bert", revision="v2")


def test_a_partly_cached_hub_id_offline_says_what_the_cache_lacks(tmp_path, bundled_path, hub_home):
    """The cache AutoTokenizer leaves (config and tokenizer, no weights) read as a repo without weights; an id whose
    owner and name are each within the hub's 96 characters, though longer together, was refused as no id."""
    folder = tmp_path / "src"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        shutil.copy(bundled_path / name, folder)
    long_id = "a" * 60 + "/" + "b" * 60
    hub_cache(tmp_path / "home", long_id, folder)
    (folder / "model.safetensors").unlink()
    hub_cache(tmp_path / "home", "acme/tokenizer-only", folder)
    hub_home(tmp_path / "home")
    assert BertEmbeddings.from_pretrained(long_id).config.hidden_size == 384
    with pytest.raises(FileNotFoundError, match=r"has none of model.safetensors, .* \(or not in the local cache, "
                                                r"offline .* download acme/tokenizer-only --revision 0123456789"):
        BertEmbeddings.from_pretrained("acme/tokenizer-only")


def test_a_resolved_source_is_reused_as_it_is(tmp_path, hf_checkpoint):
    """Analyses pass a layer's own Source to the tokenizer, so a hub revision is never dropped on the way."""
    from bertembed.sources import Source, resolve

    pinned = Source("hub", "acme/model", tmp_path, revision="0123abc")
    assert resolve(pinned) is pinned
    folder, _ = hf_checkpoint("tiny-odd")
    layer = BertEmbeddings.from_pretrained(folder)
    assert BertEmbeddings.from_pretrained(layer.source).source == layer.source


def test_the_removed_kernels_alias_names_its_replacement():
    """`bertembed.kernels`, the old alias of `bertembed.fast`, is gone: importing it says where the kernels are."""
    sys.modules.pop("bertembed.kernels", None)
    with pytest.raises(ImportError, match=r"import bertembed\.fast instead"):
        import bertembed.kernels  # noqa: F401
