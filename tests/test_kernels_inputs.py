"""Inputs that transformers' layer takes and the fused layer must take too, with the reference's numbers: segment and
position ids that broadcast to [B, L], and a position table longer than the config says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")

from kernel_helpers import assert_grads_match, assert_output_close, awkward_ids, twins  # noqa: E402


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("shapes", ["types [1, L]", "types [L]", "types [B, 1]", "positions [L]", "positions [B, 1]"])
def test_segment_and_position_ids_that_broadcast(shapes, grad):
    """transformers' layer takes segment and position ids of any shape that broadcasts to [B, L] (it adds the rows
    they pick): the fused layer gives the reference's numbers for them, where it used to refuse them."""
    ref, fused = twins(24, "cpu", vocab=500)
    ids = awkward_ids(3, 9, 500)
    gen = torch.Generator().manual_seed(2)
    given = {"types [1, L]": dict(token_type_ids=torch.randint(0, 2, (1, 9), generator=gen)),
             "types [L]": dict(token_type_ids=torch.randint(0, 2, (9,), generator=gen)),
             "types [B, 1]": dict(token_type_ids=torch.tensor([[0], [1], [1]])),
             "positions [L]": dict(position_ids=torch.randperm(9, generator=gen)),
             "positions [B, 1]": dict(position_ids=torch.tensor([[3], [0], [7]]))}[shapes]
    full = {name: value.expand(3, 9) for name, value in given.items()}
    with torch.set_grad_enabled(grad):
        out_ref, out_full, out = ref(ids, **given), ref(ids, **full), fused(ids, **given)
    torch.testing.assert_close(out_ref, out_full, rtol=0, atol=0)  # the same as the full [B, L]
    assert_output_close(out, out_ref)
    if grad:
        upstream = torch.randn(out.shape, generator=gen)
        (out_ref * upstream).sum().backward()
        (out * upstream).sum().backward()
        assert_grads_match(ref, fused)


@pytest.mark.parametrize("mode", ["inference", "autograd", "training"])
def test_a_position_table_extended_past_the_config(mode):
    """A position table replaced by a longer one (to embed longer inputs), with the config and the default-id
    buffers left as they were: every path takes positions up to the new table's rows, and the numbers are
    LayerNorm(word + segment + position) by torch.nn.functional."""
    ref, fused = twins(24, "cpu", vocab=500, max_position_embeddings=16)
    longer = torch.randn(40, 24, generator=torch.Generator().manual_seed(3))
    for layer in (ref, fused):
        layer.position_embeddings = nn.Embedding.from_pretrained(longer.clone(), freeze=False)
        layer.train(mode == "training")  # (hidden_dropout_prob 0.1: compared at p 0)
        layer.dropout.p = 0.0
    ids = awkward_ids(2, 30, 500)
    with torch.set_grad_enabled(mode != "inference"):
        outs = [layer(ids, past_key_values_length=4) for layer in (ref, fused)]
    expected = F.layer_norm(ref.word_embeddings.weight[ids] + ref.token_type_embeddings.weight[0]
                            + longer[4:34], (24,), ref.LayerNorm.weight, ref.LayerNorm.bias, 1e-12)
    for out in outs:
        assert_output_close(out, expected)
    for layer in (ref, fused):
        with pytest.raises(ValueError, match="the position table has 40 rows"):
            layer(ids, past_key_values_length=11)
