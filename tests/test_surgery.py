"""Surgery on the layer: positions past the table (Longformer's, LongEmbed's and PreSumm's recipes, and sin/cos),
and the vocabulary resized as transformers' `resize_token_embeddings` resizes it."""

from __future__ import annotations

import copy

import pytest
import torch

from bertembed import BertEmbeddings, EmbeddingConfig


def _layer(member: str = "bert", positions: int = 12, **keys) -> BertEmbeddings:
    torch.manual_seed(0)
    config = EmbeddingConfig.for_member(member, vocab_size=50, hidden_size=10, dim=10,
                                        max_position_embeddings=positions, **keys)
    return BertEmbeddings(config).eval()


@pytest.mark.parametrize("member", ["bert", "roberta"])
@pytest.mark.parametrize("method", ["copy", "repeat_last", "sinusoidal"])
def test_extended_tables_keep_old_rows_and_old_outputs_bit_for_bit(member, method):
    layer = _layer(member, positions=12 if member == "bert" else 14)  # RoBERTa: 2 reserved rows + 12
    before = copy.deepcopy(layer)
    old = layer.position_embeddings.weight.detach().clone()
    layer.extend_positions(36, method)
    reserved = layer.config.first_position
    table = layer.position_embeddings.weight.detach()
    assert table.shape[0] == reserved + 36 == layer.config.max_position_embeddings
    assert torch.equal(table[:old.shape[0]], old)  # reserved rows and old rows, verbatim
    ids = torch.randint(3, 50, (2, 12))
    with torch.no_grad():
        assert torch.equal(layer(ids), before(ids))
        assert layer(torch.randint(3, 50, (1, 36))).shape == (1, 36, 10)  # and now 36 tokens run
    new = table[old.shape[0]:]
    usable = old[reserved:]
    if method == "copy":  # Longformer: the learned rows tiled
        assert torch.equal(new, usable.repeat(3, 1)[12:])
    elif method == "repeat_last":  # PreSumm
        assert torch.equal(new, usable[-1:].expand_as(new))
    else:  # sin/cos at their positions, scaled to the learned rows' mean norm
        from bertembed import sinusoidal_table

        expected = sinusoidal_table(36, 10).double()[12:]
        scale = usable.double().norm(dim=1).mean()
        torch.testing.assert_close(new.double(), expected * scale / expected.norm(dim=1, keepdim=True), rtol=1e-6,
                                   atol=1e-7)


def test_interpolation_places_old_rows_at_f_times_i_with_linear_blends_between():
    layer = _layer(positions=8)
    old = layer.position_embeddings.weight.detach().clone().double()
    table = layer.extend_positions(24, "interpolate").position_embeddings.weight.detach().double()
    for i in range(8):
        torch.testing.assert_close(table[3 * i], old[i], rtol=0, atol=1e-7)  # old row i at 3i
    for i in range(7):  # between 3i and 3(i+1): (2/3, 1/3) and (1/3, 2/3) blends
        torch.testing.assert_close(table[3 * i + 1], old[i] * 2 / 3 + old[i + 1] / 3, rtol=0, atol=1e-6)
        torch.testing.assert_close(table[3 * i + 2], old[i] / 3 + old[i + 1] * 2 / 3, rtol=0, atol=1e-6)
    assert torch.equal(table[22].float(), table[21].float()) and torch.equal(table[23].float(), table[21].float())
    with pytest.raises(ValueError, match="whole multiple"):
        _layer(positions=8).extend_positions(20, "interpolate")


@pytest.mark.parametrize("bad, match", [(8, "above the 12 positions"), (12, "above the 12"), ("x", "integer"),
                                        (2**20 + 1, "at most 1,048,576")])  # (a typo: 12 GB, then out of memory)
def test_extending_refuses_what_is_not_an_extension(bad, match):
    with pytest.raises(ValueError, match=match):
        _layer().extend_positions(bad)
    with pytest.raises(ValueError, match="not one of"):
        _layer().extend_positions(24, "stretch")
    modern = BertEmbeddings(EmbeddingConfig.for_member("modernbert", vocab_size=20, hidden_size=8, pad_token_id=0))
    with pytest.raises(ValueError, match="no position table"):
        modern.extend_positions(24)


def test_an_extended_layer_saves_and_loads(tmp_path):
    layer = _layer().extend_positions(24, "copy")
    layer.save_pretrained(tmp_path)
    loaded = BertEmbeddings.from_pretrained(tmp_path)
    assert loaded.config.max_position_embeddings == 24
    assert torch.equal(loaded.position_embeddings.weight, layer.position_embeddings.weight)


@pytest.mark.parametrize("init", ["mean", "normal"])
@pytest.mark.parametrize("n, multiple", [(61, None), (61, 8), (40, None)])
def test_resize_vocab_matches_transformers_resize_token_embeddings(init, n, multiple):
    """The same start, the same seed: the same table as transformers' own resize of a BertModel."""
    import transformers

    layer = _layer()
    with torch.no_grad():
        layer.word_embeddings.weight[0] = 0.5  # a trained pad row: kept, not zeroed again
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=50, hidden_size=10, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
        max_position_embeddings=12))
    model.embeddings.word_embeddings.weight.data.copy_(layer.word_embeddings.weight)
    torch.manual_seed(7)
    model.resize_token_embeddings(n, pad_to_multiple_of=multiple, mean_resizing=init == "mean")
    torch.manual_seed(7)
    layer.resize_vocab(n, pad_to_multiple_of=multiple, init=init)
    theirs = model.embeddings.word_embeddings.weight.detach()
    assert layer.config.vocab_size == theirs.shape[0] == (64 if multiple else n)
    if init == "mean" or n <= 50:
        assert torch.equal(layer.word_embeddings.weight.detach(), theirs)
    else:  # transformers' _init_weights draws the new rows its own way: the kept rows equal, the new ones' spread
        assert torch.equal(layer.word_embeddings.weight[:50].detach(), theirs[:50])
        assert abs(float(layer.word_embeddings.weight[50:].std()) - 0.02) < 0.01
    assert layer.word_embeddings.weight[0].eq(0.5).all() and layer.word_embeddings.padding_idx == 0


def test_resize_vocab_refuses_to_drop_the_padding_row_and_bad_sizes():
    layer = _layer(member="roberta", positions=14)  # pad 1
    with pytest.raises(ValueError, match="would drop the padding row 1"):
        layer.resize_vocab(1)
    with pytest.raises(ValueError, match="positive"):
        layer.resize_vocab(0)
    with pytest.raises(ValueError, match="init="):
        layer.resize_vocab(60, init="zeros")
