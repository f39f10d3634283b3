"""The numba kernels (backend="cpu") against the reference layer: outputs, gradients of all five tensors, dropout,
bad input, out= buffers, empty batches (the kernels inside the rest of torch: test_kernels_cpu_integration.py)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")

from bertembed.fast import cpu, fused_embeddings  # noqa: E402
from kernel_helpers import (  # noqa: E402
    assert_grads_match,
    assert_output_close,
    awkward_ids,
    check_empty_batches,
    check_layer_norm_dtypes_as_torch,
    check_never_reads_outside_a_table,
    check_training_step_makes_no_statistics_gradient,
    run_both,
    twins,
)


@pytest.mark.parametrize(
    ("hidden", "batch", "length", "past"),
    [(384, 3, 1, 0), (768, 2, 512, 0), (1024, 4, 40, 0), (200, 3, 17, 7), (97, 2, 9, 0)],
)
def test_forward_and_gradients_match_reference(hidden, batch, length, past):
    ref, fused = twins(hidden, "cpu")
    ids = awkward_ids(batch, length, ref.config.vocab_size)
    segments = torch.randint(0, 2, (batch, length), generator=torch.Generator().manual_seed(3))
    out_ref, out = run_both(ref, fused, input_ids=ids, token_type_ids=segments, past_key_values_length=past)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)
    assert fused.word_embeddings.weight.grad[0].abs().max() == 0  # [PAD] row: no gradient, as nn.Embedding's


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


@pytest.mark.parametrize("position_ids", ["shared", "per-row"])
def test_explicit_position_ids(position_ids):
    ref, fused = twins(64, "cpu")
    ids = awkward_ids(3, 10, ref.config.vocab_size)
    pos = torch.tensor([[5, 1, 9, 9, 0, 3, 2, 8, 7, 4]])
    pos = pos if position_ids == "shared" else torch.stack([pos[0], pos[0].flip(0), pos[0] + 100])
    out_ref, out = run_both(ref, fused, input_ids=ids, position_ids=pos)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


@pytest.mark.parametrize("position_type", ["sinusoidal", "none"])
def test_other_position_types(position_type):
    ref, fused = twins(48, "cpu", position_embedding_type=position_type)
    ids = awkward_ids(2, 12, ref.config.vocab_size)
    out_ref, out = run_both(ref, fused, input_ids=ids)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


def test_backward_is_deterministic():
    _, fused = twins(96, "cpu")
    ids = awkward_ids(8, 33, 50)  # a small vocabulary: many repeats of every id
    grads = []
    for _ in range(3):
        fused.zero_grad(set_to_none=True)
        fused(ids).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in fused.parameters()])
    for again in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], again, strict=True))


@pytest.mark.parametrize(("hidden", "threads", "batch", "length"),
                         [(97, 2, 2, 9), (384, 1, 3, 1), (768, 2, 2, 512), (1024, 3, 4, 40), (200, 2, 16, 128)])
def test_outputs_match_reference_on_any_thread_count(hidden, threads, batch, length):
    """Training (the autograd Function) and inference (the forward kernel alone), serial and parallel, with hidden
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


def test_dropout_p0_is_exact_in_training():
    ref, fused = twins(64, "cpu", hidden_dropout_prob=0.0)
    ref.train(), fused.train()
    ids = awkward_ids(2, 16, ref.config.vocab_size)
    out_ref, out = run_both(ref, fused, input_ids=ids)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


def test_dropout_keeps_the_right_fraction_and_scales():
    p = 0.25
    ref, fused = twins(256, "cpu", hidden_dropout_prob=p)
    ids = awkward_ids(8, 64, ref.config.vocab_size)
    clean = ref(ids)  # eval: no dropout
    fused.train()
    torch.manual_seed(0)
    out = fused(ids)
    kept = out != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.01
    assert_output_close(out[kept], clean[kept] / (1 - p))
    torch.manual_seed(0)
    assert torch.equal(fused(ids), out)  # the mask follows torch's generator
    # Backward applies the same mask: compare with the reference layer times that mask.
    upstream = torch.randn(out.shape)
    (out * upstream).sum().backward()
    ref.train()
    ref.dropout.p = 0.0
    (ref(ids) * kept / (1 - p) * upstream).sum().backward()
    assert_grads_match(ref, fused)


BAD_IDS = [  # ids outside their tables: the kernel reads nothing for them and reports them; the layer names the first
    dict(input_ids=torch.tensor([[1, 2, 1000]])),  # id past the vocabulary
    dict(input_ids=torch.tensor([[1, -1, 3]])),
    dict(input_ids=torch.tensor([[1, 2]]), token_type_ids=torch.tensor([[0, 2]])),
    dict(input_ids=torch.tensor([[1, 2]]), position_ids=torch.tensor([[0, 512]])),
]
BAD_INPUTS = [  # shapes, dtypes, lengths: refused before any kernel runs
    dict(input_ids=torch.tensor([1, 2, 3])),  # no batch dimension
    dict(input_ids=torch.tensor([[1.0, 2.0]])),
    dict(input_ids=torch.tensor([[1, 2]], dtype=torch.uint8)),  # torch's lookup takes int64 and int32 only
    dict(input_ids=torch.tensor([[1, 2]]), token_type_ids=torch.tensor([[0, 1, 0]])),
    dict(input_ids=torch.ones(1, 513, dtype=torch.long)),
    dict(input_ids=torch.tensor([[1, 2]]), past_key_values_length=511),
    dict(input_ids=torch.tensor([[1, 2]]), past_key_values_length=-1),
    dict(),
]


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("inputs", BAD_IDS)
def test_bad_ids_raise_the_reference_error(inputs, grad):
    ref, fused = twins(32, "cpu")
    with pytest.raises(ValueError) as expected:
        ref(**inputs)
    with torch.set_grad_enabled(grad), pytest.raises(ValueError) as got:
        fused(**inputs)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("inputs", BAD_INPUTS)
def test_bad_input_raises_reference_error_before_any_kernel(inputs, monkeypatch):
    ref, fused = twins(32, "cpu")
    with pytest.raises(ValueError) as expected:
        ref(**inputs)

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran on bad input")

    monkeypatch.setattr(cpu, "forward", no_kernel)
    monkeypatch.setattr(cpu, "run_forward", no_kernel)
    with pytest.raises(ValueError) as got:
        fused(**inputs)
    assert str(got.value) == str(expected.value)


def test_kernel_itself_never_reads_outside_a_table():
    """Called directly (past validation), the kernels skip a bad id and report it instead of reading out of bounds."""
    check_never_reads_outside_a_table(cpu)


def test_functional_matches_module_and_fills_out_buffer():
    ref, fused = twins(40, "cpu")
    ids = awkward_ids(2, 7, ref.config.vocab_size)
    tables = (ref.word_embeddings.weight, ref.token_type_embeddings.weight, ref.position_embeddings.weight,
              ref.LayerNorm.weight, ref.LayerNorm.bias)
    out_ref = ref(ids)
    assert_output_close(fused_embeddings(ids, *tables, backend="cpu"), out_ref)
    buffer = torch.empty(2, 7, 40)
    with torch.no_grad():
        assert fused_embeddings(ids, *tables, backend="cpu", out=buffer) is buffer
    assert_output_close(buffer, out_ref)
    with pytest.raises(ValueError, match="out= is for inference"):
        fused_embeddings(ids, *tables, backend="cpu", out=buffer)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="not one of"):
        twins(8, "gpu")


def test_empty_batches():
    check_empty_batches("cpu")


def test_training_step_makes_no_statistics_gradient():
    check_training_step_makes_no_statistics_gradient("cpu")


def test_layer_norm_dtypes_fail_as_torchs_layer_norm_does():
    check_layer_norm_dtypes_as_torch("cpu")
    ref, _ = twins(24, "cpu")
    word, position, segment, weight, bias = (p.detach() for p in ref.parameters())  # in the order registered
    ids = awkward_ids(2, 5, 1000)
    errors = []
    for backend in ("reference", "cpu"):  # the functional form too
        with pytest.raises(ValueError, match="bfloat16 but the embeddings they normalise are torch.float32") as info:
            fused_embeddings(ids, word, segment, position, weight.bfloat16(), bias.bfloat16(), backend=backend)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


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
