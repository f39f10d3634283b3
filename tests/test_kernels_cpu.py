"""The numba kernels (backend="cpu") against the reference layer: outputs, gradients of all five tensors, dropout,
bad input, the custom op under torch.compile."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("numba")

from bertembed.kernels import cpu, cpu_elements, cpu_run, fused_embeddings, pages  # noqa: E402
from kernel_helpers import (  # noqa: E402
    assert_grad_close,
    assert_grads_match,
    assert_output_close,
    awkward_ids,
    check_custom_op_compiles,
    check_empty_batches,
    check_layer_norm_dtypes_as_torch,
    check_never_reads_outside_a_table,
    check_traced_whole_layer,
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


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize(("hidden", "threads", "batch", "length"),
                         [(97, 2, 16, 128), (768, 3, 16, 128), (200, 2, 16, 128), (97, 2, 1, 11), (768, 3, 1, 11)])
def test_large_word_gradient_zeros(hidden, threads, batch, length, fresh, monkeypatch):
    """Large word gradients get their zeros by non-temporal stores, the unaligned ends of each run of rows by ordinary
    ones (hidden 97 and 200: rows that do not start on a cache line); or, in memory fresh from the kernel, 2 MB pages
    and ordinary stores. Forced here for a small table. (16, 128): the parallel backward, each thread zeroing the rows
    it owns; (1, 11): zeros on all threads, then one adds."""
    monkeypatch.setattr(cpu_run, "_STREAM_FROM", 0)
    monkeypatch.setattr(pages, "is_fresh", lambda table: fresh)  # advise_if_fresh asks it
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
def test_streamed_outputs_match_reference(hidden, threads, batch, length, monkeypatch):
    """Large outputs are written by non-temporal stores, whole cache lines of each row, the unaligned head and tail
    by ordinary ones (hidden 97 and 200: rows that do not start on a line). Forced here for small outputs, in
    training (the op's path) and in inference (the short path, serial and parallel); the word table is moved onto
    2 MB pages at its first batch (`pages.collapse_table`), forced here too."""
    monkeypatch.setattr(cpu_run, "_STREAM_OUT_FROM", 0)
    monkeypatch.setattr(pages, "_COLLAPSE_FROM", 0)
    monkeypatch.setattr(pages, "_collapsed", set())
    ref, fused = twins(hidden, "cpu")
    ids = awkward_ids(batch, length, ref.config.vocab_size)
    _check_on_threads(ref, fused, ids, threads)
    with torch.no_grad():
        assert_output_close(fused(ids), ref(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_dropout_and_out_buffers(dtype, monkeypatch):
    """Streaming with dropout (the same mask as without), into an `out=` buffer whose rows start off a cache line; a
    bfloat16 output is streamed where the CPU converts rows (`cpu_rows.streams`), else stored as it otherwise is."""
    ref, fused = twins(97, "cpu", hidden_dropout_prob=0.25, dtype=dtype)
    fused.train()
    ids = awkward_ids(4, 33, ref.config.vocab_size)
    outputs = []
    for stream in (False, True):
        monkeypatch.setattr(cpu_run, "stream_output", lambda out, fresh=None, on=stream: on)
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


BAD_INPUTS = [
    dict(input_ids=torch.tensor([[1, 2, 1000]])),  # id past the vocabulary
    dict(input_ids=torch.tensor([[1, -1, 3]])),
    dict(input_ids=torch.tensor([1, 2, 3])),  # no batch dimension
    dict(input_ids=torch.tensor([[1.0, 2.0]])),
    dict(input_ids=torch.tensor([[1, 2]], dtype=torch.uint8)),  # torch's lookup takes int64 and int32 only
    dict(input_ids=torch.tensor([[1, 2]]), token_type_ids=torch.tensor([[0, 2]])),
    dict(input_ids=torch.tensor([[1, 2]]), token_type_ids=torch.tensor([[0, 1, 0]])),
    dict(input_ids=torch.tensor([[1, 2]]), position_ids=torch.tensor([[0, 512]])),
    dict(input_ids=torch.ones(1, 513, dtype=torch.long)),
    dict(input_ids=torch.tensor([[1, 2]]), past_key_values_length=511),
    dict(input_ids=torch.tensor([[1, 2]]), past_key_values_length=-1),
    dict(),
]


@pytest.mark.parametrize("inputs", BAD_INPUTS)
def test_bad_input_raises_reference_error_before_any_kernel(inputs, monkeypatch):
    ref, fused = twins(32, "cpu")
    with pytest.raises(ValueError) as expected:
        ref(**inputs)

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran on bad input")

    monkeypatch.setattr(cpu, "forward", no_kernel)
    monkeypatch.setattr(cpu_run, "run_forward", no_kernel)
    with pytest.raises(ValueError) as got:
        fused(**inputs)
    assert str(got.value) == str(expected.value)


def test_kernel_itself_never_reads_outside_a_table():
    """Called directly (past validation), the kernels skip a bad id and report it instead of reading out of bounds."""
    check_never_reads_outside_a_table(cpu_run)


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


def test_auto_falls_back_with_a_logged_reason(caplog, monkeypatch):
    import bertembed.kernels as kernels

    monkeypatch.setattr(kernels, "_told", set())  # each reason is logged once per process
    ref, fused = twins(24, "auto")
    embeds = torch.randn(2, 3, 24)
    with caplog.at_level(logging.INFO, logger="bertembed.kernels"):
        out = fused(inputs_embeds=embeds)
    assert torch.equal(out, ref(inputs_embeds=embeds))
    assert "inputs_embeds" in caplog.text
    ref64, fused64 = ref.double(), fused.double()
    ids = awkward_ids(2, 5, 1000)
    with caplog.at_level(logging.INFO, logger="bertembed.kernels"):
        assert torch.equal(fused64(ids), ref64(ids))
    assert "torch.float64" in caplog.text


def test_mixed_table_dtypes_fall_back(caplog, monkeypatch):
    import bertembed.kernels as kernels

    monkeypatch.setattr(kernels, "_told", set())
    ref, fused = twins(32, "cpu")
    for layer in (ref, fused):
        layer.token_type_embeddings.bfloat16()
    ids = awkward_ids(2, 5, ref.config.vocab_size)
    with caplog.at_level(logging.INFO, logger="bertembed.kernels"):
        assert torch.equal(fused(ids), ref(ids))
    assert "different dtypes" in caplog.text


def test_torch_func_transforms_run_the_reference(caplog, monkeypatch):
    """Per-sample gradients the torch.func way (`grad` of `functional_call`), and `vmap`: the kernels cannot read
    functorch's wrapped tensors, so the layer runs the reference, with the reason logged, and gives its numbers."""
    from torch.func import functional_call, grad

    import bertembed.kernels as kernels

    monkeypatch.setattr(kernels, "_told", set())
    ref, fused = twins(24, "cpu")
    ids = awkward_ids(2, 5, ref.config.vocab_size)
    params = {name: p.detach() for name, p in ref.named_parameters()}
    upstream = torch.randn(2, 5, 24)

    def loss(tables, layer):
        return (functional_call(layer, tables, (ids,)) * upstream).sum()

    with caplog.at_level(logging.INFO, logger="bertembed.kernels"):
        got = grad(loss)(params, fused)
    assert "torch.func" in caplog.text
    expected = grad(loss)(params, ref)
    for name in params:
        assert torch.equal(got[name], expected[name]), name
    assert got["word_embeddings.weight"].abs().sum() > 0
    for grad_mode in (False, True):  # vmap over sentences: the short path (no autograd) and the general one
        with torch.set_grad_enabled(grad_mode):
            out = torch.vmap(lambda sentence: fused(sentence[None])[0])(ids)
            assert torch.equal(out, ref(ids))


def test_differentiating_the_gradients_again_raises():
    """The kernels' gradients are not differentiable. A gradient penalty built on them (`create_graph=True`) must fail
    when it is differentiated, not lose the fused layer's part and train on (which it did before). The first-order
    gradient it is built from still equals the reference's."""
    ref, fused = twins(24, "cpu", hidden_dropout_prob=0.0)
    ids = awkward_ids(2, 5, ref.config.vocab_size)
    penalties = []
    for layer in (ref, fused):
        out = layer(ids)
        (first,) = torch.autograd.grad((out ** 3).sum(), layer.LayerNorm.weight, create_graph=True)
        penalties.append((out.sum() + first.square().sum(), first))
    assert_grad_close(penalties[1][1], penalties[0][1], "LayerNorm.weight")
    penalties[0][0].backward()  # torch's layer is twice differentiable
    with pytest.raises(RuntimeError, match="differentiate twice"):
        penalties[1][0].backward()


@pytest.mark.parametrize("dynamo", [False, True])
def test_jit_trace_and_onnx_export_record_the_reference(tmp_path, dynamo):
    """`torch.jit.trace` (and `torch.onnx.export`'s TorchScript tracer, which hands `past_key_values_length` over as a
    tensor) record torch operations, not compiled kernels, and ONNX has no operator for them (the default, dynamo
    exporter): a fused layer traces its reference, which then computes other ids right, there and in ONNX Runtime.
    All three failed before (numba's TypingError; the offset's type; no ONNX function for the custom op)."""
    import warnings

    import numpy as np

    ref, fused = twins(24, "cpu")
    ids, other = awkward_ids(2, 7, 1000), awkward_ids(2, 7, 1000, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracers' own warnings
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                traced = torch.jit.trace(fused, (ids,), check_trace=False)
                assert_output_close(traced(other).detach(), ref(other).detach())
        needed = "onnxscript" if dynamo else "onnx"  # the exporter's own dependency; both are in the dev extra
        pytest.importorskip(needed, reason=f"torch.onnx.export(dynamo={dynamo}) needs {needed} (the dev extra)")
        onnxruntime = pytest.importorskip("onnxruntime", reason="the exported graph runs in ONNX Runtime (dev extra)")
        path = tmp_path / "fused.onnx"
        with torch.no_grad():
            torch.onnx.export(fused, (ids,), str(path), dynamo=dynamo)
            expected = ref(other)
    session = onnxruntime.InferenceSession(str(path))
    feed = {i.name: other.numpy() if i.name == "input_ids" else np.array(0, np.int64) for i in session.get_inputs()}
    assert_output_close(torch.from_numpy(session.run(None, feed)[0]), expected)


def test_a_sparse_word_table_gets_sparse_gradients(caplog):
    """`nn.Embedding(..., sparse=True)` (for `torch.optim.SparseAdam`): the kernels write dense gradients, so a layer
    whose word table asks for sparse ones trains on the reference, as asked; inference still takes the kernels."""
    ref, fused = twins(24, "cpu")
    for layer in (ref, fused):
        layer.word_embeddings.sparse = True
    ids = awkward_ids(2, 5, 1000)
    with caplog.at_level(logging.INFO, logger="bertembed.kernels"):
        run_both(ref, fused, input_ids=ids)
    assert fused.word_embeddings.weight.grad.is_sparse
    torch.testing.assert_close(fused.word_embeddings.weight.grad.to_dense(), ref.word_embeddings.weight.grad.to_dense())
    assert "sparse" in caplog.text
    with torch.no_grad():
        assert_output_close(fused(ids), ref(ids))


@pytest.mark.parametrize("option", [dict(max_norm=0.05), dict(scale_grad_by_freq=True)])
def test_embedding_options_the_kernels_do_not_have_run_the_reference(option):
    """`max_norm` renormalises rows as F.embedding reads them (in place), `scale_grad_by_freq` scales the word
    gradient: a layer whose tables ask for either gives the reference's outputs and gradients (set before the first
    call: the short path asks when it builds its cache)."""
    ref, fused = twins(24, "cpu")
    for layer in (ref, fused):
        for key, value in option.items():
            setattr(layer.word_embeddings, key, value)
    ids = awkward_ids(2, 5, 1000)
    with torch.no_grad():
        assert_output_close(fused(ids), ref(ids))
    out_ref, out = run_both(ref, fused, input_ids=ids)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="not one of"):
        twins(8, "gpu")


def test_custom_op_compiles_fullgraph():
    check_custom_op_compiles("cpu")


def test_opcheck():
    """torch.library's own consistency checks of the op: schema, fake tensor, autograd registration."""
    word, seg, pos = torch.randn(20, 16, requires_grad=True), torch.randn(2, 16), torch.randn(8, 16)
    ids = torch.tensor([[1, 2, 3, 0]])
    tail = (word, seg, pos, torch.ones(16), torch.zeros(16), 1e-12, 0.0, 0, 0, "cpu", False)
    for ids_args in ((ids, torch.zeros_like(ids), torch.arange(4)[None], 0), (ids, None, None, 3)):  # None: defaults
        torch.library.opcheck(torch.ops.bertembed.embeddings.default, ids_args + tail,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_compiled_module_forward_and_backward():
    """torch.compile of the whole fused layer (graph breaks allowed), with an offset: the custom op stays one node."""
    ref, fused = twins(64, "cpu")
    ids = awkward_ids(2, 9, ref.config.vocab_size)
    torch._dynamo.reset()
    compiled = torch.compile(fused)
    out_ref, out = run_both(ref, compiled, input_ids=ids, past_key_values_length=2)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_whole_layer_traces_without_a_graph_break(backend):
    check_traced_whole_layer(backend)


def test_eager_training_skips_the_op_and_compile_keeps_it(monkeypatch):
    """Eager autograd runs `EagerEmbeddings` (the custom op's dispatch costs ~70 us a call); torch.compile traces the
    op. Each is replaced by something that fails, in turn, and the other mode must still train correctly."""
    from bertembed.kernels import function

    def refuse(*args, **kwargs):
        raise AssertionError("this mode must not run this path")

    ref, fused = twins(64, "cpu")
    ids = awkward_ids(2, 9, ref.config.vocab_size)
    with monkeypatch.context() as patch:
        patch.setattr(function, "embeddings_op", refuse)
        out_ref, out = run_both(ref, fused, input_ids=ids)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)
    ref, fused = twins(64, "cpu")
    torch._dynamo.reset()
    monkeypatch.setattr(function.EagerEmbeddings, "apply", refuse)
    out_ref, out = run_both(ref, torch.compile(fused), input_ids=ids)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


def test_frozen_tables_get_no_gradient():
    """Fine-tuning with frozen word and position tables: no dense gradient is built for them, the rest still match."""
    ref, fused = twins(48, "cpu")
    for layer in (ref, fused):
        layer.word_embeddings.weight.requires_grad_(False)
        layer.position_embeddings.weight.requires_grad_(False)
    out_ref, out = run_both(ref, fused, input_ids=awkward_ids(2, 11, ref.config.vocab_size))
    assert_output_close(out, out_ref)
    assert fused.word_embeddings.weight.grad is None and fused.position_embeddings.weight.grad is None
    for name in ("token_type_embeddings.weight", "LayerNorm.weight", "LayerNorm.bias"):
        assert_grad_close(fused.get_parameter(name).grad, ref.get_parameter(name).grad, name)


def test_missing_numba_auto_falls_back_and_explicit_backend_refuses(monkeypatch, caplog):
    import bertembed.kernels as kernels

    monkeypatch.setitem(kernels._found, "cpu", False)  # as if numba were not installed
    monkeypatch.setattr(kernels, "_short_paths", {})
    monkeypatch.setattr(kernels, "_told", set())
    with pytest.raises(ImportError, match="numba is not installed"):
        twins(16, "cpu")
    ref, fused = twins(16, "auto")
    ids = awkward_ids(1, 4, ref.config.vocab_size)
    with caplog.at_level(logging.INFO, logger="bertembed.kernels"):
        assert torch.equal(fused(ids), ref(ids))
    assert "numba is not installed" in caplog.text


def test_caches_older_than_an_inlined_file_are_dropped(tmp_path):
    """numba would load a kernel cached before an edit to a file it inlines; such cache indexes are deleted."""
    import os

    files = {name: tmp_path / name for name in ("cpu.f-1.py311.nbi", "lean.g-2.py311.nbi", "other.h-3.py311.nbi",
                                                 "cpu.k-4.py311.nbi")}
    for path in files.values():
        path.write_bytes(b"")
        os.utime(path, (0, 0))  # 1970: older than any source file
    os.utime(files["cpu.k-4.py311.nbi"], (4e9, 4e9))  # 2096: newer than any source file
    cpu_elements._drop_stale_caches(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.k-4.py311.nbi", "other.h-3.py311.nbi"]


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
