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

from bertembed.kernels import triton as triton_kernels  # noqa: E402
from kernel_helpers import (  # noqa: E402
    assert_grad_close,
    assert_grads_match,
    assert_output_close,
    awkward_ids,
    check_empty_batches,
    check_low_precision,
    check_never_reads_outside_a_table,
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tables(dtype):
    ref, fused = on_device(*twins(64, "triton", dtype=dtype))
    check_low_precision(ref, fused, awkward_ids(2, 10, ref.config.vocab_size).to(DEVICE))


def test_dropout_keeps_the_right_fraction_and_scales():
    p = 0.25
    ref, fused = on_device(*twins(64, "triton", hidden_dropout_prob=p))
    ids = awkward_ids(8, 32, ref.config.vocab_size).to(DEVICE)
    clean = ref(ids)
    fused.train()
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
