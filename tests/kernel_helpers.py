"""Shared helpers of the kernel tests: a reference layer and a fused twin with the same weights, and the tolerances
the issue states."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from bertembed.config import EmbeddingConfig
from bertembed.embeddings import BertEmbeddings

# Without a GPU the Triton backend runs in Triton's interpreter (conftest imported the kernels under it first); the
# tests that take TRITON switch it on for themselves with the `triton_interpreter` fixture.
ON_GPU = torch.cuda.is_available()


def _triton_missing() -> str | None:
    """Why the Triton tests cannot run here, or None."""
    try:
        import bertembed.fast.triton  # noqa: F401
    except ImportError:
        return "triton is not installed (the gpu or dev extra)"
    if not ON_GPU and os.environ.get("TRITON_INTERPRET", "1") != "1":
        return "no GPU, and TRITON_INTERPRET is not 1"
    return None


TRITON_MISSING = _triton_missing()
# each kernel backend, skipped with the reason where its package is missing (the tests, as Liger-Kernel's: one body)
CPU = pytest.param("cpu", marks=pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                                   reason="numba is not installed (the fast or dev extra)"))
TRITON = pytest.param("triton", marks=pytest.mark.skipif(TRITON_MISSING is not None, reason=str(TRITON_MISSING)))
BACKENDS = [CPU, TRITON]


def cases(backend, *rows) -> list:
    """`backend` (CPU or TRITON) beside each row of further arguments, skipped as the backend is: for a test whose
    cases differ by backend."""
    return [pytest.param(*backend.values, *(row if isinstance(row, tuple) else (row,)), marks=backend.marks)
            for row in rows]


@pytest.fixture
def triton_interpreter(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the backend selection accepts CPU tensors only with it


def device_of(backend: str) -> str:
    return "cuda" if backend == "triton" and ON_GPU else "cpu"


def twins(hidden: int, backend: str, vocab: int = 1000, seed: int = 0, dtype=torch.float32, **config):
    """(reference layer, fused layer) with identical random weights, LayerNorm not the identity, in eval mode."""
    torch.manual_seed(seed)
    cfg = EmbeddingConfig(vocab_size=vocab, hidden_size=hidden, **config)
    ref = BertEmbeddings(cfg).eval()
    with torch.no_grad():
        ref.LayerNorm.weight.uniform_(0.5, 1.5)
        ref.LayerNorm.bias.uniform_(-0.2, 0.2)
    fused = BertEmbeddings(cfg, backend=backend).eval()
    fused.load_state_dict(ref.state_dict())
    return ref.to(dtype), fused.to(dtype)


def awkward_ids(batch: int, length: int, vocab: int, pad: int = 0, seed: int = 1) -> torch.Tensor:
    """Random ids with a repeated id in every row (gradient accumulation on one row) and trailing [PAD]s."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    ids[:, : min(3, length)] = 7  # the same row three times per sequence, batch times in all
    if length > 4:
        ids[:, -(length // 4):] = pad
    return ids


def assert_output_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: within 5e-7 x max(1, max|ref|), a few ulps; other dtypes: assert_close's defaults for the dtype."""
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=0, atol=5e-7 * max(1.0, ref.abs().max().item()))
    else:
        torch.testing.assert_close(out, ref)


def assert_grad_close(grad: torch.Tensor, ref: torch.Tensor, name: str = "") -> None:
    """rtol 1e-5 and atol 1e-5 x max|ref| (sums over many tokens differ by summation order)."""
    assert grad is not None, f"{name}: no gradient"
    torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5 * max(ref.abs().max().item(), 1e-30),
                               msg=lambda m: f"{name}: {m}")


def run_both(ref, fused, grad_seed: int = 2, **inputs):
    """Forward both layers, backward the same random upstream gradient; returns (out_ref, out_fused)."""
    out_ref, out = ref(**inputs), fused(**inputs)
    upstream = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(grad_seed))
    upstream = upstream.to(out_ref.device, out_ref.dtype)
    (out_ref * upstream).sum().backward()
    (out * upstream).sum().backward()
    return out_ref, out


def assert_grads_match(ref, fused) -> None:
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), fused.named_parameters(), strict=True):
        assert_grad_close(p.grad, p_ref.grad, name)


def low_precision_grads(layer, ids, upstream) -> dict[str, torch.Tensor]:
    """Gradients of a float16/bfloat16 layer's own function, computed in float32: the sums are rounded to the tables'
    dtype as the layer rounds them (straight through in backward, as torch's autograd treats a cast), LayerNorm in
    float32. What a float32-accumulating fused backward should give, to the dtype's rounding."""
    import torch.nn.functional as F

    dtype = layer.word_embeddings.weight.dtype
    tables = {name: p.detach().float().requires_grad_() for name, p in layer.named_parameters()}

    def rounded(x):
        return x + (x.to(dtype).float() - x).detach()

    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    x = rounded(F.embedding(ids, tables["word_embeddings.weight"], layer.word_embeddings.padding_idx)
                + F.embedding(torch.zeros_like(ids), tables["token_type_embeddings.weight"]))
    x = rounded(x + F.embedding(positions, tables["position_embeddings.weight"]))
    out = F.layer_norm(x, x.shape[-1:], tables["LayerNorm.weight"], tables["LayerNorm.bias"], layer.LayerNorm.eps)
    (out * upstream).sum().backward()
    return {name: t.grad for name, t in tables.items()}


def check_low_precision(ref, fused, ids) -> None:
    """Output within assert_close's defaults for the dtype; gradients against `low_precision_grads`."""
    out = fused(ids)
    dtype = ref.word_embeddings.weight.dtype
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref(ids))
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.device)
    (out.float() * upstream).sum().backward()
    expected = low_precision_grads(ref, ids, upstream.to(dtype).float())  # the gradient `out` receives is rounded
    for name, p in fused.named_parameters():
        assert p.grad.dtype == dtype
        torch.testing.assert_close(p.grad, expected[name].to(dtype), msg=lambda m, n=name: f"{n}: {m}")


def check_low_precision_grads_beat_torchs(ref, fused) -> None:
    """The fused backward sums a float16/bfloat16 layer's gradients in float32 and rounds once, where torch's layer
    of that dtype adds into it on the CPU: against the same layer computed in float64, every fused gradient is at
    least as close as torch's (0.25-0.6 of its error on the CPU, hidden 48). On a GPU, where torch's embedding
    backward sums in float32 too, in another order, give or take one rounding of the dtype at the gradient's size."""
    import copy

    exact = copy.deepcopy(ref).double()
    device = ref.word_embeddings.weight.device
    ids = awkward_ids(3, 20, ref.config.vocab_size).to(device)
    types = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(3)).to(device)
    upstream = torch.randn(*ids.shape, ref.config.hidden_size, generator=torch.Generator().manual_seed(4))
    upstream = upstream.to(device, ref.word_embeddings.weight.dtype)  # the gradient a low-precision layer receives
    for layer in (ref, fused, exact):
        (layer(ids, token_type_ids=types) * upstream.to(layer.word_embeddings.weight.dtype)).sum().backward()
    for (name, p_ref), p_fused, p_exact in zip(ref.named_parameters(), fused.parameters(), exact.parameters(),
                                               strict=True):
        torch_error = (p_ref.grad.double() - p_exact.grad).abs().max()
        one_rounding = torch.finfo(p_ref.dtype).eps * p_exact.grad.abs().max() if p_ref.is_cuda else 0.0
        assert (p_fused.grad.double() - p_exact.grad).abs().max() <= torch_error + one_rounding, name


def check_never_reads_outside_a_table(kernels) -> None:
    """Called directly (past validation), a backend's kernels skip a bad id and report it instead of reading out of
    bounds: a word id past the table, a negative one, a segment id of 2, a position past the table."""
    import pytest

    word, seg, pos = torch.randn(10, 8), torch.randn(2, 8), torch.randn(16, 8)
    ones, zeros = torch.ones(8), torch.zeros(8)
    for ids, tts, pids in [([3, 10], [0, 0], [0, 1]), ([3, -1], [0, 0], [0, 1]), ([3, 4], [0, 2], [0, 1]),
                           ([3, 4], [0, 0], [0, 16])]:
        args = [torch.tensor(a) for a in (ids, tts, pids)]
        with pytest.raises(RuntimeError, match="outside their tables"):
            kernels.run_forward(*args, word, seg, pos, ones, zeros, 1e-12, 0.0, 0)
        with pytest.raises(RuntimeError, match="outside their tables"):
            kernels.run_backward(torch.ones(2, 8), *args, word, seg, pos, ones, torch.zeros(2), torch.ones(2), 0.0,
                                 0, 0)


def check_empty_batches(backend: str, device: str = "cpu") -> None:
    """No sequences, or sequences of no tokens: the reference's empty outputs, in inference and in training, where
    every parameter gets a zero gradient of its own shape."""
    ref, fused = twins(16, backend, vocab=50)
    ref, fused = ref.to(device), fused.to(device)
    for shape in [(0, 5), (2, 0)]:
        ids = torch.zeros(shape, dtype=torch.long, device=device)
        with torch.no_grad():
            assert fused(ids).shape == ref(ids).shape == (*shape, 16)
        fused.train()
        fused(ids).sum().backward()
        fused.eval()
        for name, param in fused.named_parameters():
            assert param.grad is not None and param.grad.shape == param.shape and not param.grad.any(), name
            param.grad = None


def check_custom_op_compiles(backend: str, device: str = "cpu") -> None:
    """`torch.compile(fullgraph=True)` of the custom op, forward and backward, with [B, L] ids and with [1, L] ones
    shared by the batch: outputs and all five gradients as the reference's. The backward op's outputs
    must not share storage, which only a compiled backward checks."""
    import bertembed.fast.function  # noqa: F401  (registers torch.ops.bertembed.embeddings)

    ref, fused = twins(48, backend)
    ref, fused = ref.to(device), fused.to(device)
    ids = awkward_ids(2, 9, ref.config.vocab_size).to(device)
    segments, positions = torch.zeros_like(ids), torch.arange(9, device=device)[None].expand(2, 9)
    tables = [fused.word_embeddings.weight, fused.token_type_embeddings.weight, fused.position_embeddings.weight,
              fused.LayerNorm.weight, fused.LayerNorm.bias]
    for given in (segments, positions), (segments[:1], positions[:1]):
        def layer(word, seg, pos, weight, bias, given=given):
            return torch.ops.bertembed.embeddings(ids, *given, word, seg, pos, weight, bias, 1e-12, 0.0, 0, 0, -1,
                                                  backend, False)[0]

        torch._dynamo.reset()
        out = torch.compile(layer, fullgraph=True)(*tables)
        upstream = torch.randn(out.shape, device=device)
        (out * upstream).sum().backward()
        (ref(ids) * upstream).sum().backward()
        assert_output_close(out, ref(ids))
        assert_grads_match(ref, fused)
        for module in (ref, fused):
            module.zero_grad(set_to_none=True)


def check_traced_whole_layer(backend: str, device: str = "cpu", **config) -> None:
    """The whole layer under `torch.compile(fullgraph=True)` (inference and training) and `torch.export`: no graph
    break (the id-range check stays out of traced code), the reference's outputs and gradients, and
    a bad id inside the graph still reads nothing outside a table. On CPU tensors it fails, as in transformers' layer;
    on a GPU the Triton kernel gives that token a row of NaN (no read-back inside a graph) and the other rows right."""
    import pytest

    ref, layer = twins(48, backend, **config)
    ref, layer = ref.to(device), layer.to(device)
    ids = awkward_ids(2, 9, ref.config.vocab_size).to(device)
    bad = ids.clone()
    bad[1, 3] = ref.config.vocab_size
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        assert_output_close(compiled(ids), ref(ids))
    out_ref, out = run_both(ref, compiled, input_ids=ids, past_key_values_length=2)
    assert_output_close(out, out_ref)
    assert_grads_match(ref, layer)
    exported = torch.export.export(layer.eval(), (ids,))
    ops = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert backend == "reference" or any(op.startswith("bertembed.embeddings") for op in ops), ops
    assert_output_close(exported.module()(ids), ref.eval()(ids))
    for traced in (compiled, exported.module()):
        if device == "cpu":
            with pytest.raises((IndexError, RuntimeError), match="out of|outside their tables"), torch.no_grad():
                traced(bad)
            continue
        with torch.no_grad():
            out, expected = traced(bad), ref(ids)
        assert out[1, 3].isnan().all() and not out[0].isnan().any()
        assert_output_close(out[0], expected[0])


def check_training_step_makes_no_statistics_gradient(backend: str, device: str = "cpu") -> None:
    """The layer's mean and 1/std [B, L] outputs get no gradient: a training step creates no zero-filled [B, L] tensor
    for them (autograd's default for unused outputs: two fill kernels a step on a GPU), and its gradients are right."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ZeroFills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.zeros, torch.ops.aten.zeros_like, torch.ops.aten.zero_):
                self.shapes.append(tuple(out.shape))
            return out

    ref, fused = twins(48, backend, hidden_dropout_prob=0.0)  # train mode, same outputs
    ref, fused = ref.to(device), fused.to(device)
    ids = awkward_ids(3, 7, ref.config.vocab_size).to(device)
    with ZeroFills() as fills:
        out_ref, out = run_both(ref.train(), fused.train(), input_ids=ids)
    assert (3, 7) not in fills.shapes, fills.shapes
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)


_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _torch_layer_norm_takes(summed: torch.dtype, weight: torch.dtype, bias: torch.dtype, device: str) -> bool:
    """The oracle: whether torch's own LayerNorm on `device` runs on an input of dtype `summed` with these."""
    import torch.nn.functional as F

    try:
        F.layer_norm(torch.randn(3, 8, dtype=summed, device=device), (8,), torch.ones(8, dtype=weight, device=device),
                     torch.zeros(8, dtype=bias, device=device))
    except RuntimeError:
        return False
    return True


def _no_kernel(*args, **kwargs):
    pytest.fail("a kernel ran on bad input")


def check_layer_norm_dtypes_as_torch(backend: str, device: str = "cpu") -> None:
    """Every table dtype beside every LayerNorm dtype (and a bias apart from its weight): where torch's LayerNorm
    refuses the mix, the fused layer raises the reference's ValueError, with or without autograd and before any kernel;
    where it takes it, the two agree. (Bad input must fail the same way on every backend.)"""
    from bertembed.fast.function import backend_module

    mixes = [(t, n, n) for t in _NORM_DTYPES for n in _NORM_DTYPES] + [(torch.bfloat16, torch.float32, torch.bfloat16)]
    ids = awkward_ids(2, 5, 1000).to(device)
    for tables, weight, bias in mixes:
        ref, fused = (layer.to(device) for layer in twins(24, backend, dtype=tables))
        for norm in (ref.LayerNorm, fused.LayerNorm):
            norm.weight.data, norm.bias.data = norm.weight.data.to(weight), norm.bias.data.to(bias)
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                if _torch_layer_norm_takes(tables, weight, bias, device):
                    torch.testing.assert_close(fused(ids), ref(ids), msg=lambda m, t=tables, w=weight: f"{t} {w}: {m}")
                    continue
                with pytest.raises(ValueError, match="LayerNorm weight and bias are") as expected:
                    ref(ids)
                with pytest.MonkeyPatch.context() as patch, pytest.raises(ValueError) as got:
                    patch.setattr(backend_module(backend), "run_forward", _no_kernel)
                    fused(ids)
                assert str(got.value) == str(expected.value)


def check_gradient_penalties(backend: str, device: str = "cpu") -> None:
    """Double backward (`create_graph=True`, a gradient penalty) through the fused layer equals the reference's, for
    every parameter: with an upstream gradient that needs a graph itself (a cubic loss) and with a constant one (a
    linear loss, whose first-order gradients still depend on the tables and LayerNorm's weight). Padding, a repeated
    id, segment ids and a position offset included. With dropout on it raises, naming the way out."""
    ref, fused = (layer.to(device) for layer in twins(40, backend, hidden_dropout_prob=0.0))
    ids = awkward_ids(3, 7, ref.config.vocab_size).to(device)
    segments = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(3)).to(device)
    weights = torch.randn((*ids.shape, 40), generator=torch.Generator().manual_seed(4)).to(device)
    for loss_of in (lambda out: (out ** 3).sum(), lambda out: (out * weights).sum()):
        grads = []
        for layer in (ref, fused):
            layer.zero_grad()
            out = layer(ids, token_type_ids=segments, past_key_values_length=2)
            names, params = zip(*layer.named_parameters(), strict=True)
            first = torch.autograd.grad(loss_of(out), params, create_graph=True)
            assert all(g.requires_grad for n, g in zip(names, first, strict=True) if n != "LayerNorm.bias")
            (out.square().mean() + sum(g.square().sum() for g in first)).backward()
            grads.append({name: p.grad for name, p in layer.named_parameters()})
        for name, expected in grads[0].items():
            assert_grad_close(grads[1][name], expected, name)
    fused.train()
    fused.dropout.p = 0.1
    out = fused(ids)
    with pytest.raises(RuntimeError, match="backend='reference'"):
        torch.autograd.grad((out * weights).sum(), fused.LayerNorm.weight, create_graph=True)


def check_autograd_modes(backend: str, device: str = "cpu") -> None:
    """The fused layer under autograd's other modes equals the reference: its output edited in place before the
    backward (a forward hook's `mul_`), forward-mode AD (`jacobian(strategy="forward-mode")`, under no_grad too), and
    a batched backward (`is_grads_batched`, `jacobian(vectorize=True)`)."""
    from torch.func import functional_call

    ref, fused = (layer.to(device) for layer in twins(8, backend, vocab=10, max_position_embeddings=8))
    ids = torch.tensor([[1, 2, 2, 0]], device=device)
    upstream = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(5)).to(device)
    edited = []
    for layer in (ref, fused):
        layer.zero_grad()
        out = layer(ids)
        out.mul_(2)[:, 0] = 0  # in place, twice
        (out * upstream).sum().backward()
        edited.append((out, {name: p.grad for name, p in layer.named_parameters()}))
    assert_output_close(edited[1][0], edited[0][0])
    for name, expected in edited[0][1].items():
        assert_grad_close(edited[1][1][name], expected, name)
    word = ref.word_embeddings.weight.detach().clone()
    for how in ({"strategy": "forward-mode", "vectorize": True}, {"vectorize": True}):
        for grad_mode in (True, False):
            jacobians = []
            for layer in (ref, fused):
                params = {k: p.detach() for k, p in layer.named_parameters()}

                def embed(w, layer=layer, params=params):
                    return functional_call(layer, {**params, "word_embeddings.weight": w}, (ids,))

                with torch.set_grad_enabled(grad_mode):
                    jacobians.append(torch.autograd.functional.jacobian(embed, word, **how))
            assert jacobians[0].abs().max() > 0, how
            assert_grad_close(jacobians[1], jacobians[0], str(how))


def check_edited_default_id_buffers(backend: str, device: str = "cpu", shapes=((2, 6, 40),)) -> None:
    """A layer whose default-id buffers were edited (a new `position_ids` tensor assigned, `token_type_ids` changed in
    place), as transformers' may be, gives the reference's output and gradients: the layer slices its ids from the
    buffers on every call and hands them to the kernels. Then back to the defaults."""
    for batch, length, hidden in shapes:
        ref, fused = (layer.to(device) for layer in twins(hidden, backend, max_position_embeddings=64))
        ids = awkward_ids(batch, length, ref.config.vocab_size).to(device)
        for step in ("positions", "segments", "restored"):
            for layer in (ref, fused):
                if step == "positions":
                    layer.position_ids = (torch.arange(64, device=device) // 2)[None]
                elif step == "segments":
                    layer.token_type_ids[:, 1::2] = 1
                else:
                    layer.position_ids = torch.arange(64, device=device)[None]
                    layer.token_type_ids.zero_()
            with torch.no_grad():
                assert_output_close(fused(ids, past_key_values_length=3), ref(ids, past_key_values_length=3))
            ref.zero_grad()
            fused.zero_grad()
            run_both(ref, fused, input_ids=ids)
            assert_grads_match(ref, fused)
