"""The candidates `bertembed bench` puts side by side, all built around the same weights and ids.

    hf-eager             transformers' BertEmbeddings, eval (fwd) or train (fwd+bwd)
    hf-compile           torch.compile of it (static shapes, compiled afresh per case)
    ort-fused            ONNX Runtime's com.microsoft EmbedLayerNormalization, CPU provider, forward only
    bertembed-reference  bertembed.BertEmbeddings, the reference
    bertembed-fused      bertembed.BertEmbeddings(backend="cpu" | "triton"), when bertembed.kernels exists
    bertembed-fused-device-checks   the same on a GPU with `id_checks = "device"`: no wait for the device per call

Dimension letters: B batch, L length, H hidden.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bertembed.bench.cases import Case
from bertembed.config import EmbeddingConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class NotAvailable(Exception):
    """A candidate that cannot run a case here; the message says why (shown in the report)."""


@dataclass
class Candidate:
    """A no-argument callable for one case: a forward returning the output, or a fwd+bwd step."""

    name: str
    call: Callable[[], Any]
    torch_memory: bool = True  # torch's allocator sees its allocations (peak memory is measurable)


@dataclass
class Workload:
    """Weights and inputs of one case, shared by every candidate."""

    case: Case
    config: EmbeddingConfig
    state_dict: dict[str, torch.Tensor]  # float32, CPU, Hugging Face names
    input_ids: torch.Tensor  # [B, L] int64
    token_type_ids: torch.Tensor  # [B, L] int64, 0 or 1
    grad_output: torch.Tensor  # [B, L, H], for fwd+bwd


def make_workload(case: Case, seed: int = 0, vocab_size: int = 30522) -> Workload:
    """Random BERT-like weights (LayerNorm's gamma and beta not the identity, so a wrong scale shows) and ids."""
    gen = torch.Generator().manual_seed(seed)
    config = EmbeddingConfig(vocab_size=vocab_size, hidden_size=case.hidden)
    state = dict(_initial_state(seed, config))
    state["LayerNorm.weight"] = 1 + 0.1 * torch.randn(case.hidden, generator=gen)
    state["LayerNorm.bias"] = 0.1 * torch.randn(case.hidden, generator=gen)
    shape = (case.batch, case.length)
    device, dtype = torch.device(case.device), _DTYPES[case.dtype]
    return Workload(
        case=case, config=config, state_dict=state,
        input_ids=torch.randint(0, vocab_size, shape, generator=gen).to(device),
        token_type_ids=torch.randint(0, 2, shape, generator=gen).to(device),
        grad_output=torch.randn(*shape, case.hidden, generator=gen).to(device, dtype),
    )


@functools.lru_cache(maxsize=1)
def _initial_state(seed: int, config: EmbeddingConfig) -> dict[str, torch.Tensor]:
    """The layer's initial weights for `seed`, kept for the next case of the same size (the sweep runs the cases of
    one hidden size in a row): drawing 30522 x H normals took 0.3 s a case. Candidates copy them, never write them."""
    from bertembed.embeddings import BertEmbeddings

    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in BertEmbeddings(config).state_dict().items()}


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """`torch.nn.init`'s random fills as no-ops, while a module is built whose weights `load_state_dict` replaces
    next: drawing a 30522 x H table took 0.3 s a module on a 2-vCPU VM, about 5 s of a `--quick` run. The tables are
    left uninitialised (`torch.empty`) until then; `load_state_dict` is strict, so none stays so."""
    names = ("normal_", "uniform_", "trunc_normal_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fill in saved.items():
            setattr(nn.init, name, fill)


_FUSED_IMPORTS = ("bertembed.embeddings", "bertembed.kernels.function", "bertembed.kernels.lean")
_HF_IMPORTS = ("transformers.models.bert.modeling_bert",)
# The modules beyond torch that building (and first calling) each candidate imports.
IMPORTS: dict[str, tuple[str, ...]] = {
    "hf-eager": _HF_IMPORTS, "hf-compile": (*_HF_IMPORTS, "torch._dynamo", "torch._inductor.compile_fx"),
    "ort-fused": ("onnx", "onnxruntime"), "bertembed-reference": ("bertembed.embeddings",),
    "bertembed-fused": _FUSED_IMPORTS, "bertembed-fused-device-checks": _FUSED_IMPORTS,
}


def preload(names: tuple[str, ...]) -> None:
    """Imports what the candidates `names` would import when built; a module that is missing is skipped here (the
    candidate is then reported as not available, with the reason, when built)."""
    for module in sorted({m for name in names for m in IMPORTS.get(name, ())}):
        try:
            importlib.import_module(module)
        except ImportError:
            continue


def _hf_module(work: Workload) -> nn.Module:
    try:
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertEmbeddings as HFBertEmbeddings
    except ImportError as err:
        raise NotAvailable(f"transformers not installed ({err}); pip install transformers") from err

    c = work.config
    hf_config = BertConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                           max_position_embeddings=c.max_position_embeddings, type_vocab_size=c.type_vocab_size,
                           layer_norm_eps=c.layer_norm_eps, hidden_dropout_prob=c.hidden_dropout_prob,
                           pad_token_id=c.pad_token_id)
    with _no_random_init():
        module = HFBertEmbeddings(hf_config)
    module.load_state_dict(work.state_dict)
    return module


def _fused_module(work: Workload, id_checks: str = "host") -> nn.Module:
    backend = "cpu" if work.case.device == "cpu" else "triton"
    try:
        from bertembed.kernels import fused_embeddings  # noqa: F401  (presence check)
    except ImportError as err:
        raise NotAvailable(f"bertembed.kernels not importable ({err})") from err
    from bertembed.embeddings import BertEmbeddings

    try:
        with _no_random_init():
            module = BertEmbeddings(work.config, backend=backend)
    except TypeError as err:
        raise NotAvailable(f"BertEmbeddings has no backend= argument yet ({err})") from err
    except (ImportError, ValueError, RuntimeError) as err:
        raise NotAvailable(f"backend={backend!r} refused: {err}") from err
    _check_no_fallback(backend, work)
    module.load_state_dict(work.state_dict)
    module.id_checks = id_checks
    return module


def _check_no_fallback(backend: str, work: Workload) -> None:
    """The layer would quietly run the reference where the kernel cannot (a logged fallback); here that must show."""
    import bertembed.kernels as kernels

    select = getattr(kernels, "select_backend", None)
    if select is None:
        return
    chosen, reason = select(backend, torch.device(work.case.device), _DTYPES[work.case.dtype])
    if chosen == "reference":
        raise NotAvailable(f"backend={backend!r} would fall back to the reference: {reason}")


def _reference_module(work: Workload) -> nn.Module:
    from bertembed.embeddings import BertEmbeddings

    with _no_random_init():
        module = BertEmbeddings(work.config)
    module.load_state_dict(work.state_dict)
    return module


def _torch_call(module: nn.Module, work: Workload) -> Callable[[], Any]:
    """Forward under no_grad in eval mode, or one training step: forward in train mode, backward of a fixed output
    gradient into fresh dense gradients, then the gradients set to None (as `zero_grad()` does)."""
    case = work.case
    module = module.to(torch.device(case.device), _DTYPES[case.dtype])
    ids, types = work.input_ids, work.token_type_ids
    if case.mode == "fwd":
        module.eval()

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return module(ids, types)

        return forward
    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    grad = work.grad_output

    def step() -> None:
        module(ids, types).backward(grad)
        for p in params:  # freed at the end, so a peak-memory measurement of one step sees the gradients' birth
            p.grad = None

    return step


def _compiled(work: Workload, reset: bool = True) -> Callable[[], Any]:
    """`torch.compile` of transformers' layer. Dynamo's caches are reset first (unless not `reset`), so every case
    compiles afresh with static shapes (no recompile limit, no automatic dynamic shapes carried over from earlier
    cases)."""
    if reset:
        torch._dynamo.reset()
    module = _hf_module(work).to(torch.device(work.case.device), _DTYPES[work.case.dtype])
    compiled = torch.compile(module, dynamic=False)
    call = _torch_call(compiled, work)
    try:
        call()
        call()
    except Exception as err:  # noqa: BLE001  (any compiler failure makes the candidate unavailable, not the run)
        raise NotAvailable(f"torch.compile failed: {type(err).__name__}: {str(err)[:200]}") from err
    return call


def _ort(work: Workload) -> Callable[[], Any]:
    case = work.case
    if case.mode != "fwd":
        raise NotAvailable("ONNX Runtime's op is inference-only (no backward)")
    if case.device != "cpu" or case.dtype != "float32":
        raise NotAvailable("measured on the CPU provider in float32 only")
    from bertembed.bench.onnx_graph import embed_layernorm_model, ort_forward, ort_session

    try:  # onnx and onnxruntime are imported inside these
        model = embed_layernorm_model(work.state_dict, work.config.layer_norm_eps)
        session = ort_session(model, torch.get_num_threads())
    except ImportError as err:
        raise NotAvailable(f"onnx/onnxruntime not installed ({err}); pip install 'bertembed[bench]'") from err
    return ort_forward(session, work.input_ids, work.token_type_ids)


def build(name: str, work: Workload, reset: bool = True) -> Candidate:
    """Candidate `name` for `work`'s case; raises NotAvailable with the reason when it cannot run here. `reset`:
    whether `hf-compile` resets dynamo's caches first (see `_compiled`)."""
    if name == "hf-eager":
        return Candidate(name, _torch_call(_hf_module(work), work))
    if name == "hf-compile":
        return Candidate(name, _compiled(work, reset))
    if name == "ort-fused":
        return Candidate(name, _ort(work), torch_memory=False)
    if name == "bertembed-reference":
        return Candidate(name, _torch_call(_reference_module(work), work))
    if name == "bertembed-fused":
        return Candidate(name, _torch_call(_fused_module(work), work))
    if name == "bertembed-fused-device-checks":
        return Candidate(name, _torch_call(_fused_module(work, "device"), work))
    raise ValueError(f"unknown candidate {name!r}")


def reference_output(work: Workload) -> torch.Tensor:
    """The bertembed reference's float32 eval output for `work`'s ids: [B, L, H] on the CPU."""
    module = _reference_module(work).eval()
    with torch.no_grad():
        return module(work.input_ids.cpu(), work.token_type_ids.cpu())


# Largest |output - float32 reference| that still counts as the same layer, for outputs up to ~5 in size: float32,
# far above ORT's 4e-6; bfloat16, 4 ulps at 4-8 (2^-5 each): transformers' own bf16 layer is 0.058 off here.
DIFF_TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 0.125}


def max_abs_diff(output: Any, reference: torch.Tensor) -> float:
    """Largest |output - reference| over all elements, in float64 (output: a tensor or a numpy array)."""
    out = torch.as_tensor(output).detach().cpu().double()
    return float((out - reference.double()).abs().max())
