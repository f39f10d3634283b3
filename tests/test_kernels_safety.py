"""Values checked alike on every backend, and when they are set: dropout probabilities that torch refuses or treats
specially (p outside [0, 1], set on the layer's dropout module after construction or given to `fused_embeddings`,
raises one ValueError naming it, in training and in eval mode alike; p == 1 gives torch's zeros and zero gradients),
a backend set on a layer, `fused_embeddings`' padding_idx. The Triton kernels run in Triton's interpreter without a
GPU (TRITON_INTERPRET=1, set while they are imported and during these tests only, as in
tests/test_kernels_triton.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")

from bertembed.fast import fused_embeddings  # noqa: E402
from kernel_helpers import (  # noqa: E402
    TRITON,
    assert_grads_match,
    assert_output_close,
    awkward_ids,
    device_of,
    run_both,
    triton_interpreter,  # noqa: F401 (a fixture)
    twins,
)

BAD = [1.5, -0.1, float("nan")]
MESSAGE = "dropout probability has to be between 0 and 1"  # torch's words
pytestmark = pytest.mark.usefixtures("triton_interpreter")  # (the fixture, imported from kernel_helpers)


def _tables(device: str, grad: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tables = [torch.randn(rows, 24, generator=gen) for rows in (100, 2, 64)]
    tables += [torch.rand(24, generator=gen) + 0.5, torch.rand(24, generator=gen) - 0.5]
    return [t.to(device).requires_grad_(grad) for t in tables]


def test_torch_refuses_these_probabilities():
    """What the fused layer must match: F.dropout refuses them in eval mode too (NaN with a RuntimeError, from its
    C++ check; the others with a ValueError), and nn.Dropout as it runs."""
    for p in BAD:
        for training in (True, False):
            with pytest.raises((ValueError, RuntimeError), match=MESSAGE):
                F.dropout(torch.ones(3), p, training=training)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("p", BAD, ids=str)
@pytest.mark.parametrize("backend", ["reference", "cpu", TRITON])
def test_a_dropout_probability_set_outside_0_1_is_refused(backend, p, mode, grad):
    """`layer.dropout.p = p` after construction (nn.Dropout checks p only when built) raises the same ValueError on
    every backend, naming the value. The reference layer left it to nn.Dropout as it ran: torch's RuntimeError for
    NaN, a ValueError without the name for the others."""
    _, layer = twins(24, backend, vocab=100)
    device = device_of(backend)
    ids = awkward_ids(2, 5, 100).to(device)
    layer.to(device).train(mode == "train")
    layer.dropout.p = p
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=f"{MESSAGE}, but got layer.dropout.p={p};"):
        layer(ids)


@pytest.mark.parametrize("bad", [20, -21, 2**63, 1.5, True], ids=str)
@pytest.mark.parametrize("backend", ["reference", "cpu", TRITON])
def test_a_padding_idx_set_outside_the_table_is_refused_alike(backend, bad):
    """`layer.word_embeddings.padding_idx = bad` after construction (nn.Embedding checks it only when built) raises
    the same ValueError on every backend, naming the value: the reference gave torch's AssertionError or TypeError."""
    _, layer = twins(24, backend, vocab=20)
    layer.to(device_of(backend)).word_embeddings.padding_idx = bad
    with pytest.raises(ValueError, match=rf"padding_idx={bad!r} is outside the table's rows \[-20, 20\)"):
        layer(awkward_ids(2, 5, 20).to(device_of(backend)))


@pytest.mark.parametrize("backend", ["reference", "cpu", TRITON])
def test_a_bad_backend_is_refused_when_it_is_set(backend):
    """`layer.backend = "bogus"` raises the ValueError of the constructor there, naming the value, and the layer keeps
    its backend; it raised a KeyError only at the next call."""
    _, layer = twins(24, backend, vocab=100)
    for bad in ("bogus", None):
        with pytest.raises(ValueError, match=rf"backend={bad!r} is not one of \('auto', 'reference', 'cpu', "):
            layer.backend = bad
    assert layer.backend == backend
    layer(awkward_ids(2, 5, 100).to(device_of(backend)))
    layer.backend = "reference"
    assert layer.backend == "reference"


def test_id_checks_and_deterministic_are_declared_options_checked_when_set():
    """`id_checks` and `deterministic` are constructor options, checked there and when assigned (a typo was read as
    the default); `fused_embeddings` checks its own alike."""
    from bertembed import BertEmbeddings, EmbeddingConfig

    config = EmbeddingConfig(vocab_size=100, hidden_size=24)
    layer = BertEmbeddings(config, backend="cpu", id_checks="device", deterministic=True)
    assert (layer.id_checks, layer.deterministic) == ("device", True)
    assert (BertEmbeddings(config).id_checks, BertEmbeddings(config).deterministic) == ("host", False)
    for name, bad in (("id_checks", "devise"), ("id_checks", None), ("deterministic", "yes"), ("deterministic", 1)):
        with pytest.raises(ValueError, match=rf"{name}={bad!r} is not one of"):
            BertEmbeddings(config, **{name: bad})
        with pytest.raises(ValueError, match=rf"{name}={bad!r} is not one of"):
            setattr(layer, name, bad)
        with pytest.raises(ValueError, match=rf"{name}={bad!r} is not one of"):
            fused_embeddings(awkward_ids(1, 3, 100), *_tables("cpu"), backend="cpu", **{name: bad})
    assert (layer.id_checks, layer.deterministic) == ("device", True)
    layer.id_checks, layer.deterministic = "host", False
    assert (layer.id_checks, layer.deterministic) == ("host", False)


@pytest.mark.parametrize("backend", ["reference", "cpu", TRITON])
def test_the_functional_form_checks_padding_idx_alike(backend):
    """`fused_embeddings(padding_idx=...)` outside the word table's rows raises one ValueError on every backend,
    naming the value (the reference raised torch's bare AssertionError, the CPU kernel accepted it); -1 is the last
    row there, as in F.embedding (the CPU kernel took it as no padding row, and gave that row a gradient)."""
    device = device_of(backend)
    ids = awkward_ids(2, 5, 100, pad=99).to(device)
    for bad in (100, -101, 2**40, 1.0, True):
        with pytest.raises(ValueError, match=rf"padding_idx={bad!r} is outside the table's rows \[-100, 100\)"):
            fused_embeddings(ids, *_tables(device), padding_idx=bad, backend=backend)
    tables = _tables(device, grad=True)
    upstream = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(2)).to(device)
    (fused_embeddings(ids, *tables, padding_idx=-1, backend=backend) * upstream).sum().backward()
    expected = [t.detach().cpu().requires_grad_() for t in _tables(device)]
    (fused_embeddings(ids.cpu(), *expected, padding_idx=99, backend="reference") * upstream.cpu()).sum().backward()
    assert tables[0].grad[99].count_nonzero() == 0
    for got, want in zip(tables, expected, strict=True):
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("p", BAD, ids=str)
@pytest.mark.parametrize("backend", ["reference", "cpu", TRITON])
def test_the_functional_form_refuses_a_dropout_probability_outside_0_1(backend, p, training):
    """`fused_embeddings(..., dropout_p=p)` refuses it as F.dropout does, whether training or not, on every backend."""
    device = device_of(backend)
    ids = awkward_ids(2, 5, 100).to(device)
    for grad in (False, True):
        with pytest.raises(ValueError, match=f"{MESSAGE}, but got dropout_p="):
            fused_embeddings(ids, *_tables(device, grad), dropout_p=p, training=training, backend=backend)


# The Triton kernels divide by 1 - p before dropping the element (`tl.where`): at p == 1 numpy, running them in the
# interpreter, warns of the inf and NaN that are then dropped.
IGNORE_DIVISION = pytest.mark.filterwarnings("ignore:(divide by zero|invalid value) encountered:RuntimeWarning")


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("backend", ["cpu", TRITON])
@IGNORE_DIVISION
def test_dropout_p_one_gives_torchs_zeros(backend, grad):
    """p == 1 is valid in torch: every element dropped, the output all zeros, every gradient zero. The cpu backend
    raised ZeroDivisionError (its scale 1 / (1 - p))."""
    ref, fused = twins(24, backend, vocab=100)
    device = device_of(backend)
    ids = awkward_ids(2, 5, 100).to(device)
    for layer in (ref.to(device), fused.to(device)):
        layer.train()
        layer.dropout.p = 1.0
    if grad:
        out_ref, out = run_both(ref, fused, input_ids=ids)
        assert_grads_match(ref, fused)
        assert all(p.grad.count_nonzero() == 0 for p in fused.parameters())
    else:
        with torch.no_grad():
            out_ref, out = ref(ids), fused(ids)
    assert_output_close(out, out_ref)
    assert out.shape == (2, 5, 24) and out.count_nonzero() == 0


@pytest.mark.parametrize("backend", ["reference", "cpu", TRITON])
@IGNORE_DIVISION
def test_the_functional_form_at_dropout_p_one(backend):
    device = device_of(backend)
    ids = awkward_ids(2, 5, 100).to(device)
    expected_tables, tables = _tables(device, True), _tables(device, True)
    expected = fused_embeddings(ids, *expected_tables, dropout_p=1.0, training=True, backend="reference")
    out = fused_embeddings(ids, *tables, dropout_p=1.0, training=True, backend=backend)
    assert_output_close(out, expected)
    assert out.count_nonzero() == 0
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(device)
    (expected * upstream).sum().backward()
    (out * upstream).sum().backward()
    for got, want in zip(tables, expected_tables, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)
    with torch.no_grad():
        assert fused_embeddings(ids, *tables, dropout_p=1.0, training=True, backend=backend).count_nonzero() == 0
