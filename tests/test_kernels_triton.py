"""What only the Triton kernels have, against the reference layer: positions computed in the kernel, launch
specialisations and tuning options, NaN rows for bad ids on a GPU, hidden sizes of BERT's models, the rounding to half
precision, the family members it serves. Without a GPU they run on CPU tensors in Triton's interpreter
(TRITON_INTERPRET=1, during these tests only), on small shapes: the interpreter runs each program in Python. What every
backend is tested for: test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import (
    ON_GPU,
    TRITON_MISSING,
    assert_grad_close,
    assert_grads_match,
    assert_output_close,
    awkward_ids,
    device_of,
    run_both,
    triton_interpreter,  # noqa: F401 (a fixture)
    twins,
)

if TRITON_MISSING:
    pytest.skip(TRITON_MISSING, allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bertembed.fast import fused_embeddings  # noqa: E402
from bertembed.fast import triton as triton_kernels  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")
DEVICE = device_of("triton")


def on_device(*layers):
    return [layer.to(DEVICE) for layer in layers]


@pytest.mark.parametrize(("hidden", "batch", "length", "past"), [(97, 2, 9, 3), (48, 3, 1, 7), (16, 1, 64, 448)])
def test_inference_positions_come_from_the_row(hidden, batch, length, past):
    """Under no_grad with default positions the kernel computes `past + token index` itself, up to the table's last
    row (511); out= too."""
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


@pytest.mark.parametrize("hidden", [384, 768, 1024])
def test_bert_sizes(hidden):
    batch, length = (8, 512) if ON_GPU else (2, 3)  # the interpreter runs every program in Python: few tokens
    ref, fused = on_device(*twins(hidden, "triton"))
    ids = awkward_ids(batch, length, ref.config.vocab_size).to(DEVICE)
    out_ref, out = run_both(ref, fused, input_ids=ids)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


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


