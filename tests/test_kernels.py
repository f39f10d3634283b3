"""Every kernel backend against the reference layer, one test body each (as Liger-Kernel's), `backend` over "cpu"
(numba) and "triton" (without a GPU on CPU tensors, in Triton's interpreter: small shapes, since it runs each program
in Python), each skipped with the reason where its package is missing. What only one backend has:
test_kernels_cpu*.py and test_kernels_triton.py."""

from __future__ import annotations

import logging

import pytest
import torch

from bertembed.fast import fused_embeddings
from bertembed.fast.function import backend_module
from kernel_helpers import (
    BACKENDS,
    CPU,
    TRITON,
    assert_grad_close,
    assert_grads_match,
    assert_output_close,
    awkward_ids,
    cases,
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
    device_of,
    run_both,
    triton_interpreter,  # noqa: F401 (a fixture)
    twins,
)

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def pair(backend: str, hidden: int, **kwargs):
    """`twins` on the backend's device."""
    return [layer.to(device_of(backend)) for layer in twins(hidden, backend, **kwargs)]


# hidden, B, L, past: one token; hidden sizes that are not powers of two; positions up to the table's last (511),
# reached through the offset (the interpreter runs each token's program in Python; length 512: test_kernels_cpu.py)
SHAPES = [(97, 2, 9, 3), (128, 3, 1, 0), (200, 3, 17, 7), (384, 3, 1, 0), (16, 2, 24, 488)]


@pytest.mark.parametrize(("backend", "deterministic"), [*cases(CPU, False), *cases(TRITON, False, True)])
@pytest.mark.parametrize(("hidden", "batch", "length", "past"), SHAPES)
def test_forward_and_gradients_match_reference(backend, deterministic, hidden, batch, length, past):
    """With segments and an offset; Triton's deterministic backward too (the CPU backward always is). Large batches:
    test_kernels_cpu.py (numba's threads); BERT's hidden sizes: test_kernels_triton.py."""
    ref, fused = pair(backend, hidden)
    fused.deterministic = deterministic
    device = device_of(backend)
    ids = awkward_ids(batch, length, ref.config.vocab_size).to(device)
    segments = torch.randint(0, 2, (batch, length), generator=torch.Generator().manual_seed(3)).to(device)
    out_ref, out = run_both(ref, fused, input_ids=ids, token_type_ids=segments, past_key_values_length=past)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)
    assert fused.word_embeddings.weight.grad[0].abs().max() == 0  # [PAD] row: no gradient, as nn.Embedding's


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["columns", "expanded"])
def test_a_layer_norm_weight_and_bias_that_are_views(backend, layout):
    """LayerNorm's weight and bias as columns of one matrix (stride 2), or expanded from one value (stride 0): the
    Triton kernels read them at a stride of 1 (and past the one element), off by ~1.5."""
    ref, fused = pair(backend, 33)
    device = device_of(backend)
    values = torch.randn(33, 2, generator=torch.Generator().manual_seed(4)).to(device)
    weight, bias = (values[:, 0], values[:, 1]) if layout == "columns" else \
        (values[:1, 0].expand(33), values[:1, 1].expand(33))
    assert weight.stride() != (1,)
    for layer in (ref, fused):
        layer.LayerNorm.weight.data, layer.LayerNorm.bias.data = weight, bias
    out_ref, out = run_both(ref, fused, input_ids=awkward_ids(2, 9, ref.config.vocab_size).to(device))
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position_ids", ["shared", "per-row"])
def test_explicit_position_ids(backend, position_ids):
    ref, fused = pair(backend, 64)
    device = device_of(backend)
    ids = awkward_ids(3, 10, ref.config.vocab_size).to(device)
    pos = torch.tensor([[5, 1, 9, 9, 0, 3, 2, 8, 7, 4]])
    pos = pos if position_ids == "shared" else torch.stack([pos[0], pos[0].flip(0), pos[0] + 100])
    out_ref, out = run_both(ref, fused, input_ids=ids, position_ids=pos.to(device))
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_segment_and_position_ids_that_broadcast(backend, grad):
    """Segment ids [1, L] and position ids [L], shared by the batch, as transformers takes them (on a GPU, Triton's
    short path leaves a [1, L] segment id to the general path)."""
    ref, fused = pair(backend, 32)
    device = device_of(backend)
    ids = awkward_ids(3, 7, ref.config.vocab_size).to(device)
    given = dict(token_type_ids=torch.tensor([[0, 0, 1, 1, 0, 1, 1]]).to(device),
                 position_ids=torch.tensor([6, 5, 4, 3, 2, 1, 0]).to(device))
    with torch.set_grad_enabled(grad):
        out_ref, out = ref(ids, **given), fused(ids, **given)
        assert_output_close(out, out_ref)
        assert_output_close(fused(ids, token_type_ids=given["token_type_ids"]),
                            ref(ids, token_type_ids=given["token_type_ids"]))
    if grad:
        upstream = torch.randn(out.shape).to(device)
        (out_ref * upstream).sum().backward()
        (out * upstream).sum().backward()
        assert_grads_match(ref, fused)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position_type", ["sinusoidal", "none"])
def test_other_position_types(backend, position_type):
    ref, fused = pair(backend, 48, position_embedding_type=position_type)
    ids = awkward_ids(2, 12, ref.config.vocab_size).to(device_of(backend))
    out_ref, out = run_both(ref, fused, input_ids=ids)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_is_bitwise_repeatable(backend):
    """The CPU backward always; Triton's with `deterministic` (its default sums by atomics)."""
    _, fused = pair(backend, 32)
    fused.deterministic = backend == "triton"
    ids = awkward_ids(4, 12, 20).to(device_of(backend))  # a small vocabulary: many repeats of every id
    runs = []
    for _ in range(2):
        fused.zero_grad(set_to_none=True)
        fused(ids).pow(2).sum().backward()
        runs.append([p.grad.clone() for p in fused.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize(("backend", "deterministic"), [*cases(CPU, False), *cases(TRITON, False, True)])
def test_frozen_tables_get_no_gradient(backend, deterministic):
    """Fine-tuning with frozen word and position tables: no dense gradient is built for them, the rest still match."""
    ref, fused = pair(backend, 24)
    fused.deterministic = deterministic
    for layer in (ref, fused):
        layer.word_embeddings.weight.requires_grad_(False)
        layer.position_embeddings.weight.requires_grad_(False)
    out_ref, out = run_both(ref, fused, input_ids=awkward_ids(2, 11, ref.config.vocab_size).to(device_of(backend)))
    assert_output_close(out, out_ref)
    assert fused.word_embeddings.weight.grad is None and fused.position_embeddings.weight.grad is None
    for name in ("token_type_embeddings.weight", "LayerNorm.weight", "LayerNorm.bias"):
        assert_grad_close(fused.get_parameter(name).grad, ref.get_parameter(name).grad, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("switched", ["layer", "dropout alone"])
def test_dropout_keeps_the_right_fraction_and_scales(backend, switched):
    """In training mode, and under Monte Carlo dropout (the layer in eval, its dropout module in train): the dropout
    module's own flag decides, as in the reference. The mask follows torch's generator, and backward applies it."""
    p = 0.25
    ref, fused = pair(backend, 128, hidden_dropout_prob=p)
    device = device_of(backend)
    ids = awkward_ids(4, 16, ref.config.vocab_size).to(device)  # 8192 entries (the interpreter's cost is per token)
    clean = ref(ids)  # eval: no dropout
    (fused if switched == "layer" else fused.dropout).train()
    torch.manual_seed(0)
    out = fused(ids)
    kept = out != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.02
    assert_output_close(out[kept], clean[kept] / (1 - p))
    torch.manual_seed(0)
    assert torch.equal(fused(ids), out)
    upstream = torch.randn(out.shape).to(device)
    (out * upstream).sum().backward()
    ref.dropout.p = 0.0
    ref.train()
    (ref(ids) * kept / (1 - p) * upstream).sum().backward()
    assert_grads_match(ref, fused)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_p0_is_exact_in_training(backend):
    ref, fused = pair(backend, 64, hidden_dropout_prob=0.0)
    ref.train(), fused.train()
    out_ref, out = run_both(ref, fused, input_ids=awkward_ids(2, 16, ref.config.vocab_size).to(device_of(backend)))
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_training_with_the_dropout_switched_off_drops_nothing(backend, grad):
    ref, fused = pair(backend, 64, hidden_dropout_prob=0.25)
    ids = awkward_ids(2, 7, ref.config.vocab_size).to(device_of(backend))
    for layer in (ref, fused):
        layer.train()
        layer.dropout.eval()
    with torch.set_grad_enabled(grad):
        assert_output_close(fused(ids), ref(ids))


@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_matches_module_and_fills_out_buffer(backend):
    ref, fused = pair(backend, 40)
    device = device_of(backend)
    ids = awkward_ids(2, 7, ref.config.vocab_size).to(device)
    tables = (ref.word_embeddings.weight, ref.token_type_embeddings.weight, ref.position_embeddings.weight,
              ref.LayerNorm.weight, ref.LayerNorm.bias)
    out_ref = ref(ids)
    assert_output_close(fused_embeddings(ids, *tables, backend=backend), out_ref)
    buffer = torch.empty(2, 7, 40, device=device)
    with torch.no_grad():
        assert fused_embeddings(ids, *tables, backend=backend, out=buffer) is buffer
    assert_output_close(buffer, out_ref)
    with pytest.raises(ValueError, match="out= is for inference"):
        fused_embeddings(ids, *tables, backend=backend, out=buffer)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="not one of"):
        twins(8, "gpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_embeds_and_a_hooked_word_table_run_the_kernel_on_gathered_rows(backend, caplog, monkeypatch):
    """Word rows the kernel does not look up itself (`inputs_embeds`; a word module with a hook, whose own forward
    gives them; a sharded table's lookup, bertembed.parallel) are added and normalised by the kernel, and their
    gradient flows back to whatever gave them: outputs and gradients as the reference's, nothing falling back."""
    import bertembed.fast as kernels

    monkeypatch.setattr(kernels, "_told", set())
    ref, fused = pair(backend, 24)
    device = device_of(backend)
    given = [torch.randn(2, 3, 24).to(device).requires_grad_() for _ in range(2)]
    with torch.no_grad():
        given[1].copy_(given[0])
    with caplog.at_level(logging.INFO, logger="bertembed.fast"):
        out_ref, out = ref(inputs_embeds=given[0]), fused(inputs_embeds=given[1])
        upstream = torch.randn(out.shape).to(device)
        (out_ref * upstream).sum().backward()
        (out * upstream).sum().backward()
        assert_output_close(out, out_ref)
        assert_grad_close(given[1].grad, given[0].grad, "inputs_embeds")
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), fused.named_parameters(), strict=True):
            if name != "word_embeddings.weight":  # (not read: no gradient)
                assert_grad_close(p.grad, p_ref.grad, name)
        for layer in (ref, fused):
            layer.zero_grad()
            layer.word_embeddings.register_forward_hook(lambda m, args, out: out * 2)
        assert_output_close(*run_both(fused, ref, input_ids=awkward_ids(2, 5, 1000).to(device)))
        assert_grads_match(ref, fused)
    assert "reference" not in caplog.text


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_a_table_of_another_hidden_size_is_refused(backend, grad):
    """A position table cut to H - 1 columns through `.data`: the same ValueError as the reference's, before the
    kernel would read each row's last entry from outside the table."""
    ref, fused = pair(backend, 32)
    ids = awkward_ids(1, 5, ref.config.vocab_size).to(device_of(backend))
    for layer in (ref, fused):
        layer.position_embeddings.weight.data = layer.position_embeddings.weight.data[:, :31].contiguous()
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="must share one hidden size"):
            layer(ids)


BAD_IDS = [  # ids outside their tables: the layer names the first, as the reference does
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


def _no_kernel(*args, **kwargs):
    pytest.fail("a kernel ran on bad input")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("inputs", BAD_IDS)
def test_bad_ids_raise_the_reference_error(backend, inputs, grad, monkeypatch):
    """The CPU kernels skip a bad id as they read and report it (the layer then names it); Triton's are not launched:
    the ids are checked first (with id_checks="host", the default)."""
    ref, fused = pair(backend, 32)
    inputs = {k: v.to(device_of(backend)) for k, v in inputs.items()}
    with pytest.raises(ValueError) as expected:
        ref(**inputs)
    if backend == "triton":
        monkeypatch.setattr(backend_module("triton"), "run_forward", _no_kernel)
    with torch.set_grad_enabled(grad), pytest.raises(ValueError) as got:
        fused(**inputs)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inputs", BAD_INPUTS)
def test_bad_input_raises_reference_error_before_any_kernel(backend, inputs, monkeypatch):
    ref, fused = pair(backend, 32)
    inputs = {k: v.to(device_of(backend)) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with pytest.raises(ValueError) as expected:
        ref(**inputs)
    kernels = backend_module(backend)
    for name in ("run_forward", "forward"):  # (the CPU backend's kernel itself is `forward`)
        monkeypatch.setattr(kernels, name, _no_kernel, raising=name == "run_forward")
    with pytest.raises(ValueError) as got:
        fused(**inputs)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_itself_never_reads_outside_a_table(backend):
    """Called directly (past validation), the kernels skip a bad id and report it instead of reading out of bounds."""
    if device_of(backend) == "cuda":
        pytest.skip("the skipped-token count is read back only on CPU tensors")
    check_never_reads_outside_a_table(backend_module(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches(backend):
    check_empty_batches(backend, device_of(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_step_makes_no_statistics_gradient(backend):
    check_training_step_makes_no_statistics_gradient(backend, device_of(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_dtypes_fail_as_torchs_layer_norm_does(backend):
    """The layer, and the functional form, whose error is the reference backend's."""
    device = device_of(backend)
    check_layer_norm_dtypes_as_torch(backend, device)
    ref, _ = pair(backend, 24)
    word, position, segment, weight, bias = (p.detach() for p in ref.parameters())  # in the order registered
    ids = awkward_ids(2, 5, 1000).to(device)
    errors = []
    for name in ("reference", backend):
        with pytest.raises(ValueError, match="bfloat16 but the embeddings they normalise are torch.float32") as info:
            fused_embeddings(ids, word, segment, position, weight.bfloat16(), bias.bfloat16(), backend=name)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize(("backend", "dtype"), [*cases(CPU, torch.bfloat16), *cases(TRITON, torch.bfloat16,
                                                                                   torch.float16)])
@pytest.mark.parametrize("hidden", [64, 200])
def test_half_precision_tables_and_output(backend, dtype, hidden):
    """Half precision in and out: outputs within assert_close's defaults for the dtype, gradients those of the same
    function computed in float32 (`low_precision_grads`). (The CPU kernels take bfloat16, not float16.)"""
    ref, fused = pair(backend, hidden, dtype=dtype)
    check_low_precision(ref, fused, awkward_ids(3, 24, ref.config.vocab_size).to(device_of(backend)))


@pytest.mark.parametrize(("backend", "dtype"), [*cases(CPU, torch.bfloat16), *cases(TRITON, torch.bfloat16,
                                                                                   torch.float16)])
def test_half_precision_gradients_are_closer_to_float64_than_torchs(backend, dtype):
    check_low_precision_grads_beat_torchs(*pair(backend, 48, dtype=dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_edited_default_id_buffers_are_read(backend):
    """On the CPU also past the parallel kernels' threshold (240 tokens), and buffers made under inference_mode (they
    keep no version counter: a new one is still seen)."""
    device = device_of(backend)
    check_edited_default_id_buffers(backend, device, shapes=((2, 6, 40), (4, 60, 560)) if backend == "cpu" else
                                    ((2, 6, 40),))
    with torch.inference_mode():
        ref, fused = pair(backend, 24, max_position_embeddings=16)
        ids = awkward_ids(2, 6, ref.config.vocab_size).to(device)
        assert_output_close(fused(ids), ref(ids))
        for layer in (ref, fused):
            layer.position_ids = (torch.arange(16, device=device) // 2)[None]
        assert_output_close(fused(ids), ref(ids))


@pytest.mark.parametrize("backend", BACKENDS)
def test_autograds_other_modes_match_the_reference(backend):
    check_autograd_modes(backend, device_of(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_penalties_differentiate_through_the_fused_layer(backend):
    """Before, the kernels' gradients left a double backward as constants when the upstream gradient was constant (a
    linear loss), and a gradient penalty trained on without the layer's part."""
    check_gradient_penalties(backend, device_of(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_op_compiles_fullgraph(backend):
    check_custom_op_compiles(backend, device_of(backend))


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_whole_layer_traces_without_a_graph_break(backend):
    check_traced_whole_layer(backend, device_of(backend))


def test_a_layer_without_position_or_segment_table_traces_without_a_graph_break():
    """The kernels read one zero row in place of each missing table (ModernBERT has neither), in traced code too."""
    check_traced_whole_layer("cpu", position_embedding_type="none", type_vocab_size=0)
