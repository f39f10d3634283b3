"""The numba kernels (backend="cpu") inside the rest of torch: where `auto` runs the reference instead, with the reason
logged (dtypes, nn.Embedding options, torch.func transforms, tracers and exporters, no numba), double backward, sparse
gradients, and the custom op under torch.compile. What every backend is tested for: test_kernels.py."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")

from kernel_helpers import (  # noqa: E402
    assert_grads_match,
    assert_output_close,
    awkward_ids,
    run_both,
    twins,
)


def test_auto_falls_back_with_a_logged_reason(caplog, monkeypatch):
    import bertembed.fast as kernels

    monkeypatch.setattr(kernels, "_told", set())  # each reason is logged once per process
    ref, fused = twins(24, "auto")
    ref64, fused64 = ref.double(), fused.double()
    ids = awkward_ids(2, 5, 1000)
    with caplog.at_level(logging.INFO, logger="bertembed.fast"):
        assert torch.equal(fused64(ids), ref64(ids))
    assert "torch.float64" in caplog.text


def test_mixed_table_dtypes_fall_back(caplog, monkeypatch):
    import bertembed.fast as kernels

    monkeypatch.setattr(kernels, "_told", set())
    ref, fused = twins(32, "cpu")
    for layer in (ref, fused):
        layer.token_type_embeddings.bfloat16()
    ids = awkward_ids(2, 5, ref.config.vocab_size)
    with caplog.at_level(logging.INFO, logger="bertembed.fast"):
        assert torch.equal(fused(ids), ref(ids))
    assert "different dtypes" in caplog.text


def test_torch_func_transforms_run_the_reference(caplog, monkeypatch):
    """Per-sample gradients the torch.func way (`grad` of `functional_call`), and `vmap`: the kernels cannot read
    functorch's wrapped tensors, so the layer runs the reference, with the reason logged, and gives its numbers."""
    from torch.func import functional_call, grad

    import bertembed.fast as kernels

    monkeypatch.setattr(kernels, "_told", set())
    ref, fused = twins(24, "cpu")
    ids = awkward_ids(2, 5, ref.config.vocab_size)
    params = {name: p.detach() for name, p in ref.named_parameters()}
    upstream = torch.randn(2, 5, 24)

    def loss(tables, layer):
        return (functional_call(layer, tables, (ids,)) * upstream).sum()

    with caplog.at_level(logging.INFO, logger="bertembed.fast"):
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


def test_a_double_backward_runs_the_reference_and_says_so(caplog):
    """The kernels have no double backward of their own: it runs through the reference `embed()`, with one log line."""
    from bertembed.fast import function

    function._told.discard("twice")
    _, fused = twins(16, "cpu", hidden_dropout_prob=0.0)
    ids = awkward_ids(2, 5, fused.config.vocab_size)
    with caplog.at_level(logging.INFO, logger="bertembed"):
        for _ in range(2):
            grad, = torch.autograd.grad(fused(ids).pow(3).sum(), fused.LayerNorm.weight, create_graph=True)
            grad.sum().backward()
    assert [r.getMessage() for r in caplog.records].count(
        "bertembed: a double or batched backward runs through the reference layer, not the fused kernel") == 1


@pytest.mark.parametrize("eps", [0.0, -1e-12, float("nan"), float("inf"), True, "1e-12"])
def test_fused_embeddings_refuses_an_eps_that_is_not_positive_and_finite(eps):
    from bertembed.fast import fused_embeddings

    ref, _ = twins(16, "cpu")
    tables = [t.detach() for t in ref.tables()]
    for backend in ("reference", "cpu"):
        with pytest.raises(ValueError, match="eps must be a positive finite number"):
            fused_embeddings(awkward_ids(1, 4, ref.config.vocab_size), *tables, eps=eps, backend=backend)


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
    """`nn.Embedding(..., sparse=True)` (for `torch.optim.SparseAdam`): the kernels write dense gradients, so the word
    module looks its rows up itself (its own backward gives the sparse gradient) and the kernel does the rest."""
    ref, fused = twins(24, "cpu")
    for layer in (ref, fused):
        layer.word_embeddings.sparse = True
    ids = awkward_ids(2, 5, 1000)
    with caplog.at_level(logging.INFO, logger="bertembed.fast"):
        run_both(ref, fused, input_ids=ids)
    assert fused.word_embeddings.weight.grad.is_sparse
    torch.testing.assert_close(fused.word_embeddings.weight.grad.to_dense(), ref.word_embeddings.weight.grad.to_dense())
    assert "reference" not in caplog.text
    with torch.no_grad():
        assert_output_close(fused(ids), ref(ids))


@pytest.mark.parametrize("option", [dict(max_norm=0.05), dict(scale_grad_by_freq=True)])
def test_embedding_options_the_kernels_do_not_have_run_the_reference(option):
    """`max_norm` renormalises rows as F.embedding reads them (in place), `scale_grad_by_freq` scales the word
    gradient: a layer whose tables ask for either gives the reference's outputs and gradients (set after the first
    call: tests/test_kernels_submodules.py)."""
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


def test_opcheck():
    """torch.library's own consistency checks of the op: schema, fake tensor, autograd registration."""
    word, seg, pos = torch.randn(20, 16, requires_grad=True), torch.randn(2, 16), torch.randn(8, 16)
    ids = torch.tensor([[1, 2, 3, 0]])
    tail = (word, seg, pos, torch.ones(16), torch.zeros(16), 1e-12, 0.0, 0, 0, -1, "cpu", False)  # ids [B, L], [1, L]
    for ids_args in ((ids, torch.zeros_like(ids), torch.arange(4)[None]), (ids, torch.zeros(1, 4, dtype=torch.long),
                                                                           torch.arange(3, 7)[None])):
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


def test_missing_numba_auto_falls_back_and_explicit_backend_refuses(monkeypatch, caplog):
    import bertembed.fast as kernels

    monkeypatch.setitem(kernels._found, "cpu", False)  # as if numba were not installed
    monkeypatch.setattr(kernels, "_told", set())
    with pytest.raises(ImportError, match="numba is not installed"):
        twins(16, "cpu")
    ref, fused = twins(16, "auto")
    ids = awkward_ids(1, 4, ref.config.vocab_size)
    with caplog.at_level(logging.INFO, logger="bertembed.fast"):
        assert torch.equal(fused(ids), ref(ids))
    assert "numba is not installed" in caplog.text


def test_a_used_layer_converts_and_loads_in_torchs_swap_mode():
    """torch's swap mode (`.to()`, `load_state_dict` by `torch.utils.swap_tensors`, to be torch's default) refuses a
    parameter with a weak reference: the kernel's cached views held one on every table after the first call."""
    from bertembed import BertEmbeddings, EmbeddingConfig

    torch.manual_seed(0)
    config = EmbeddingConfig(vocab_size=50, hidden_size=24, max_position_embeddings=16, hidden_dropout_prob=0.0)
    fused, ref = BertEmbeddings(config, backend="cpu").eval(), BertEmbeddings(config).eval()
    ids = torch.randint(0, 50, (2, 7))
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with torch.no_grad():
            fused(ids)
            fused.to(torch.float64).float()
            fused.load_state_dict({k: v + 0.5 for k, v in ref.state_dict().items()})
            ref.load_state_dict(fused.state_dict())
            torch.testing.assert_close(fused(ids), ref(ids), rtol=1e-5, atol=1e-5)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
