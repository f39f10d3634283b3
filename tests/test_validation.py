"""Bad input fails where it enters, with the value, the limit and the fix; never torch's raw index error."""

from __future__ import annotations

import pytest
import torch

from bertembed import BertEmbeddings, EmbeddingConfig

CONFIG = EmbeddingConfig(vocab_size=100, hidden_size=8, max_position_embeddings=16, type_vocab_size=2)
IDS = torch.ones(2, 5, dtype=torch.long)

CASES = {
    "id at vocabulary size": (dict(input_ids=torch.tensor([[1, 100]])), r"holds 100 at index \(0, 1\).*\[0, 100\)"),
    "negative id": (dict(input_ids=torch.tensor([[-1, 3]])), r"holds -1 .*\[0, 100\)"),
    "segment 2": (dict(input_ids=IDS, token_type_ids=torch.full((2, 5), 2)), r"token_type_ids holds 2 .*\[0, 2\)"),
    "too long": (dict(input_ids=torch.ones(1, 17, dtype=torch.long)), r"17 tokens .*16 rows: truncate to 16"),
    "too long with offset": (dict(input_ids=IDS, past_key_values_length=12), r"offset .*=12 .*up to 16.*truncate to 4"),
    "float ids": (dict(input_ids=torch.ones(2, 5)), r"dtype torch.float32.*must be integers.*\.long\(\)"),
    "byte ids": (dict(input_ids=torch.ones(2, 5, dtype=torch.uint8)), r"torch.uint8.*64 or 32 bits.*\.long\(\)"),
    "float segments": (dict(input_ids=IDS, token_type_ids=torch.zeros(2, 5)), r"token_type_ids has dtype"),
    "segment shape": (dict(input_ids=IDS, token_type_ids=torch.zeros(2, 4, dtype=torch.long)),
                      r"shape \(2, 4\).*\(2, 5\)"),
    "position shape": (dict(input_ids=IDS, position_ids=torch.zeros(3, 5, dtype=torch.long)),
                       r"position_ids has shape"),
    "position range": (dict(input_ids=IDS, position_ids=torch.full((1, 5), 16)), r"position_ids holds 16.*\[0, 16\)"),
    "both": (dict(input_ids=IDS, inputs_embeds=torch.zeros(2, 5, 8)), r"exactly one .*got both"),
    "neither": (dict(), r"exactly one .*got neither"),
    "1-D ids": (dict(input_ids=torch.ones(5, dtype=torch.long)), r"shape \[B, L\].*reshape\(1, -1\)"),
    "3-D ids": (dict(input_ids=torch.ones(2, 1, 5, dtype=torch.long)), r"shape \[B, L\].*reshape\(-1, "),
    "embeds width": (dict(inputs_embeds=torch.zeros(2, 5, 9)), r"\[B, L, 8\], got \(2, 5, 9\)"),
    "negative offset": (dict(input_ids=IDS, past_key_values_length=-1), r"non-negative"),
    "list ids": (dict(input_ids=[[1, 2]]), r"must be a torch.Tensor"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_value_error(case):
    kwargs, pattern = CASES[case]
    layer = BertEmbeddings(CONFIG)
    with pytest.raises(ValueError, match=pattern) as info:
        layer(**kwargs)
    assert "index out of range in self" not in str(info.value)
    with pytest.raises(ValueError, match=pattern):
        layer.decompose(**kwargs)


def test_a_segment_id_past_a_one_row_table_gets_that_members_fix():
    """RoBERTa's family has one segment row: "1 for the second segment" would be wrong there."""
    layer = BertEmbeddings(EmbeddingConfig.from_hf_config({"model_type": "roberta", "vocab_size": 100, "hidden_size": 8,
                                                           "max_position_embeddings": 16, "type_vocab_size": 1}))
    with pytest.raises(ValueError, match=r"token_type_ids holds 1 .*\[0, 1\): the table has one row: use 0 "
                                         r"throughout, or leave token_type_ids out$"):
        layer(IDS + 2, token_type_ids=torch.ones(2, 5, dtype=torch.long))


def test_edges_that_are_allowed():
    layer = BertEmbeddings(CONFIG).eval()
    assert layer(torch.ones(1, 16, dtype=torch.long)).shape == (1, 16, 8)  # exactly the table's length
    assert layer(IDS, past_key_values_length=11).shape == (2, 5, 8)
    assert layer(IDS.int(), token_type_ids=torch.ones(2, 5, dtype=torch.int32)).shape == (2, 5, 8)
    assert layer(IDS, position_ids=torch.arange(5)[None]).shape == (2, 5, 8)  # [1, L] is shared by the batch


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(hidden_size=0), r"hidden_size must be an integer >= 1, got 0"),
    (dict(type_vocab_size=-1), r"type_vocab_size must be an integer >= 0, got -1"),  # (0: no segment table)
    (dict(pad_token_id=100, vocab_size=100), "pad_token_id"),
    (dict(pad_token_id=None, positions_from_padding=True), "pad_token_id must be an integer, got None"),
    (dict(position_embedding_type="rotary"), "not one of"), (dict(hidden_dropout_prob=1.0), r"\[0, 1\)"),
    (dict(position_embedding_type="sinusoidal", hidden_size=7), "even width"),
])
def test_bad_configs(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        EmbeddingConfig(**kwargs)
