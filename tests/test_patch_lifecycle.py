"""A patched layer goes through every path transformers and accelerate take a model through, as the layer it replaced:
built on the meta device then `to_empty` and `init_weights` (FSDP2's recipe, accelerate's empty weights), its
buffers, state-dict keys and type, tied weights, saving and loading, and `generate` with a cache. Each test holds the
patched model to the same model unpatched, on every member (conftest.FAMILY)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")
transformers = pytest.importorskip("transformers", reason="the references are transformers models (the dev extra)")

import bertembed  # noqa: E402
from conftest import FAMILY  # noqa: E402

# each member with the head that ties its word table (where it has one) or its base model
_HEADS = {"bert": "AutoModelForMaskedLM", "roberta": "AutoModelForMaskedLM", "xlm-roberta": "AutoModelForMaskedLM",
          "camembert": "AutoModelForMaskedLM", "distilbert": "AutoModelForMaskedLM",
          "distilbert-sinusoidal": "AutoModelForMaskedLM", "albert": "AutoModelForMaskedLM",
          "electra": "AutoModelForMaskedLM", "electra-square": "AutoModelForMaskedLM",
          "deberta": "AutoModelForMaskedLM", "deberta-v3": "AutoModelForMaskedLM",
          "deberta-v2-factorised": "AutoModel", "mpnet": "AutoModelForMaskedLM", "modernbert": "AutoModelForMaskedLM"}


def _model_class(name: str):
    model_type, kwargs = FAMILY[name]
    try:
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, KeyError):
        pytest.skip(f"transformers {transformers.__version__} has no {model_type} (newer releases have it)")
    auto = getattr(transformers, _HEADS[name])
    return auto._model_mapping[type(config)], config


def _ids(config, seed: int = 0) -> torch.Tensor:
    pad = config.pad_token_id or 0
    ids = torch.randint(0, config.vocab_size - 1, (2, 9), generator=torch.Generator().manual_seed(seed))
    ids[ids >= pad] += 1
    return ids


def _output(model, ids):
    out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _embeddings(model):
    return model.get_input_embeddings(), next(m for m in model.modules() if "Embeddings" in type(m).__name__)


def _built_on_meta(cls, config, patched: bool, seed: int = 0):
    """The model built on the meta device (patched right after), materialised by `to_empty` and initialised by
    transformers' `init_weights` from `seed`."""
    with torch.device("meta"):
        model = cls(copy.deepcopy(config))
    if patched:
        bertembed.patch(model, backend="cpu")
    model.to_empty(device="cpu")
    with torch.no_grad():  # (uninitialised memory may hold the right values by chance: make it wrong every time)
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(-7)
    torch.manual_seed(seed)
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize("name", list(FAMILY))
def test_a_patched_layer_has_the_type_buffers_and_keys_of_the_layer_it_replaced(name):
    cls, config = _model_class(name)
    model = cls(copy.deepcopy(config)).eval()
    original = _embeddings(model)[1]
    buffers, keys = dict(model.named_buffers()), list(model.state_dict())
    bertembed.patch(model, backend="cpu")
    layer = _embeddings(model)[1]
    assert isinstance(layer, type(original)) and isinstance(layer, bertembed.BertEmbeddings)
    assert dict(model.named_buffers()).keys() == buffers.keys()  # no buffer gained (ModernBERT has none)
    assert all(torch.equal(tensor, buffers[key]) for key, tensor in model.named_buffers())
    assert list(model.state_dict()) == keys
    assert bertembed.unpatch(model) is model and _embeddings(model)[1] is original


@pytest.mark.parametrize("name", list(FAMILY))
def test_built_on_meta_then_to_empty_and_init_weights_a_patched_model_is_the_unpatched_one(name):
    """The same seed gives the same state dict and buffers, patched or not (transformers' `_init_weights` finds the
    patched layer by its type: it refills the default ids and initialises the tables), and the same outputs; so does
    the model unpatched afterwards."""
    cls, config = _model_class(name)
    fresh = cls(copy.deepcopy(config))
    plain = _built_on_meta(cls, config, patched=False)
    if any(not torch.equal(b, dict(fresh.named_buffers())[k]) for k, b in plain.named_buffers()):
        pytest.skip(f"transformers {transformers.__version__} does not refill buffers in init_weights, even unpatched")
    patched = _built_on_meta(cls, config, patched=True)
    expected, got = plain.state_dict(keep_vars=False), patched.state_dict()
    assert list(got) == list(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    assert dict(patched.named_buffers()).keys() == dict(plain.named_buffers()).keys()
    for key, buffer in plain.named_buffers():
        assert torch.equal(dict(patched.named_buffers())[key], buffer), key
    ids = _ids(config)
    with torch.no_grad():
        reference = _output(plain, ids)
        torch.testing.assert_close(_output(patched, ids), reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_output(bertembed.unpatch(patched), ids), reference, rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in FAMILY if _HEADS[n] != "AutoModel"])
def test_a_patched_model_ties_saves_and_loads_as_transformers_does(name, tmp_path):
    """`tie_weights` ties the decoder to the patched word table; `save_pretrained` writes the unpatched model's keys,
    and transformers loads them with nothing missing or unexpected, to the same outputs."""
    cls, config = _model_class(name)
    torch.manual_seed(1)
    model = cls(copy.deepcopy(config)).eval()
    ids = _ids(config)
    with torch.no_grad():
        expected = _output(model, ids)
    model.save_pretrained(tmp_path / "plain")
    bertembed.patch(model, backend="cpu")
    model.tie_weights()
    word, _ = _embeddings(model)
    tied = model.get_output_embeddings()
    if tied is not None and getattr(model.config, "tie_word_embeddings", True):
        assert tied.weight is word.weight
    model.save_pretrained(tmp_path / "patched")
    from safetensors import safe_open

    def saved_keys(folder):
        with safe_open(folder / "model.safetensors", "pt") as f:
            return sorted(f.keys())

    assert saved_keys(tmp_path / "patched") == saved_keys(tmp_path / "plain")
    # the patched layer's own save: refused, where ALBERT's, ELECTRA's and DeBERTa's would miss or misname a table
    with pytest.raises(ValueError, match="cannot save a layer that bertembed.patch put into a model"):
        _embeddings(model)[1].save_pretrained(tmp_path / "layer")
    assert not (tmp_path / "layer").exists()
    loaded, info = cls.from_pretrained(tmp_path / "patched", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        torch.testing.assert_close(_output(loaded.eval(), ids), expected, rtol=0, atol=0)
        torch.testing.assert_close(_output(model, ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(FAMILY))
def test_accelerate_empty_weights_then_a_checkpoint_loads_a_patched_model(name, tmp_path):
    """accelerate's recipe: the model built with empty weights, patched, then loaded from a checkpoint (with a
    device map): the outputs of transformers' own `from_pretrained`."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate's loading path is what this tests")
    cls, config = _model_class(name)
    torch.manual_seed(2)
    cls(copy.deepcopy(config)).save_pretrained(tmp_path)
    reference = cls.from_pretrained(tmp_path).eval()

    def loaded(patched: bool):
        with accelerate.init_empty_weights():
            model = cls(copy.deepcopy(config))
        if patched:
            bertembed.patch(model, backend="cpu")
        model.tie_weights()  # (before the device map, as accelerate asks: a tied decoder is not in the checkpoint)
        return accelerate.load_checkpoint_and_dispatch(model, str(tmp_path / "model.safetensors"),
                                                       device_map={"": "cpu"}).eval()

    try:
        model = loaded(patched=True)
    except NotImplementedError as error:  # (transformers 4.40 with today's accelerate)
        with pytest.raises(NotImplementedError):  # where the unpatched model cannot be loaded either
            loaded(patched=False)
        pytest.skip(f"accelerate {accelerate.__version__} cannot load transformers {transformers.__version__}'s "
                    f"model this way even unpatched: {error}")
    ids = _ids(config)
    with torch.no_grad():
        torch.testing.assert_close(_output(model, ids), _output(reference, ids), rtol=1e-5, atol=1e-5)


_DECODERS = {"bert": "BertLMHeadModel", "roberta": "RobertaForCausalLM", "xlm-roberta": "XLMRobertaForCausalLM",
             "camembert": "CamembertForCausalLM", "electra": "ElectraForCausalLM"}


@pytest.mark.parametrize("name", list(_DECODERS))
def test_generate_with_a_cache_gives_the_unpatched_tokens(name):
    """Members with a causal-LM head: greedy `generate` with the key-value cache (the layer takes the cache offset
    for every new token) gives the unpatched model's tokens and scores."""
    model_type, kwargs = FAMILY[name]
    config = transformers.AutoConfig.for_model(model_type, **kwargs, is_decoder=True)
    torch.manual_seed(3)
    model = getattr(transformers, _DECODERS[name])(config).eval()
    prompt = _ids(config)[:, :4]
    settings = dict(max_new_tokens=8, do_sample=False, use_cache=True, return_dict_in_generate=True,
                    output_scores=True, pad_token_id=config.pad_token_id or 0)
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    bertembed.patch(model, backend="cpu")
    got = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_patched_model_pickles_and_deep_copies():
    """The patched layer's class is made when patching: a pickled or copied model still holds a patched layer of the
    same type, with the same outputs."""
    import pickle

    cls, config = _model_class("bert")
    model = bertembed.patch(cls(copy.deepcopy(config)).eval(), backend="cpu")
    ids = _ids(config)
    with torch.no_grad():
        expected = _output(model, ids)
        for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            assert type(_embeddings(copied)[1]) is type(_embeddings(model)[1])
            torch.testing.assert_close(_output(copied, ids), expected, rtol=0, atol=0)
