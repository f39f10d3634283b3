"""What only the numba kernels (backend="cpu") have, against the reference layer: numba's threads and the parallel
kernels, float32 moments of badly conditioned rows, out= buffers off a cache line. What every backend is tested for:
test_kernels.py; the kernels inside the rest of torch: test_kernels_cpu_integration.py."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")

from bertembed.fast import fused_embeddings  # noqa: E402
from kernel_helpers import (  # noqa: E402
    assert_grads_match,
    assert_output_close,
    awkward_ids,
    run_both,
    twins,
)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_mostly_padding_and_thread_counts(threads):
    """[PAD] tokens span the backward's chunks (its only id allowed to); every word-gradient row is written once."""
    ref, fused = twins(256, "cpu")
    ids = awkward_ids(8, 128, ref.config.vocab_size)  # big enough for the parallel kernels
    ids[:, 32:] = 0
    _check_on_threads(ref, fused, ids, threads)


def _check_on_threads(ref, fused, ids, threads: int) -> None:
    """Both layers forward and backward on `threads` torch (and so numba) threads; outputs and gradients compared."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out_ref, out = run_both(ref, fused, input_ids=ids)
    finally:
        torch.set_num_threads(before)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


@pytest.mark.parametrize(("hidden", "threads", "batch", "length"),
                         [(97, 2, 16, 128), (768, 3, 16, 128), (200, 2, 16, 128), (97, 2, 1, 11), (768, 3, 1, 11)])
def test_word_gradient_zeros(hidden, threads, batch, length):
    """Rows of the word gradient that no token (or only [PAD]) reached are zero. (16, 128): the parallel backward,
    each thread writing the rows it owns, zeros included; (1, 11): zeros first, then one thread adds."""
    ref, fused = twins(hidden, "cpu")
    ids = awkward_ids(batch, length, ref.config.vocab_size)  # [PAD] and repeated ids
    ids[9:, 40:] = 0  # [PAD] runs across the backward's chunks
    _check_on_threads(ref, fused, ids, threads)
    grad = fused.word_embeddings.weight.grad
    unused = torch.ones(ref.config.vocab_size, dtype=torch.bool)
    unused[ids.unique()] = False
    assert grad[0].abs().max() == 0 and grad[unused].abs().max() == 0


def test_tiny_hidden_is_at_least_as_close_to_float64_as_torch():
    """H=2 makes LayerNorm a cancellation (x - mean is tiny when the two entries are close): torch's float32 mean is
    then off by more than 5e-7, so the check here is against the float64 result, where the kernel must do no worse."""
    ref, fused = twins(2, "cpu")
    ids = awkward_ids(2, 5, ref.config.vocab_size)
    exact = ref.double()(ids)
    ref.float()
    err_kernel = (fused(ids).double() - exact).abs().max().item()
    err_torch = (ref(ids).double() - exact).abs().max().item()
    assert err_kernel <= max(err_torch, 5e-7)


def test_large_mean_keeps_the_variance():
    """The kernel takes float32 moments: the mean from a sum around the row's first entry, the variance from a second
    pass around the mean. Rows whose mean (300) is ~10^4 times their spread: float32 rounding of the sum itself
    dominates the error then, for torch too, and the kernel must be no further from the float64 result than about
    torch is."""
    ref, fused = twins(768, "cpu")
    with torch.no_grad():
        for layer in (ref, fused):
            layer.word_embeddings.weight.add_(300.0)
    ids = awkward_ids(2, 16, ref.config.vocab_size)
    exact = ref.double()(ids)
    ref.float()
    err_kernel = (fused(ids).double() - exact).abs().max().item()
    err_torch = (ref(ids).double() - exact).abs().max().item()
    assert err_kernel <= max(2 * err_torch, 5e-6)


@pytest.mark.parametrize("hidden", [97, 768, 4096])
def test_large_mean_gradients_are_as_close_to_float64_as_torch(hidden):
    """The backward's row sums are float32 (many short partial sums). For rows whose mean (300) is ~10^4 times their
    spread, the word gradient must be no further from the float64 result than torch's float32 backward is."""
    ref, fused = twins(hidden, "cpu", vocab=200)
    with torch.no_grad():
        for layer in (ref, fused):
            layer.word_embeddings.weight.add_(300.0)
    ids = torch.randperm(200, generator=torch.Generator().manual_seed(3))[:64].view(2, 32)  # one token a row
    upstream = torch.randn(2, 32, hidden, generator=torch.Generator().manual_seed(4))

    def word_grad(layer, dtype):
        layer.to(dtype).zero_grad()
        (layer(ids) * upstream.to(dtype)).sum().backward()
        return layer.word_embeddings.weight.grad[ids].double()

    exact = word_grad(ref, torch.float64)
    scale = exact.abs().max().item()
    err_kernel = (word_grad(fused, torch.float32) - exact).abs().max().item() / scale
    err_torch = (word_grad(ref, torch.float32) - exact).abs().max().item() / scale
    assert err_kernel <= max(err_torch, 1e-6)


@pytest.mark.parametrize("offset", [0.0, 0.05, 1.0])
def test_outlying_first_entries_cost_no_digits(offset):
    """The variance is summed in one pass around the mean of the row's first 64 entries, or in a second pass around
    the mean where that shift lies far from it. Shifting the first 16 entries moves the shift away from the mean: by
    nothing (one pass everywhere), by about half the spread (one pass in some rows, two in the others) and by 20
    spreads (two passes). Each must stay as close to the float64 result as torch is; a one-pass float32 variance
    around the first entry missed the reference tolerance by 8 ulps at H 768, with offset 1."""
    ref, fused = twins(768, "cpu")
    with torch.no_grad():
        for layer in (ref, fused):
            layer.word_embeddings.weight[:, :16] += offset
    ids = awkward_ids(4, 64, ref.config.vocab_size)
    out_ref, out = run_both(ref, fused, input_ids=ids)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)
    with torch.no_grad():
        exact = ref.double()(ids)
        err_kernel = (fused(ids).double() - exact).abs().max().item()
    err_torch = (out_ref.double() - exact).abs().max().item()
    assert err_kernel <= max(1.25 * err_torch, 5e-7)


def test_parallel_backward_is_bitwise_repeatable():
    """Past `cpu._PARALLEL_FROM` elements the backward runs in chunks (one writer per word row, partial sums per
    chunk): the same bits on every run, and the reference's gradients."""
    ref, fused = twins(64, "cpu", vocab=20)  # a small vocabulary: every id in many tokens, across chunk boundaries
    ids = awkward_ids(8, 300, 20)  # 2,400 tokens x 64 = 153,600 elements
    runs, before = [], torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(2):
            ref.zero_grad(set_to_none=True)
            fused.zero_grad(set_to_none=True)
            run_both(ref, fused, input_ids=ids)
            runs.append([p.grad.clone() for p in fused.parameters()])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert_grads_match(ref, fused)


@pytest.mark.parametrize(("hidden", "threads", "batch", "length"),
                         [(97, 2, 2, 9), (384, 1, 3, 1), (768, 2, 2, 512), (1024, 3, 4, 40), (200, 2, 16, 128)])
def test_outputs_match_reference_on_any_thread_count(hidden, threads, batch, length):
    """Training (the custom op) and inference (the forward kernel alone), serial and parallel, with hidden
    sizes whose rows do not start on a cache line (97, 200)."""
    ref, fused = twins(hidden, "cpu")
    ids = awkward_ids(batch, length, ref.config.vocab_size)
    _check_on_threads(ref, fused, ids, threads)
    with torch.no_grad():
        assert_output_close(fused(ids), ref(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_repeats_with_the_seed_and_out_buffers_off_a_line(dtype):
    """Dropout's mask follows torch.manual_seed; an `out=` buffer whose rows start off a cache line is filled."""
    ref, fused = twins(97, "cpu", hidden_dropout_prob=0.25, dtype=dtype)
    fused.train()
    ids = awkward_ids(4, 33, ref.config.vocab_size)
    outputs = []
    for _ in range(2):
        torch.manual_seed(0)
        outputs.append(fused(ids))
    assert torch.equal(outputs[0], outputs[1])
    tables = [t.detach() for t in (ref.word_embeddings.weight, ref.token_type_embeddings.weight,
                                   ref.position_embeddings.weight, ref.LayerNorm.weight, ref.LayerNorm.bias)]
    buffer = torch.zeros(4 * 33 * 97 + 1, dtype=dtype)[1:].view(4, 33, 97)  # 4 bytes or 2 past a line
    with torch.no_grad():
        fused_embeddings(ids, *tables, backend="cpu", out=buffer)
    assert_output_close(buffer, ref(ids))


@pytest.mark.parametrize("case", ["hidden 2", "offset 10"])
def test_badly_conditioned_rows_are_about_as_close_to_float64_as_torchs(case):
    """Where the 5e-7 bound does not hold (rows whose spread is small beside their mean: two nearly equal entries, a
    large offset shared by a row), the fused result's error against float64 is of the size of torch's own."""
    ref, fused = twins(2 if case == "hidden 2" else 64, "cpu", vocab=100)
    if case == "offset 10":
        with torch.no_grad():
            for layer in (ref, fused):
                layer.word_embeddings.weight.add_(10.0)
    ids = torch.randint(0, 100, (64, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out_ref, out = ref(ids).double(), fused(ids).double()
        exact = copy.deepcopy(ref).double()(ids)
    torch_error, fused_error = (out_ref - exact).abs().max().item(), (out - exact).abs().max().item()
    assert torch_error > 5e-6  # badly conditioned indeed: torch itself is far from float64
    assert fused_error <= 1.5 * torch_error, (fused_error, torch_error)


def test_a_table_replaced_by_a_transposed_view_of_itself_is_read_as_it_now_is():
    """The kernel keeps a numpy view of each table while its memory stays put: a `.data` swapped for a transposed view
    of the same memory (same address, shape and dtype, other strides) must not be read through the old view."""
    from bertembed import BertEmbeddings, EmbeddingConfig

    layer = BertEmbeddings(EmbeddingConfig(vocab_size=24, hidden_size=24, max_position_embeddings=40), backend="cpu")
    ids = torch.randint(1, 24, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        layer.eval()(input_ids=ids)  # (the word table's view kept)
        layer.word_embeddings.weight.data = layer.word_embeddings.weight.data.t()
        fused = layer(input_ids=ids)
        reference = torch.nn.functional.layer_norm(
            layer.word_embeddings.weight[ids] + layer.position_embeddings.weight[:6]
            + layer.token_type_embeddings.weight[0], (24,), layer.LayerNorm.weight, layer.LayerNorm.bias, 1e-12)
    torch.testing.assert_close(fused, reference)
