"""The Triton kernels against the reference layer. Without a GPU they run on CPU tensors in Triton's interpreter
(TRITON_INTERPRET=1, set while the kernels are imported and during these tests only), on small shapes: the
interpreter runs each program in Python. With CUDA they run on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
SET_HERE = not ON_GPU and "TRITON_INTERPRET" not in os.environ
if SET_HERE:
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates, so before the kernels are imported
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bertembed.fast import fused_embeddings  # noqa: E402
from bertembed.fast import triton as triton_kernels  # noqa: E402
from kernel_helpers import (  # noqa: E402
    assert_grad_close,
    assert_grads_match,
    assert_output_close,
    awkward_ids,
    check_autograd_modes,
    check_custom_op_compiles,
    check_edited_default_id_buffers,
    check_empty_batches,
    check_gradient_penalties,
    check_layer_norm_dtypes_as_torch,
    check_low_precision,
    check_low_precision_grads_beat_torchs,
    check_never_reads_outside_a_table,
    check_traced_whole_layer,
    check_training_step_makes_no_statistics_gradient,
    run_both,
    twins,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if SET_HERE:
    del os.environ["TRITON_INTERPRET"]  # other test modules run without it; the fixture sets it for these tests
if not ON_GPU and not INTERPRET:
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the backend selection accepts CPU tensors only with it


def on_device(*layers):
    return [layer.to(DEVICE) for layer in layers]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(("hidden", "batch", "length", "past"), [(97, 2, 9, 3), (128, 3, 1, 0), (16, 1, 512, 0)])
def test_forward_and_gradients_match_reference(hidden, batch, length, past, deterministic):
    ref, fused = on_device(*twins(hidden, "triton"))
    fused.deterministic = deterministic
    ids = awkward_ids(batch, length, ref.config.vocab_size).to(DEVICE)
    segments = torch.randint(0, 2, (batch, length), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out_ref, out = run_both(ref, fused, input_ids=ids, token_type_ids=segments, past_key_values_length=past)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)
    assert fused.word_embeddings.weight.grad[0].abs().max() == 0


@pytest.mark.parametrize(("hidden", "batch", "length", "past"), [(97, 2, 9, 3), (48, 3, 1, 7), (16, 1, 512, 0)])
def test_inference_positions_come_from_the_row(hidden, batch, length, past):
    """Under no_grad with default positions the kernel computes `past + token index` itself; out= too."""
    ref, fused = on_device(*twins(hidden, "triton"))
    ids = awkward_ids(batch, length, ref.config.vocab_size).to(DEVICE)
    segments = torch.randint(0, 2, (batch, length), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        for types in (None, segments):
            got = fused(ids, token_type_ids=types, past_key_values_length=past)
            assert_output_close(got, ref(ids, token_type_ids=types, past_key_values_length=past))
        expected = ref(ids, past_key_values_length=past)
        out = torch.full_like(expected, float("nan"))
        tables = [t.weight for t in (fused.word_embeddings, fused.token_type_embeddings, fused.position_embeddings)]
        fused_embeddings(ids, *tables, fused.LayerNorm.weight, fused.LayerNorm.bias, past_key_values_length=past,
                         backend="triton", out=out)
    assert_output_close(out, expected)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_hooks_and_changed_submodules_run(grad):
    """As on the CPU (tests/test_kernels_submodules.py): a hook on a table, or a table whose max_norm is set after the
    first call, makes the layer run its submodules (`can_fuse` says no), in inference and in training."""
    ref, fused = on_device(*twins(32, "triton"))
    ids = awkward_ids(2, 7, ref.config.vocab_size).to(DEVICE)
    with torch.set_grad_enabled(grad):
        plain = fused(ids).detach()
        for layer in (ref, fused):
            layer.word_embeddings.register_forward_hook(lambda m, args, out: out * 2)
        out_ref, out = ref(ids), fused(ids)
        assert (out_ref - plain).abs().max() > 1e-2
        assert_output_close(out, out_ref)
        for layer in (ref, fused):
            layer.word_embeddings._forward_hooks.clear()
            layer.token_type_embeddings.max_norm = 0.01  # renormalises the rows it reads, in place
        out_ref, out = ref(ids), fused(ids)
        assert (out_ref - plain).abs().max() > 1e-2
        assert_output_close(out, out_ref)


def test_repeated_launches_follow_shape_and_alignment():
    """The same shape twice (Triton's cached kernel), then a misaligned view of the ids and an odd token count (other
    specialisations), each against the reference."""
    ref, fused = on_device(*twins(48, "triton"))
    ids = awkward_ids(2, 17, ref.config.vocab_size).to(DEVICE)
    tables = [t.weight for t in (fused.word_embeddings, fused.token_type_embeddings, fused.position_embeddings)]
    ln = fused.LayerNorm
    with torch.no_grad():
        for flat in (ids[:, :16].reshape(-1), ids[:, :16].reshape(-1), ids.reshape(-1)[1:], ids.reshape(-1)[1:]):
            n = flat.numel()
            positions = torch.arange(n, device=DEVICE)
            got, _, _ = triton_kernels.run_forward(flat, torch.zeros_like(flat), positions, *tables, ln.weight,
                                                   ln.bias, ln.eps, 0.0, 0, stats=False)
            assert_output_close(got.view(1, n, 48), ref(flat.view(1, n)))


@pytest.mark.parametrize(("rows", "evict_first"), [(2, True), (4, True), (1, False), (2, False)])
@pytest.mark.parametrize("stats", [True, False])
def test_tuning_options_match_the_default(rows, evict_first, stats):
    """The forward kernel with 2 or 4 token rows per program (9 tokens: the last program is part-empty), and without
    its cache hint, against the defaults (one row per program, hints on) and the reference; the statistics too."""
    ref, fused = on_device(*twins(97, "triton"))
    ids = awkward_ids(1, 9, ref.config.vocab_size).to(DEVICE)
    tables = [t.weight for t in (fused.word_embeddings, fused.token_type_embeddings, fused.position_embeddings)]
    flat, ln = ids.reshape(-1), fused.LayerNorm
    with torch.no_grad():
        results = [triton_kernels.run_forward(flat, torch.zeros_like(flat), torch.arange(9, device=DEVICE), *tables,
                                              ln.weight, ln.bias, ln.eps, 0.0, 0, stats=stats, rows=r, evict_first=e)
                   for r, e in ((1, True), (rows, evict_first))]
        assert_output_close(results[1][0].view(1, 9, 97), ref(ids))
    assert_output_close(results[1][0], results[0][0])
    for one, many in zip(results[0][1:], results[1][1:], strict=True):  # mean, rstd (None without stats)
        assert (one is None and many is None) or torch.allclose(one, many, rtol=1e-6, atol=0)


def test_a_bad_id_past_the_checks_gets_a_nan_row_and_reads_nothing():
    """The kernel itself, handed a word id past the table: that token's row is NaN, every other row is right (on
    CPU tensors the interpreter also counts it and raises; on a GPU there is no read-back)."""
    ref, fused = on_device(*twins(32, "triton", vocab=50))
    ids = torch.tensor([[3, 4, 5], [6, 50, 7]]).to(DEVICE)
    good = ids.clamp(max=49)
    tables = [t.weight for t in (fused.word_embeddings, fused.token_type_embeddings, fused.position_embeddings)]
    out = torch.zeros(2, 3, 32, device=DEVICE)
    flat = ids.reshape(-1)
    raised = False
    with torch.no_grad():
        try:
            triton_kernels.run_forward(flat, torch.zeros_like(flat), torch.arange(3, device=DEVICE).repeat(2),
                                       *tables, fused.LayerNorm.weight, fused.LayerNorm.bias, 1e-12, 0.0, 0, out=out)
        except RuntimeError as err:
            raised = "1 tokens had ids outside" in str(err)
        expected = ref(good)
    assert raised != ON_GPU
    assert out[1, 1].isnan().all()
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, 1] = False
    assert_output_close(out[keep], expected[keep])


@pytest.mark.skipif(not ON_GPU, reason="id_checks='device' applies to CUDA tensors; on CPU ids are always checked")
def test_device_id_checks_give_nan_rows_without_raising():
    ref, fused = on_device(*twins(32, "triton", vocab=50))
    tables = [t.weight for t in (fused.word_embeddings, fused.token_type_embeddings, fused.position_embeddings)]
    tables += [fused.LayerNorm.weight, fused.LayerNorm.bias]
    ids = torch.tensor([[3, 4, 5], [6, 50, 7]], device=DEVICE)
    with torch.no_grad():
        out = fused_embeddings(ids, *tables, backend="triton", id_checks="device")
        expected = ref(ids.clamp(max=49))
    assert out[1, 1].isnan().all() and not out[0].isnan().any()
    assert_output_close(out[0], expected[0])
    with pytest.raises(ValueError, match="outside the word table"):
        fused_embeddings(ids, *tables, backend="triton")
    fused.id_checks = "device"  # the layer's own switch
    with torch.no_grad():
        assert_output_close(fused(ids)[0], expected[0])
        assert fused(ids)[1, 1].isnan().all()
    fused.id_checks = "host"
    with pytest.raises(ValueError, match="outside the word table"):
        fused(ids)


@pytest.mark.skipif(not ON_GPU, reason="a whole transformers model on the GPU")
def test_patched_model_on_gpu_matches_and_compiles():
    import copy

    import bertembed
    from conftest import make_hf_model

    original = make_hf_model("bert-base").to(DEVICE)
    patched = bertembed.patch(copy.deepcopy(original), backend="triton")
    ids = awkward_ids(4, 64, 30522).to(DEVICE)
    with torch.no_grad():
        expected = original(ids).last_hidden_state
        torch.testing.assert_close(patched(ids).last_hidden_state, expected, rtol=0, atol=1e-5)
        compiled = torch.compile(patched)
        torch.testing.assert_close(compiled(ids).last_hidden_state, expected, rtol=0, atol=1e-5)


def test_edited_default_id_buffers_are_read():
    check_edited_default_id_buffers("triton", DEVICE)


def test_autograds_other_modes_match_the_reference():
    check_autograd_modes("triton", DEVICE)


def test_gradient_penalties_differentiate_through_the_fused_layer():
    check_gradient_penalties("triton", DEVICE)


@pytest.mark.parametrize("hidden", [384, 768, 1024])
def test_bert_sizes(hidden):
    batch, length = (8, 512) if ON_GPU else (2, 3)  # the interpreter runs every program in Python: few tokens
    ref, fused = on_device(*twins(hidden, "triton"))
    ids = awkward_ids(batch, length, ref.config.vocab_size).to(DEVICE)
    out_ref, out = run_both(ref, fused, input_ids=ids)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


def test_deterministic_backward_is_bitwise_repeatable():
    _, fused = on_device(*twins(32, "triton"))
    fused.deterministic = True
    ids = awkward_ids(4, 12, 20).to(DEVICE)  # many repeats of each id
    runs = []
    for _ in range(2):
        fused.zero_grad(set_to_none=True)
        fused(ids).pow(2).sum().backward()
        runs.append([p.grad.clone() for p in fused.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_torchs_deterministic_flag_asks_for_the_deterministic_backward(monkeypatch):
    """`torch.use_deterministic_algorithms(True)` gets the fixed-order backward without `layer.deterministic`, as it
    gets torch's own deterministic embedding backward."""
    _, fused = on_device(*twins(32, "triton"))
    ids = awkward_ids(2, 6, 20).to(DEVICE)
    asked, run_backward = [], triton_kernels.run_backward

    def spy(*args, **kwargs):
        asked.append(kwargs["deterministic"])
        return run_backward(*args, **kwargs)

    monkeypatch.setattr(triton_kernels, "run_backward", spy)
    fused(ids).sum().backward()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        fused(ids).sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert asked == [False, True]


def _round_kernel(x, y, n, BLOCK: tl.constexpr):
    """Decorated with triton.jit inside the test, where the fixture has set TRITON_INTERPRET as needed."""
    i = tl.arange(0, BLOCK)
    tl.store(y + i, triton_kernels._round_to(tl.load(x + i, mask=i < n), y.dtype.element_ty), mask=i < n)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 3e38 to float16 is inf, as intended
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_to_half_precision_is_torchs(dtype):
    """The kernels' rounding of float32 sums (integer ops in the interpreter, the GPU's conversion on a GPU) gives
    torch's bits: ties to even, NaN, infinities, values past the dtype's range, and on a GPU subnormals (the
    interpreter itself mangles a float32 subnormal's bits)."""
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 3
    x[:8] = torch.tensor([1.00390625, 1.01171875, -1.00390625, float("nan"), float("inf"), 3e38, -7e4,
                          1e-39 if ON_GPU else 1e-30])
    x = x.to(DEVICE)
    y = torch.empty(x.shape, dtype=dtype, device=DEVICE)
    triton.jit(_round_kernel)[(1,)](x, y, x.numel(), BLOCK=4096)
    expected = x.to(dtype)
    assert torch.equal(y.isnan(), expected.isnan())
    assert torch.equal(y[~y.isnan()], expected[~expected.isnan()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tables(dtype):
    ref, fused = on_device(*twins(64, "triton", dtype=dtype))
    check_low_precision(ref, fused, awkward_ids(2, 10, ref.config.vocab_size).to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_are_closer_to_float64_than_torchs(dtype):
    check_low_precision_grads_beat_torchs(*on_device(*twins(48, "triton", dtype=dtype)))


@pytest.mark.parametrize("switched", ["layer", "dropout alone"])
def test_dropout_keeps_the_right_fraction_and_scales(switched):
    """In training mode, and under Monte Carlo dropout (the layer in eval, its dropout module in train): the dropout
    module's own flag decides, as in the reference."""
    p = 0.25
    ref, fused = on_device(*twins(64, "triton", hidden_dropout_prob=p))
    ids = awkward_ids(8, 32, ref.config.vocab_size).to(DEVICE)
    clean = ref(ids)
    (fused if switched == "layer" else fused.dropout).train()
    torch.manual_seed(0)
    out = fused(ids)
    kept = out != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.02
    assert_output_close(out[kept], clean[kept] / (1 - p))
    torch.manual_seed(0)
    assert torch.equal(fused(ids), out)
    upstream = torch.randn(out.shape).to(DEVICE)
    (out * upstream).sum().backward()
    ref.dropout.p = 0.0
    ref.train()
    (ref(ids) * kept / (1 - p) * upstream).sum().backward()
    assert_grads_match(ref, fused)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_training_with_the_dropout_switched_off_drops_nothing(grad):
    ref, fused = on_device(*twins(64, "triton", hidden_dropout_prob=0.25))
    ids = awkward_ids(2, 7, ref.config.vocab_size).to(DEVICE)
    for layer in (ref, fused):
        layer.train()
        layer.dropout.eval()
    with torch.set_grad_enabled(grad):
        assert_output_close(fused(ids), ref(ids))


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_segment_and_position_ids_that_broadcast(grad):
    """Segment ids [1, L] and position ids [L], shared by the batch, as transformers takes them (on a GPU, the short
    path leaves a [1, L] segment id to the general path)."""
    ref, fused = on_device(*twins(32, "triton"))
    ids = awkward_ids(3, 7, ref.config.vocab_size).to(DEVICE)
    given = dict(token_type_ids=torch.tensor([[0, 0, 1, 1, 0, 1, 1]]).to(DEVICE),
                 position_ids=torch.tensor([6, 5, 4, 3, 2, 1, 0]).to(DEVICE))
    with torch.set_grad_enabled(grad):
        out_ref, out = ref(ids, **given), fused(ids, **given)
        assert_output_close(out, out_ref)
        assert_output_close(fused(ids, token_type_ids=given["token_type_ids"]),
                            ref(ids, token_type_ids=given["token_type_ids"]))
    if grad:
        upstream = torch.randn(out.shape).to(DEVICE)
        (out_ref * upstream).sum().backward()
        (out * upstream).sum().backward()
        assert_grads_match(ref, fused)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_a_table_of_another_hidden_size_is_refused(grad):
    """A position table cut to H - 1 columns through `.data`: the same ValueError as the reference's, before the
    kernel would read each row's last entry from outside the table."""
    ref, fused = on_device(*twins(32, "triton"))
    ids = awkward_ids(1, 5, ref.config.vocab_size).to(DEVICE)
    for layer in (ref, fused):
        layer.position_embeddings.weight.data = layer.position_embeddings.weight.data[:, :31].contiguous()
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="must share one hidden size"):
            layer(ids)


def test_bad_input_raises_reference_error_before_any_kernel(monkeypatch):
    ref, fused = on_device(*twins(16, "triton"))
    monkeypatch.setattr(triton_kernels, "run_forward", lambda *a, **k: pytest.fail("a kernel ran on bad input"))
    for inputs in (dict(input_ids=torch.tensor([[1, 1000]])), dict(input_ids=torch.tensor([[1, 2]]),
                                                                   token_type_ids=torch.tensor([[0, 5]]))):
        inputs = {k: v.to(DEVICE) for k, v in inputs.items()}
        with pytest.raises(ValueError) as expected:
            ref(**inputs)
        with pytest.raises(ValueError) as got:
            fused(**inputs)
        assert str(got.value) == str(expected.value)


@pytest.mark.skipif(ON_GPU, reason="the skipped-token count is read back only on CPU tensors")
def test_kernel_itself_never_reads_outside_a_table():
    check_never_reads_outside_a_table(triton_kernels)


def test_position_type_none():
    ref, fused = on_device(*twins(24, "triton", position_embedding_type="none"))
    ids = awkward_ids(2, 6, ref.config.vocab_size).to(DEVICE)
    out_ref, out = run_both(ref, fused, input_ids=ids)
    assert_output_close(out, out_ref)
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), fused.named_parameters(), strict=True):
        assert_grad_close(p.grad, p_ref.grad, name)


@pytest.mark.parametrize("deterministic", [False, True])
def test_frozen_tables_get_no_gradient(deterministic):
    ref, fused = on_device(*twins(24, "triton"))
    fused.deterministic = deterministic
    for layer in (ref, fused):
        layer.word_embeddings.weight.requires_grad_(False)
        layer.position_embeddings.weight.requires_grad_(False)
    out_ref, out = run_both(ref, fused, input_ids=awkward_ids(2, 7, ref.config.vocab_size).to(DEVICE))
    assert_output_close(out, out_ref)
    assert fused.word_embeddings.weight.grad is None and fused.position_embeddings.weight.grad is None
    assert_grad_close(fused.token_type_embeddings.weight.grad, ref.token_type_embeddings.weight.grad, "segment")
    assert_grad_close(fused.LayerNorm.weight.grad, ref.LayerNorm.weight.grad, "LayerNorm.weight")


def test_empty_batches():
    check_empty_batches("triton", DEVICE)


def test_custom_op_compiles_fullgraph():
    check_custom_op_compiles("triton", DEVICE)


def test_whole_layer_traces_without_a_graph_break():
    check_traced_whole_layer("triton", DEVICE)


def test_training_step_makes_no_statistics_gradient():
    check_training_step_makes_no_statistics_gradient("triton", DEVICE)


def test_layer_norm_dtypes_fail_as_torchs_layer_norm_does():
    check_layer_norm_dtypes_as_torch("triton", DEVICE)


@pytest.mark.parametrize("member", ["roberta", "distilbert", "modernbert", "deberta-v2"])
def test_the_kernel_serves_the_family_members_it_covers(member):
    """Explicit positions counted from the padding (RoBERTa: its padding row's gradient stays zero), no segment table
    (DistilBERT, ModernBERT, DeBERTa v3), no LayerNorm bias (ModernBERT), other eps; DeBERTa's mask after the norm."""
    from bertembed import BertEmbeddings, EmbeddingConfig

    extra = {"roberta": dict(max_position_embeddings=42, type_vocab_size=1, layer_norm_eps=1e-5),
             "deberta-v2": dict(position_biased_input=False)}.get(member, {})
    config = EmbeddingConfig.from_hf_config({"model_type": member, "vocab_size": 97, "hidden_size": 40, "dim": 40,
                                             "max_position_embeddings": 40, "pad_token_id": 1, **extra})
    torch.manual_seed(0)
    reference = BertEmbeddings(config).train()
    reference.dropout.p = 0.0
    fused = BertEmbeddings(config, backend="triton").train()
    fused.load_state_dict(reference.state_dict())
    fused.dropout.p = 0.0
    reference, fused = on_device(reference, fused)
    ids = torch.randint(2, 97, (3, 13), device=DEVICE)
    ids[0, -4:] = 1
    kwargs = {"attention_mask": (ids != 1).long()} if config.mask_output else {}
    outputs = [layer(ids, **kwargs) for layer in (reference, fused)]
    assert_output_close(outputs[1], outputs[0])
    grad = torch.randn_like(outputs[0])
    for out in outputs:
        out.backward(grad)
    for (name, expected), got in zip(reference.named_parameters(), fused.parameters(), strict=True):
        assert_grad_close(got.grad, expected.grad, name)
    if config.positions_from_padding:
        assert not fused.position_embeddings.weight.grad[1].any()


def test_gathered_word_rows_run_the_kernel(caplog, monkeypatch):
    """Word rows the kernel does not look up itself (`inputs_embeds`; a hooked word table's own forward; a sharded
    table's lookup, bertembed.parallel) are added and normalised by the kernel: outputs and gradients as the
    reference's, nothing falling back."""
    import logging

    import bertembed.fast as kernels

    monkeypatch.setattr(kernels, "_told", set())
    ref, fused = on_device(*twins(24, "triton"))
    given = [torch.randn(2, 3, 24, device=DEVICE).requires_grad_() for _ in range(2)]
    with torch.no_grad():
        given[1].copy_(given[0])
    upstream = torch.randn(2, 3, 24, device=DEVICE)
    with caplog.at_level(logging.INFO, logger="bertembed.fast"):
        out_ref, out = ref(inputs_embeds=given[0]), fused(inputs_embeds=given[1])
        ((out_ref * upstream).sum() + (out * upstream).sum()).backward()
        assert_output_close(out, out_ref)
        assert_grad_close(given[1].grad, given[0].grad, "inputs_embeds")
        for layer in (ref, fused):
            layer.zero_grad()
            layer.word_embeddings.register_forward_hook(lambda m, args, out: out * 2)
        ids = awkward_ids(2, 5, ref.config.vocab_size).to(DEVICE)
        out_ref, out = ref(ids), fused(ids)
        ((out_ref * upstream[:, :1]).sum() + (out * upstream[:, :1]).sum()).backward()
        assert_output_close(out, out_ref)
        assert_grads_match(ref, fused)
    assert "reference" not in caplog.text
