"""What `bertembed bench` runs: the cases, and the candidates around the same weights and ids (B, L, H)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bertembed.family import MEMBERS as FAMILY
from bertembed.family import transformers_layer

HIDDENS = (384, 768, 1024)  # MiniLM / bert-base / bert-large
SHAPES = ((1, 11), (32, 128), (8, 512), (64, 512))  # (B, L): one sentence .. a full batch
QUICK_HIDDENS, QUICK_SHAPES = (768,), ((1, 11), (32, 128))
MEMBERS = {name: m.bench for name, m in FAMILY.items() if m.bench is not None}  # measured beside BERT's forward
MODES = ("fwd", "fwdbwd")  # forward in eval mode under no_grad; a training step (train mode, dropout, backward)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CANDIDATES = ("hf-eager", "hf-compile", "ort-fused", "bertembed-reference", "bertembed-fused")
VOCAB = 30522
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")
# Largest |output - float32 reference| of the same layer (bfloat16: 4 ulps at 4-8; transformers' own is 0.058 off)
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.125, "float16": 2e-2}


@dataclass(frozen=True)
class Case:
    hidden: int
    batch: int
    length: int
    mode: str = "fwd"
    dtype: str = "float32"
    device: str = "cpu"
    member: str = "bert"

    @property
    def key(self) -> str:
        member = "" if self.member == "bert" else f"{self.member} "
        return f"{self.device} {member}H={self.hidden} B={self.batch} L={self.length} {self.mode} {self.dtype}"


def plan(quick: bool, hiddens=None, shapes=None, dtypes=None, device: str = "cpu") -> list[Case]:
    """float32 forward and training step over hiddens x shapes, each other dtype's forward, on `device` ("auto": CPU,
    and CUDA where seen); then, unless shapes were given, `MEMBERS`' forward at the first shape past a sentence."""
    devices = ("cpu",) + ("cuda",) * torch.cuda.is_available() if device == "auto" else (device,)
    members = () if shapes else MEMBERS
    hiddens, shapes = hiddens or (QUICK_HIDDENS if quick else HIDDENS), shapes or (QUICK_SHAPES if quick else SHAPES)
    dtypes = dtypes or (("float32",) if quick else ("float32", "bfloat16"))
    cases = [Case(h, b, n, mode, dtype, d) for d in devices for h in hiddens for dtype in dtypes
             for b, n in shapes for mode in MODES if mode == "fwd" or dtype == "float32"]
    longer = [shape for shape in shapes if shape[0] * shape[1] > 11][:1]
    return cases + [Case(h, b, n, "fwd", "float32", d, member) for member in members for d in devices
                    for h in hiddens for b, n in longer]


def runs(name: str, case: Case) -> bool:
    """Whether candidate `name` takes part in `case`: ONNX Runtime's fused node on BERT's CPU float32 forward only;
    torch.compile float32 only (a bfloat16 compile doubles the time); bertembed's CPU kernels take no float16."""
    if name == "ort-fused":
        return (case.member, case.device, case.mode, case.dtype) == ("bert", "cpu", "fwd", "float32")
    if name == "bertembed-fused":
        return case.device != "cpu" or case.dtype != "float16"
    return name != "hf-compile" or case.dtype == "float32"


def prepare(case: Case, vocab: int = VOCAB, seed: int = 0) -> tuple[Any, Callable[[str], Callable[[], Any]]]:
    """The float32 reference's output [B, L, H] of `case`'s forward (None for a training step), and a function that
    makes a candidate's no-argument call, a forward or a training step, on the same weights and random ids (an
    ImportError where the candidate's package is missing)."""
    from bertembed import BertEmbeddings, EmbeddingConfig

    torch.manual_seed(seed)
    config = EmbeddingConfig.from_hf_config({"model_type": case.member, "vocab_size": vocab, "dim": case.hidden,
                                             "hidden_size": case.hidden, **MEMBERS.get(case.member, {})})
    reference = BertEmbeddings(config)
    with torch.no_grad():  # gamma and beta off the identity, so a missing scale or shift shows
        for param in reference.LayerNorm.parameters():
            param.add_(0.1 * torch.randn(case.hidden))
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    gen, shape = torch.Generator().manual_seed(0), (case.batch, case.length)
    ids, types = (torch.randint(0, high, shape, generator=gen).to(case.device) for high in (vocab, 2))
    grad = torch.randn(*shape, case.hidden, generator=gen).to(case.device, DTYPES[case.dtype])
    given = {"input_ids": ids, "token_type_ids": types} if config.type_vocab_size > 1 else {"input_ids": ids}
    with torch.no_grad():
        expected = reference.to(case.device).eval()(**given).double() if case.mode == "fwd" else None

    def make(name: str) -> Callable[[], Any]:
        if name == "ort-fused":
            return _ort(reference, ids, types)
        if name.startswith("hf-"):
            # no special ids: ModernBERT's lie past the vocabulary here, and transformers would warn of each
            module = transformers_layer(config, state, **dict.fromkeys(SPECIAL_IDS))
        else:  # (a fused backend that is not installed: an ImportError naming it)
            module = BertEmbeddings(config, backend="reference" if name == "bertembed-reference" else
                                    "cpu" if case.device == "cpu" else "triton")
            module.load_state_dict(state)
        module.to(case.device, DTYPES[case.dtype]).train(case.mode == "fwdbwd")
        if name == "hf-compile":
            torch._dynamo.reset()  # every case compiles afresh, with static shapes
            module = torch.compile(module, dynamic=False)
        if case.mode == "fwd":
            return torch.no_grad()(lambda: module(**given))

        def step() -> None:
            module(**given).backward(grad)
            module.zero_grad(set_to_none=True)
        return step
    return expected, make


def _ort(layer, ids: torch.Tensor, types: torch.Tensor) -> Callable[[], Any]:
    """ONNX Runtime running `bertembed export onnx --fused`'s graph of `layer` (EmbedLayerNormalization)."""
    try:
        import onnxruntime as ort

        from bertembed.onnx_export import layer_graph

        model = layer_graph(layer, fused=True, opset=18)  # (torch exports 18: no conversion)
    except ImportError as err:
        raise ImportError(f'{err}: pip install -e ".[bench]"') from err
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = torch.get_num_threads(), 1
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    given = {"input_ids": ids, "token_type_ids": types, "attention_mask": torch.ones_like(ids)}
    feed = {i.name: given[i.name].long().numpy() for i in session.get_inputs()}
    return lambda: session.run(["embeddings"], feed)[0]
