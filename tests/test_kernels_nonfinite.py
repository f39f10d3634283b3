"""Non-finite and huge values in the tables, on every backend as on the reference, torch.nn.functional's embedding +
layer_norm: an inf, -inf or NaN, or a finite value whose square overflows float32 (3e38), in one entry of a word,
segment or position row, in a whole word row, or in LayerNorm's weight or bias. The forward must give the reference's
values, its infs and NaNs in the same places; the gradients must give the reference's numbers wherever the
reference's gradient is a number (where it is inf or NaN, an overflow inside torch's formula decides which, and a
finite value can be as right). Written against the public layer only, so that it holds for any kernel. The Triton
kernels run in Triton's interpreter without a GPU, as in tests/test_kernels_triton.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")

from bertembed import BertEmbeddings, EmbeddingConfig  # noqa: E402
from bertembed.fast import fused_embeddings  # noqa: E402
from kernel_helpers import TRITON, device_of, triton_interpreter  # noqa: E402, F401

BACKENDS = ["reference", "cpu", TRITON]
HIDDEN = 768  # BERT-base; a multiple of 8, where torch's float32 LayerNorm on the CPU gives a NaN row or the bias
VALUES = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan"), "3e38": 3e38, "-3e38": -3e38}
PLACES = ["word", "segment", "position", "LayerNorm.weight", "LayerNorm.bias"]
# a huge entry in column 0 (or 8, 16, ...) gives a NaN row in torch's CPU LayerNorm (its vectorised Welford), in
# column 5 or 700 (past the CPU kernel's first 64 columns) the bias. The kernels sum a token's three rows before they
# normalise, so the column of a segment or position entry acts as a word entry's would: one column each, one of
# either outcome, is enough for their own gradients.
COLUMNS = {"word": [0, 5, 700], "segment": [0], "position": [700], "LayerNorm": [0, 700]}
IDS = torch.tensor([[1, 3, 4, 3], [5, 6, 0, 7]])  # token 3 twice; [PAD] (0) once
SEGMENTS = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])


pytestmark = pytest.mark.usefixtures("triton_interpreter")  # (the fixture, imported from kernel_helpers)


def _layer(backend: str, place: str, value: float, column: int | None) -> BertEmbeddings:
    """A layer with random tables and LayerNorm, and `value` at [row used by the batch, column] of table `place`
    (every column of word row 3 where `column` is None: the row is value x (1 - 1e-3 x noise))."""
    torch.manual_seed(0)
    config = EmbeddingConfig(vocab_size=10, hidden_size=HIDDEN, max_position_embeddings=8, hidden_dropout_prob=0.0)
    layer = BertEmbeddings(config, backend=backend).eval()
    with torch.no_grad():
        for table in (layer.word_embeddings, layer.token_type_embeddings, layer.position_embeddings):
            table.weight.normal_(0, 0.5)
        layer.LayerNorm.weight.uniform_(0.5, 1.5)
        layer.LayerNorm.bias.uniform_(-0.5, 0.5)
        if column is None:
            layer.word_embeddings.weight[3] = value * (1 - 1e-3 * torch.rand(HIDDEN))
        elif place.startswith("LayerNorm"):
            layer.get_parameter(place)[column] = value
        else:
            module, row = {"word": ("word", 3), "segment": ("token_type", 1), "position": ("position", 2)}[place]
            layer.get_submodule(f"{module}_embeddings").weight[row, column] = value
    return layer.to(device_of(backend))


def _reference(layer: BertEmbeddings) -> torch.Tensor:
    """torch.nn.functional's embedding + layer_norm of the layer's own tables, on the CPU."""
    word, segment, position, weight, bias = (t.cpu() for t in layer.tables())
    x = F.embedding(IDS, word, padding_idx=0) + F.embedding(SEGMENTS, segment)
    x = x + F.embedding(torch.arange(IDS.shape[1])[None], position)
    return F.layer_norm(x, (HIDDEN,), weight, bias, layer.config.layer_norm_eps)


def _assert_values(got: torch.Tensor, want: torch.Tensor, name: str = "output") -> None:
    """The same infs (with their signs) and NaNs in the same places, the finite values to float32 rounding."""
    finite = want[want.isfinite()]
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6 * scale, equal_nan=True,
                               msg=lambda m: f"{name}: {m}")


def _cases():
    for place in PLACES:
        for name, value in VALUES.items():
            for column in COLUMNS[place.split(".")[0]]:
                yield pytest.param(place, value, column, id=f"{place}-{name}-col{column}")
    for name in ("3e38", "-3e38"):
        yield pytest.param("word", VALUES[name], None, id=f"word-row-{name}")  # the sum of the row overflows


@pytest.mark.parametrize(("place", "value", "column"), list(_cases()))
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_and_huge_values_give_the_references_output_and_gradients(backend, place, value, column):
    """Forward, for inference (no autograd) and for training. The CPU kernel gave the bias where torch gave a NaN row
    (3e38 in column 0) and a NaN row where torch gave the bias (3e38 in column 5 or 700, and a whole row of
    3e38, whose sum torch's running mean never overflows). Then every table's and LayerNorm's gradient equals the
    reference's wherever the reference's is a number. The CPU and Triton kernels gave gradients of 0 (and finite ones)
    where the reference's were NaN for a 3e38 entry."""
    layer = _layer(backend, place, value, column)
    twin = _layer("reference", place, value, column).cpu()  # the same tables, differentiated by torch
    want = _reference(twin)
    device = layer.position_ids.device
    ids, segments = IDS.to(device), SEGMENTS.to(device)
    with torch.no_grad():
        _assert_values(layer(ids, segments), want)
    out = layer(ids, segments)
    _assert_values(out, want)
    upstream = torch.randn(2, 4, HIDDEN, generator=torch.Generator().manual_seed(1))
    (out * upstream.to(device)).sum().backward()
    (want * upstream).sum().backward()
    for (name, got), (_, expected) in zip(layer.named_parameters(), twin.named_parameters(), strict=True):
        number = expected.grad.isfinite()
        _assert_values(got.grad.cpu()[number], expected.grad[number], name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_functional_form_gives_the_references_output(backend):
    """`fused_embeddings` takes the same path: 3e38 where torch gives a NaN row (column 0) and the bias (column 5)."""
    device = device_of(backend)
    for column in (0, 5):
        layer = _layer("reference", "word", 3e38, column)
        tables = [t.detach().to(device) for t in layer.tables()]
        got = fused_embeddings(IDS.to(device), *tables, token_type_ids=SEGMENTS.to(device), backend=backend)
        _assert_values(got, _reference(layer))


@pytest.mark.parametrize("hidden", [97, 768])
@pytest.mark.parametrize("value", [0.3, 123.456, 1e19, 1e20, -3e38], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_constant_row_gives_the_references_output(backend, value, hidden):
    """A row whose entries are all equal: LayerNorm's bias where its mean comes out exact, as torch's running mean
    does (a Triton mean off by one rounding, times 1 / sqrt(eps) = 1e6, gave up to 1.5 off), and torch's NaN row
    (hidden 768) or bias (97) where the square of the mean overflows (1e20: the CPU kernel gave the bias at 768)."""
    device = device_of(backend)
    gen = torch.Generator().manual_seed(0)
    tables = [torch.full((4, hidden), value), torch.zeros(2, hidden), torch.zeros(8, hidden),
              torch.rand(hidden, generator=gen) + 0.5, torch.rand(hidden, generator=gen) - 0.5]
    ids = torch.tensor([[1, 2, 3]])
    want = fused_embeddings(ids, *tables, padding_idx=None, backend="reference")
    got = fused_embeddings(ids.to(device), *(t.to(device) for t in tables), padding_idx=None, backend=backend)
    _assert_values(got, want)
