"""What `bertembed bench` runs: the cases, and the candidates around the same weights and ids (public API only).
Dimension letters: B batch, L length, H hidden."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

HIDDENS = (384, 768, 1024)  # MiniLM / bert-base / bert-large
SHAPES = ((1, 11), (32, 128), (8, 512), (64, 512))  # (B, L): one sentence .. a full batch
QUICK_HIDDENS, QUICK_SHAPES = (768,), ((1, 11), (32, 128))
# members whose forward is measured beside BERT's, with their checkpoints' keys that the class defaults do not give
MEMBERS = {"roberta": {"type_vocab_size": 1, "max_position_embeddings": 514, "layer_norm_eps": 1e-5},
           "distilbert": {}, "modernbert": {"pad_token_id": 0}}  # (its own pad id, 50283, lies past VOCAB)
MODES = ("fwd", "fwdbwd")  # forward in eval mode under no_grad; a training step (train mode, backward)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CANDIDATES = ("hf-eager", "hf-compile", "ort-fused", "bertembed-reference", "bertembed-fused",
              "bertembed-fused-device-checks")
VOCAB = 30522
# Largest |output - float32 reference| that still counts as the same layer (bfloat16: 4 ulps at 4-8; transformers'
# own bf16 layer is 0.058 off).
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.125, "float16": 2e-2}


class NotAvailable(Exception):
    """A candidate that cannot run a case here; the message says why (shown in the report)."""


@dataclass(frozen=True)
class Case:
    hidden: int
    batch: int
    length: int
    mode: str = "fwd"
    dtype: str = "float32"
    device: str = "cpu"
    member: str = "bert"

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.dtype not in DTYPES:
            raise ValueError(f"a case's mode is one of {MODES} and dtype one of {tuple(DTYPES)}; got {self}")

    @property
    def key(self) -> str:
        member = "" if self.member == "bert" else f"{self.member} "
        return f"{self.device} {member}H={self.hidden} B={self.batch} L={self.length} {self.mode} {self.dtype}"

    @property
    def output_bytes(self) -> int:
        return self.batch * self.length * self.hidden * DTYPES[self.dtype].itemsize

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bound_bytes(case: Case) -> int:
    """Least bytes a forward moves: B*L gathered word, position and segment rows of H values, gamma and beta, and
    the [B, L, H] output written once (ids left out)."""
    tokens, size = case.batch * case.length, DTYPES[case.dtype].itemsize
    return (tokens * 3 * case.hidden + 2 * case.hidden + tokens * case.hidden) * size


def plan(quick: bool, hiddens=None, shapes=None, dtypes=None, devices=("cpu",)) -> list[Case]:
    """float32 forward and training step over hiddens x shapes, each other dtype's forward, grouped so each group's
    modules are built once; then, unless shapes were given, `MEMBERS`' forward at the first shape past a sentence."""
    members = () if shapes else MEMBERS
    hiddens, shapes = hiddens or (QUICK_HIDDENS if quick else HIDDENS), shapes or (QUICK_SHAPES if quick else SHAPES)
    dtypes = dtypes or (("float32",) if quick else ("float32", "bfloat16"))
    cases = [Case(h, b, n, mode, dtype, device) for device in devices for h in hiddens for dtype in dtypes
             for b, n in shapes for mode in MODES if mode == "fwd" or dtype == "float32"]
    longer = [shape for shape in shapes if shape[0] * shape[1] > 11][:1]
    return cases + [Case(h, b, n, "fwd", "float32", device, member) for member in members for device in devices
                    for h in hiddens for b, n in longer]


def runs(name: str, case: Case) -> bool:
    """Whether candidate `name` takes part in `case`: ORT is CPU, float32 and forward only; the device id checks GPU
    only; torch.compile float32 only (a bfloat16 compile doubles the compile time)."""
    if name == "ort-fused":
        return case.device == "cpu" and case.mode == "fwd" and case.dtype == "float32"
    if name == "bertembed-fused-device-checks":
        return case.device != "cpu"
    return name != "hf-compile" or case.dtype == "float32"


def modules(hidden: int, device: str, dtype: str, seed: int = 0, vocab: int = VOCAB,
            member: str = "bert") -> dict[str, Any]:
    """The float32 state dict, the float32 reference and every torch candidate's module for one group of cases; a
    candidate that cannot be built maps to its NotAvailable."""
    from bertembed import BertEmbeddings, EmbeddingConfig

    torch.manual_seed(seed)
    config = EmbeddingConfig.from_hf_config({"model_type": member, "vocab_size": vocab, "hidden_size": hidden,
                                             "dim": hidden, **MEMBERS.get(member, {})})
    reference = BertEmbeddings(config)
    with torch.no_grad():  # gamma and beta off the identity, so a missing scale or shift shows
        for param in reference.LayerNorm.parameters():
            param.add_(0.1 * torch.randn(hidden))
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    built: dict[str, Any] = {"state": state, "config": config, "reference32": reference.to(device),
                             "bertembed-reference": copy.deepcopy(reference)}
    try:
        built["hf-eager"] = built["hf-compile"] = _transformers_layer(config, state)
    except (ImportError, ValueError) as err:
        built["hf-eager"] = built["hf-compile"] = NotAvailable(f"transformers cannot build it here ({err})")
    backend = "cpu" if device == "cpu" else "triton"
    try:
        built["bertembed-fused"] = fused = BertEmbeddings(config, backend=backend)
        fused.load_state_dict(state)
        if device != "cpu":
            built["bertembed-fused-device-checks"] = checks = copy.deepcopy(fused)
            checks.id_checks = "device"  # ids checked by the kernel: no wait for the device per call
    except (ImportError, ValueError, RuntimeError) as err:
        built["bertembed-fused"] = built["bertembed-fused-device-checks"] = NotAvailable(
            f"backend={backend!r} refused: {err}")
    for name in CANDIDATES:
        if isinstance(built.get(name), torch.nn.Module):
            built[name] = built[name].to(device, DTYPES[dtype])
    return built


def _transformers_layer(config, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' own embeddings module of `config`'s member, holding `state`'s tables."""
    import transformers

    from bertembed.family import layout

    # the encoder around the layer, built once and dropped; no special ids (ModernBERT's lie past the vocabulary here,
    # and transformers would warn of each)
    small = {"num_hidden_layers": 1, "n_layers": 1, "num_attention_heads": 1, "n_heads": 1, "intermediate_size": 8,
             "hidden_dim": 8, **dict.fromkeys(("bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id"))}
    hf_config = transformers.AutoConfig.for_model(**{**config.to_hf_config(), **small})
    layer = transformers.AutoModel.from_config(hf_config).embeddings
    keys = layout(config.model_type)
    layer.load_state_dict({keys[k].removeprefix("embeddings."): v for k, v in state.items()})
    return layer


def inputs(case: Case, seed: int = 0, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids uniform over the vocabulary, segment ids over {0, 1}, and an output gradient for the training step."""
    gen = torch.Generator().manual_seed(seed)
    shape = (case.batch, case.length)
    ids, types = torch.randint(0, vocab, shape, generator=gen), torch.randint(0, 2, shape, generator=gen)
    grad = torch.randn(*shape, case.hidden, generator=gen)
    return ids.to(case.device), types.to(case.device), grad.to(case.device, DTYPES[case.dtype])


def arguments(built: dict[str, Any], ids, types) -> dict[str, Any]:
    """The keyword arguments of a forward: segment ids only for a member with two or more segment rows."""
    return {"input_ids": ids, "token_type_ids": types} if built["config"].type_vocab_size > 1 else {"input_ids": ids}


def call(name: str, built: dict[str, Any], case: Case, ids, types, grad) -> Callable[[], Any]:
    """A no-argument callable of candidate `name` on `case`: a forward returning its output, or a training step
    (train mode, backward of `grad`, then `zero_grad()`)."""
    module = built.get(name)
    if isinstance(module, NotAvailable):
        raise module
    if name == "ort-fused":
        if case.member != "bert":
            raise NotAvailable("ONNX Runtime's fused node is BERT's: it fuses no other member")
        return _ort(built["state"], built["config"].layer_norm_eps, ids, types)
    given = arguments(built, ids, types)
    if name == "hf-compile":
        torch._dynamo.reset()  # every case compiles afresh, with static shapes
        module = torch.compile(module, dynamic=False)
    module.train(case.mode == "fwdbwd")

    def step() -> None:
        module(**given).backward(grad)
        module.zero_grad(set_to_none=True)
    fn = torch.no_grad()(lambda: module(**given)) if case.mode == "fwd" else step
    return _logging_fallbacks(fn) if name.startswith("bertembed-fused") else fn


class _Fallbacks(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if "instead of the fused kernel" in record.getMessage():
            raise NotAvailable(f"the layer fell back to the reference: {record.getMessage()}")


def _logging_fallbacks(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn`, whose first call raises NotAvailable where the layer logs a fallback to the reference (logged once a
    process: the first case of a reason stands for the later ones)."""
    logger = logging.getLogger("bertembed")
    handler, level = _Fallbacks(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        fn()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return fn


def _ort(state: dict[str, torch.Tensor], eps: float, ids: torch.Tensor, types: torch.Tensor) -> Callable[[], Any]:
    """ONNX Runtime's fused EmbedLayerNormalization, one node: int32 ids, the five tables as initializers."""
    try:
        import numpy as np
        import onnxruntime as ort

        from bertembed.onnx_export import fused_graph

        model = fused_graph({k: v.float().numpy() for k, v in state.items()}, eps, int32_inputs=True, opset=17)
    except ImportError as err:
        raise NotAvailable(f'onnx/onnxruntime not installed ({err}); pip install -e ".[bench]"') from err
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = torch.get_num_threads(), 1
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feed = {"input_ids": ids.numpy().astype(np.int32), "token_type_ids": types.numpy().astype(np.int32)}
    return lambda: session.run(["embeddings"], feed)[0]
