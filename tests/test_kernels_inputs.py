"""Inputs that transformers' layer takes and the fused layer must take too, with the reference's numbers (segment and
position ids that broadcast to [B, L], a position table longer than the config says, no position table, an offset
given as a numpy integer, ids on the meta device), and inputs that every backend must refuse alike before reading
anything (an offset near 2**63, tables of another hidden size, an `out=` buffer that does not fit, sparse or nested
ids)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")

from bertembed.fast import fused_embeddings  # noqa: E402
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


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_no_position_table(grad):
    """position_embedding_type="none" (no position module at all): the fused layer's inference used to raise a
    KeyError looking for it."""
    ref, fused = twins(24, "cpu", vocab=500, position_embedding_type="none")
    ids = awkward_ids(2, 9, 500)
    with torch.set_grad_enabled(grad):
        assert_output_close(fused(ids), ref(ids))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("past", [2**31, 2**63 - 2, 2**63, 2**64 + 1])
def test_a_huge_offset_is_refused(backend, past):
    """An offset near 2**63 must not wrap around in a bound check and let the kernel read outside the position table,
    nor one past 2**64 reach compiled code: both are ValueErrors."""
    layer = twins(24, backend, vocab=500)[1]
    with torch.no_grad(), pytest.raises(ValueError, match="needs positions up to"):
        layer(awkward_ids(1, 3, 500), past_key_values_length=past)


@pytest.mark.parametrize("given", [np.int64(5), np.int32(5), torch.tensor(5)], ids=["np.int64", "np.int32", "0-d"])
def test_an_offset_that_stands_for_an_int(given):
    """transformers' layer slices with the offset, so it takes whatever has `__index__`; every backend takes it too."""
    ref, fused = twins(24, "cpu", vocab=500)
    ids = awkward_ids(2, 7, 500)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            expected = ref(ids, past_key_values_length=5)
            for layer in (ref, fused):
                assert_output_close(layer(ids, past_key_values_length=given), expected)
    for bad in (True, 5.0, torch.tensor(5.0), torch.tensor([5])):
        for layer in (ref, fused):
            with pytest.raises(ValueError, match="non-negative int"):
                layer(ids, past_key_values_length=bad)


def _shrunk(name: str):
    def change(layer):
        module = getattr(layer, name.split(".")[0])
        weight = getattr(module, name.split(".")[1])
        weight.data = weight.data.flatten()[: weight.numel() // weight.shape[-1] * (weight.shape[-1] - 1)] \
            .view(*weight.shape[:-1], weight.shape[-1] - 1)  # one column fewer, inside the old memory
    return change


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("name", ["token_type_embeddings.weight", "position_embeddings.weight", "LayerNorm.weight",
                                  "LayerNorm.bias"])
def test_tables_of_another_hidden_size_are_refused(name, grad):
    """A table or LayerNorm parameter replaced through `.data` with one column fewer than the word table: every
    backend raises the same ValueError before reading anything (the kernels used to read each row's last entry
    from outside the table)."""
    ref, fused = twins(24, "cpu", vocab=500)
    ids = awkward_ids(1, 5, 500)
    if not name.startswith("LayerNorm"):  # a warm call first: the change below must be seen by the next call
        with torch.no_grad():
            fused(ids)
    for layer in (ref, fused):
        _shrunk(name)(layer)
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="must share one hidden size"):
            layer(ids, position_ids=torch.arange(5)[None] if grad else None)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_the_functional_form_refuses_tables_of_another_hidden_size(backend):
    gen = torch.Generator().manual_seed(0)
    word, segment, position = (torch.randn(rows, 32, generator=gen) for rows in (100, 2, 512))
    ids = torch.tensor([[5, 6]])
    with pytest.raises(ValueError, match="position table has shape \\(512, 16\\)"):
        fused_embeddings(ids, word, segment, position[:, :16], torch.ones(32), torch.zeros(32), backend=backend)
    with pytest.raises(ValueError, match="LayerNorm bias has shape \\(31,\\)"):
        fused_embeddings(ids, word, segment, position, torch.ones(32), torch.zeros(31), backend=backend)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_out_buffers_are_checked_alike(backend):
    """`out=` takes the same buffers on every backend, the reference included (it used to copy into any buffer that
    broadcast, of any dtype)."""
    gen = torch.Generator().manual_seed(0)
    tables = [torch.randn(rows, 16, generator=gen) for rows in (100, 2, 64)] + [torch.ones(16), torch.zeros(16)]
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        expected = fused_embeddings(ids, *tables, backend="reference")
        out = torch.empty(1, 3, 16)
        assert fused_embeddings(ids, *tables, backend=backend, out=out) is out
        assert_output_close(out, expected)
        for bad in (torch.empty(1, 3, 16, dtype=torch.float64), torch.empty(1, 16, 3).transpose(1, 2),
                    torch.empty(3, 16)):
            with pytest.raises(ValueError, match="out= must be"):
                fused_embeddings(ids, *tables, backend=backend, out=bad)
    tables[0].requires_grad_(True)
    with pytest.raises(ValueError, match="out= is for inference"):
        fused_embeddings(ids, *tables, backend=backend, out=out)


ON_GPU = torch.cuda.is_available()
TRITON_ON_GPU = pytest.param("triton on cuda", marks=pytest.mark.skipif(not ON_GPU, reason="no GPU"))


def _backend(name: str, monkeypatch) -> tuple[str, str]:
    """(backend, device) for a test's name: "triton" (and "auto, interpreted") with CPU tensors in Triton's
    interpreter, as tests/test_kernels_triton.py runs them without a GPU; "triton on cuda" on the GPU."""
    if name.startswith("triton") or name.endswith("interpreted"):
        pytest.importorskip("triton", reason="triton (the gpu and dev extras) runs the 'triton' backend")
        if name != "triton on cuda":
            monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the backend selection accepts CPU tensors only with it)
    return name.split()[0].rstrip(","), "cuda" if name.endswith("cuda") else "cpu"


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("on_meta", ["input_ids", "token_type_ids", "position_ids", "layer and ids"])
@pytest.mark.parametrize("backend", ["cpu", "auto", "triton", "auto, interpreted"])
def test_ids_on_the_meta_device(backend, on_meta, grad, monkeypatch):
    """A layer run on the meta device for its output's shape (as transformers' runs there) has no values to check or
    read, nor have meta ids beside tables in memory: every backend gives what the reference gives (a meta output of
    the right shape; for meta ids beside CPU tables, torch's lookup gives an uninitialised CPU tensor). The cpu and
    auto backends raised numpy's TypeError for meta ids, and "auto" and "triton" in Triton's interpreter sent a meta
    layer to the Triton kernel ("Cannot copy out of meta tensor")."""
    ref, fused = twins(24, _backend(backend, monkeypatch)[0], vocab=500)
    meta = torch.ones(2, 7, dtype=torch.long, device="meta")
    given = {"input_ids": awkward_ids(2, 7, 500), "token_type_ids": None, "position_ids": None}
    given[on_meta if on_meta in given else "input_ids"] = meta
    if on_meta == "layer and ids":
        ref, fused = ref.to("meta"), fused.to("meta")
        given["token_type_ids"] = meta
    for mode in ("eval", "train"):  # (training: dropout 0.1 in the reference, and in the fused kernel)
        for layer in (ref, fused):
            layer.train(mode == "train")
        with torch.set_grad_enabled(grad):
            expected, out = ref(**given), fused(**given)
        assert (out.shape, out.dtype, out.device) == (expected.shape, expected.dtype, expected.device) \
            == ((2, 7, 24), torch.float32, expected.device)
        assert out.device.type == ("meta" if on_meta == "layer and ids" else "cpu")


def _ragged(ids: torch.Tensor, layout=torch.strided) -> torch.Tensor:
    """A nested batch of the rows of ids [2, L], the second cut to 4 ids."""
    return torch.nested.nested_tensor([ids[0], ids[1, :4]], layout=layout)


# name -> (the ids in that layout, the layout the error names, the fix it gives)
_LAYOUTS = {"sparse_coo": (lambda ids: ids.to_sparse(), "sparse_coo", "to_dense()"),
            "sparse_csr": (lambda ids: ids.to_sparse_csr(), "sparse_csr", "to_dense()"),
            "nested": (_ragged, "nested", "to_padded_tensor"),
            "nested jagged": (lambda ids: _ragged(ids, torch.jagged), "nested", "to_padded_tensor")}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage",
                            "ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("name", ["input_ids", "token_type_ids", "position_ids"])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("backend", ["reference", "cpu", "auto", "triton", TRITON_ON_GPU])
def test_sparse_and_nested_ids_are_refused_alike(backend, layout, name, grad, monkeypatch):
    """Sparse ids and nested (ragged) batches: the layer takes a dense [B, L] tensor of ids, and every backend, the
    reference included, says so in one ValueError naming the layout and the fix (`.to_dense()`, or padding the
    nested batch into [B, L]), instead of torch's raw errors ("Could not run 'aten::aminmax' with arguments from the
    'SparseCPU' backend", "NestedTensorImpl doesn't support sizes", an AttributeError on a jagged size)."""
    make, said, fix = _LAYOUTS[layout]
    backend, device = _backend(backend, monkeypatch)
    ids = awkward_ids(2, 7, 500).to(device)
    given = {"input_ids": ids, name: make(ids % 2 if name == "token_type_ids" else ids)}
    layer = twins(24, backend, vocab=500)[1].to(device)
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=f"{name} is a {said} tensor.*{fix}"):
        layer(**given)
    if name == "input_ids":  # the functional form, through the same check
        tables = [m.weight.detach() for m in (layer.word_embeddings, layer.token_type_embeddings,
                                              layer.position_embeddings, layer.LayerNorm)] + [layer.LayerNorm.bias]
        with pytest.raises(ValueError, match=f"input_ids is a {said} tensor.*{fix}"):
            fused_embeddings(given["input_ids"], *tables, backend=backend)
