"""The reference layer against transformers' BertEmbeddings with the same weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bertembed import BertEmbeddings, EmbeddingConfig, NumpyEmbeddings
from bertembed.embeddings import sinusoidal_table
from conftest import hf_offset_name


def _inputs(config, batch=3, length=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (batch, length), generator=g)
    ids[1, 10:] = config.pad_token_id  # a padded row
    types = torch.randint(0, config.type_vocab_size, (batch, length), generator=g)
    return ids, types


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("name", ["bert-base", "bert-large", "tiny-odd", "one-type"])
def test_matches_transformers(hf_checkpoint, name):
    folder, hf_model = hf_checkpoint(name)
    hf = hf_model.embeddings
    ours = BertEmbeddings.from_pretrained(folder).eval()
    ids, types = _inputs(ours.config)
    with torch.no_grad():
        cases = {
            "ids only": ({"input_ids": ids}, {}),
            "with token types": ({"input_ids": ids, "token_type_ids": types}, {}),
            "position offset": ({"input_ids": ids[:, :5], hf_offset_name(): 7}, {}),
            "explicit positions": ({"input_ids": ids, "position_ids": torch.arange(17).flip(0)[None]}, {}),
            # (transformers 5 takes [L] positions only beside segment ids: its default ones gather at the positions)
            "positions [L]": ({"input_ids": ids, "token_type_ids": types, "position_ids": torch.arange(17).flip(0)},
                              {}),
            "token types [1, L]": ({"input_ids": ids, "token_type_ids": types[:1]}, {}),
            "token types [L]": ({"input_ids": ids, "token_type_ids": types[0]}, {}),
            "inputs_embeds": ({"inputs_embeds": torch.randn(2, 9, ours.config.hidden_size)}, {}),
            "length 1": ({"input_ids": ids[:1, :1]}, {}),
        }
        for label, (kwargs, _) in cases.items():
            diff = max_diff(ours(**kwargs), hf(**kwargs))
            assert diff <= 1e-6, f"{name}, {label}: {diff}"


def test_bundled_checkpoint_bit_for_bit(bundled_hf_embeddings):
    ours = BertEmbeddings.from_pretrained().eval()
    ids = torch.tensor([[101, 1996, 4248, 2829, 4419, 14523, 2058, 1996, 13971, 3899, 102]])
    full = torch.randint(0, 30522, (2, 512), generator=torch.Generator().manual_seed(1))
    types = (torch.arange(512) > 200).long().expand(2, 512)
    with torch.no_grad():
        assert torch.equal(ours(ids), bundled_hf_embeddings(ids))
        assert torch.equal(ours(full, types), bundled_hf_embeddings(full, types))


def test_state_dicts_move_both_ways(hf_checkpoint):
    _, hf_model = hf_checkpoint("tiny-odd")
    hf = hf_model.embeddings
    ours = BertEmbeddings(EmbeddingConfig(vocab_size=1000, hidden_size=30, max_position_embeddings=64))
    ours.load_state_dict(hf.state_dict())  # strict: every key and shape
    assert set(ours.state_dict()) == set(hf.state_dict())
    for key, value in hf.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value)
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertEmbeddings as HFEmbeddings

    back = HFEmbeddings(BertConfig(vocab_size=1000, hidden_size=30, max_position_embeddings=64))
    torch.nn.init.zeros_(back.word_embeddings.weight)
    back.load_state_dict(ours.state_dict())
    assert torch.equal(back.word_embeddings.weight, hf.word_embeddings.weight)


def test_decompose_recombines_to_forward():
    torch.manual_seed(0)
    layer = BertEmbeddings(EmbeddingConfig(vocab_size=300, hidden_size=30, max_position_embeddings=40)).eval()
    with torch.no_grad():
        layer.LayerNorm.weight.uniform_(0.5, 1.5)
        layer.LayerNorm.bias.uniform_(-1, 1)
    ids, types = _inputs(layer.config, length=40)
    with torch.no_grad():
        parts = layer.decompose(ids, types)
        out = layer(ids, types)
    assert torch.equal(parts.output, out)
    assert torch.equal(parts.sum, parts.word + parts.segment + parts.position)
    assert torch.equal(parts.word, layer.word_embeddings.weight[ids])
    assert torch.equal(parts.position[0], layer.position_embeddings.weight[:40])
    assert torch.equal(parts.segment, layer.token_type_embeddings.weight[types])
    total = parts.sum.double().numpy()  # independent statistics in float64 numpy
    np.testing.assert_allclose(parts.mean.numpy(), total.mean(-1), atol=1e-7)
    np.testing.assert_allclose(parts.std.numpy(), np.sqrt(total.var(-1) + 1e-12), rtol=1e-6)
    by_hand = (parts.sum - parts.mean[..., None]) / parts.std[..., None] * layer.LayerNorm.weight + layer.LayerNorm.bias
    assert max_diff(by_hand, out) <= 1e-6


def test_dropout_only_in_training():
    layer = BertEmbeddings(EmbeddingConfig(vocab_size=100, hidden_size=64, max_position_embeddings=256))
    ids = torch.randint(1, 100, (8, 256))
    layer.eval()
    assert torch.equal(layer(ids), layer(ids))
    layer.train()
    torch.manual_seed(0)
    dropped = layer(ids)
    reference = layer.LayerNorm(layer.word_embeddings(ids) + layer.token_type_embeddings.weight[0]
                                + layer.position_embeddings.weight[:256])
    zero = dropped == 0
    assert abs(zero.float().mean().item() - 0.1) < 0.01  # p = 0.1
    torch.testing.assert_close(dropped[~zero], reference[~zero] / 0.9)


def test_tables_trainable_and_defaults_are_buffers():
    layer = BertEmbeddings()
    names = {n for n, p in layer.named_parameters() if p.requires_grad}
    assert names == {"word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
                     "LayerNorm.weight", "LayerNorm.bias"}
    assert layer.config.layer_norm_eps == 1e-12 and layer.LayerNorm.eps == 1e-12
    assert torch.count_nonzero(layer.word_embeddings.weight[0]) == 0  # [PAD] row
    assert "position_ids" not in layer.state_dict() and "token_type_ids" not in layer.state_dict()
    assert set(dict(layer.named_buffers())) == {"position_ids", "token_type_ids"}


def test_sinusoidal_positions_are_fixed_and_match_the_formula():
    config = EmbeddingConfig(vocab_size=50, hidden_size=16, max_position_embeddings=32,
                             position_embedding_type="sinusoidal")
    layer = BertEmbeddings(config)
    assert "position_embeddings.weight" not in dict(layer.named_parameters())
    assert "position_embeddings.weight" not in layer.state_dict()
    expected = np.array([[math.sin(p / 10000 ** (i / 16)) if i % 2 == 0 else math.cos(p / 10000 ** ((i - 1) / 16))
                          for i in range(16)] for p in range(32)])
    np.testing.assert_allclose(sinusoidal_table(32, 16).numpy(), expected, atol=1e-6)
    parts = layer.decompose(torch.ones(1, 5, dtype=torch.long))
    np.testing.assert_allclose(parts.position[0].numpy(), expected[:5], atol=1e-6)


def test_no_position_type_adds_nothing():
    layer = BertEmbeddings(EmbeddingConfig(vocab_size=50, hidden_size=16, position_embedding_type="none")).eval()
    ids = torch.randint(0, 50, (2, 512))
    assert layer(torch.zeros(1, 513, dtype=torch.long)).shape == (1, 513, 16)  # no table, no limit here (as ModernBERT)
    with torch.no_grad():
        expected = layer.LayerNorm(layer.word_embeddings(ids) + layer.token_type_embeddings.weight[0])
        torch.testing.assert_close(layer(ids), expected, rtol=0, atol=0)


def test_config_presets_and_hf_round_trip(hf_checkpoint):
    assert EmbeddingConfig.bert_base().hidden_size == 768
    large = EmbeddingConfig.bert_large()
    assert (large.hidden_size, large.vocab_size, large.max_position_embeddings) == (1024, 30522, 512)
    folder, hf_model = hf_checkpoint("one-type")
    config = EmbeddingConfig.from_hf_config(folder)
    assert (config.hidden_size, config.type_vocab_size, config.vocab_size) == (48, 1, 500)
    from transformers import BertConfig

    back = BertConfig(**config.to_hf_config())
    assert (back.hidden_size, back.type_vocab_size, back.layer_norm_eps) == (48, 1, 1e-12)
    assert EmbeddingConfig.from_hf_config({"position_embedding_type": "relative_key"}).position_embedding_type == "none"


def test_numpy_layer_matches_torch_layer(bundled_hf_embeddings):
    layer = NumpyEmbeddings.from_pretrained()
    ids = np.random.default_rng(0).integers(0, 30522, (2, 512))
    types = (np.arange(512) > 100).astype(np.int64)[None].repeat(2, 0)
    parts = layer.decompose(ids, types)
    with torch.no_grad():
        expected = bundled_hf_embeddings(torch.from_numpy(ids), torch.from_numpy(types)).numpy()
    assert np.abs(parts["output"] - expected).max() <= 1e-6
    for bad in (types.astype(np.float32), types.astype(bool), types[:, :5]):  # (numpy would index with them, or fail)
        with pytest.raises(ValueError, match=r"token_type_ids must be an integer array \[B, L\] \(input_ids'\)"):
            layer.decompose(ids, bad)


@settings(max_examples=25, deadline=None)
@given(hidden=st.integers(2, 70), vocab=st.integers(2, 60), positions=st.integers(1, 40), types=st.integers(1, 3),
       batch=st.integers(1, 3), data=st.data())
def test_any_shape_matches_transformers(hidden, vocab, positions, types, batch, data):
    """Random sizes and ids (hypothesis): the same weights give the same output as transformers' layer."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertEmbeddings as HFEmbeddings

    length = data.draw(st.integers(1, positions))
    offset = data.draw(st.integers(0, positions - length))
    seed = data.draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    hf = HFEmbeddings(BertConfig(vocab_size=vocab, hidden_size=hidden, max_position_embeddings=positions,
                                 type_vocab_size=types)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_()
    ours = BertEmbeddings(EmbeddingConfig(vocab_size=vocab, hidden_size=hidden, max_position_embeddings=positions,
                                          type_vocab_size=types)).eval()
    ours.load_state_dict(hf.state_dict())
    ids = torch.randint(0, vocab, (batch, length))
    token_types = torch.randint(0, types, (batch, length))
    with torch.no_grad():
        expected = hf(ids, token_types, **{hf_offset_name(): offset})
        assert max_diff(ours(ids, token_types, past_key_values_length=offset), expected) <= 1e-6


def test_cache_offset_under_either_name(hf_checkpoint):
    """transformers 4 names the offset past_key_values_length, 5 cache_length: the layer, its decomposition and
    fused_embeddings take both, as one number, and refuse two different ones."""
    folder, hf_model = hf_checkpoint("tiny-odd")
    ours = BertEmbeddings.from_pretrained(folder)
    ids = torch.randint(1, 1000, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model.embeddings(ids, **{hf_offset_name(): 6})
        for kwargs in ({"cache_length": 6}, {"past_key_values_length": 6},
                       {"cache_length": 6, "past_key_values_length": 6}):
            assert torch.equal(ours(ids, **kwargs), expected), kwargs
            assert torch.equal(ours.decompose(ids, **kwargs).output, expected), kwargs
        assert not torch.equal(ours(ids), expected)
    for call in (ours, ours.decompose):
        with pytest.raises(ValueError, match="cache_length=6 and past_key_values_length=5 .* differ"):
            call(ids, cache_length=6, past_key_values_length=5)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_roberta_embeds_at_full_length_take_an_offset_they_do_not_use(backend):
    """Given inputs_embeds, RoBERTa's positions count from pad + 1 whatever the cache offset (transformers'
    create_position_ids_from_inputs_embeds): every usable position fills, and the offset is not held against it."""
    import copy
    import inspect

    from bertembed import patch
    from conftest import member_or_skip
    from kernel_helpers import assert_output_close

    if backend == "cpu":
        pytest.importorskip("numba", reason="the fused CPU kernels need numba")
    model = member_or_skip("roberta")
    hf, ours = model.embeddings, patch(copy.deepcopy(model), backend=backend).embeddings
    usable = hf.position_embeddings.num_embeddings - hf.padding_idx - 1
    # (the name the installed transformers gives the offset, which the drop-in takes too)
    name = "cache_length" if "cache_length" in inspect.signature(hf.forward).parameters else "past_key_values_length"
    x = torch.randn(2, usable, hf.word_embeddings.embedding_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, expected = ours(inputs_embeds=x, **{name: 5}), hf(inputs_embeds=x, **{name: 5})
        if backend == "reference":
            assert torch.equal(got, expected)
        else:  # (the fused kernel's tolerance: a few float32 ulps of the output's scale)
            assert_output_close(got, expected)
        with pytest.raises(ValueError, match=rf"a sequence of {usable + 1} tokens needs positions up to"):
            ours(inputs_embeds=torch.cat([x, x[:, :1]], 1), **{name: 5})
