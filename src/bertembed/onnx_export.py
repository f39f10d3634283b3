"""The embedding layer as an ONNX graph: plain operators (torch's dynamo exporter) or ONNX Runtime's fused
EmbedLayerNormalization (`fused_graph`); docs/onnx.md says what each graph holds. Whole models: `bertembed.onnx_whole`.
Dimension letters: B batch, L length, E table width.
"""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bertembed.family import MEMBERS

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    import onnx

    from bertembed.config import EmbeddingConfig
    from bertembed.embeddings import BertEmbeddings

OUTPUT = "embeddings"
AXES = {0: "batch_size", 1: "sequence_length"}
MIN_OPSET = 17  # LayerNormalization entered the standard domain in opset 17
NOT_FUSED_FIX = ("export it without fusing (fused=False; no --fused): plain operators, which ONNX Runtime runs for "
                 "every member")


def input_names(config: EmbeddingConfig) -> tuple[str, ...]:
    """optimum's input names for `config`'s member: `token_type_ids` only where it takes segment ids."""
    segments = config.type_vocab_size > 0 and MEMBERS[config.model_type].token_types_input
    return ("input_ids", "attention_mask", "token_type_ids") if segments else ("input_ids", "attention_mask")


def refuse_unfusable(config: EmbeddingConfig, dtype: Any = "float32") -> None:
    """ValueError naming why ONNX Runtime's EmbedLayerNormalization (float32 word + position + segment rows, then
    LayerNorm) cannot compute `config`'s layer."""
    member = config.model_type
    if config.position_embedding_type == "none":
        problem = f"this {member} layer has no position table (its positions enter in attention), but the fused " \
                  f"op always adds a position row"
    elif config.projection == "before_norm":
        problem = f"this {member} layer projects E={config.table_width} -> H={config.hidden_size} before its " \
                  f"LayerNorm, but the fused op normalises the sum of the rows itself"
    elif config.mask_output:
        problem = f"this {member} layer multiplies its output by the attention mask, which the fused op does not"
    elif str(dtype) not in ("torch.float32", "float32"):
        problem = f"its tables are {dtype}, but ONNX Runtime's fused op runs float32 on the CPU; convert with .float()"
    else:
        return
    raise ValueError(f"cannot write ONNX Runtime's fused EmbedLayerNormalization: {problem}; {NOT_FUSED_FIX}")


def export_onnx(layer: BertEmbeddings, path: str | Path, *, fused: bool = False, opset: int = 18) -> Path:
    """Write `layer` in eval mode as an ONNX model to `path`, atomically; returns the path. `fused=False`: plain
    operators, torch's export of a reference copy (the fused kernels refuse tracing). `fused=True`: `fused_graph` of
    the layer's tables; ValueError where the op cannot compute it. `attention_mask` is read by DeBERTa's only."""
    from bertembed.atomic import check_output
    from bertembed.embeddings import BertEmbeddings

    if not isinstance(layer, BertEmbeddings):
        raise TypeError(f"export_onnx takes a bertembed.BertEmbeddings, got {type(layer).__name__}; for a whole "
                        f"transformers model use bertembed.onnx_whole.export_whole")
    target, opset, config = check_output(path), check_opset(opset), layer.config
    if fused:
        word, segment, position, weight, bias = layer.tables()
        refuse_unfusable(config, word.dtype)
        tables = {"word_embeddings.weight": word, "position_embeddings.weight": position,
                  "token_type_embeddings.weight": segment, "LayerNorm.weight": weight,
                  "LayerNorm.bias": 0 * weight if bias is None else bias}  # (the graph's initializers, in this order)
        model = fused_graph({k: v.detach().float().cpu().numpy() for k, v in tables.items() if v is not None},
                            config.layer_norm_eps, inputs=input_names(config),
                            pad=config.pad_token_id if config.positions_from_padding else None, opset=opset)
    else:
        reference = copy.deepcopy(layer).cpu().eval()  # (the example ids, and ONNX's initializers, live on the CPU)
        reference.backend = "reference"

        def call(ref, attention_mask, **ids):  # (the mask only where the layer reads it: DeBERTa's)
            return ref(**ids, attention_mask=attention_mask if config.mask_output else None)

        model = torch_export(reference, call, config, OUTPUT, opset, f"this {config.model_type} layer")
    return write_model(model, target)


def check_opset(opset: Any) -> int:
    """`opset` as an int between 17 and the installed onnx's newest; ValueError otherwise."""
    onnx = require_onnx()
    newest = onnx.defs.onnx_opset_version()
    if not isinstance(opset, int) or isinstance(opset, bool) or not MIN_OPSET <= opset <= newest:
        raise ValueError(f"opset={opset!r} must be an integer in [{MIN_OPSET}, {newest}] (LayerNormalization needs "
                         f"17; the installed onnx knows up to {newest}); optimum uses 18")
    return opset


def write_model(model: onnx.ModelProto, path: Path) -> Path:
    """Check `model` with onnx.checker and write it to `path` through a temporary file and a rename."""
    from bertembed.atomic import write_atomic

    if (size := model.ByteSize()) >= 2**31:
        raise ValueError(f"the model is {size / 2**30:.1f} GiB, past the 2 GiB limit of a single ONNX file "
                         f"(protobuf); export a smaller model or convert it to float16 first")
    require_onnx().checker.check_model(model)
    return write_atomic(path, model.SerializeToString())


def torch_export(module, call: Callable, config: EmbeddingConfig, output: str, opset: int,
                 what: str) -> onnx.ModelProto:
    """torch.onnx.export(dynamo=True) of `call(module, **inputs)`, the inputs [B, L] named by `input_names(config)`,
    both axes dynamic, one output `output`; ValueError naming `what` and the reason where torch cannot export it."""
    import torch

    class Exported(torch.nn.Module):  # (torch.export reads the input names off forward's signature)
        def __init__(self) -> None:
            super().__init__()
            self.model = module

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            given = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
            return call(self.model, input_ids=input_ids, attention_mask=attention_mask, **given)

    ids = torch.full((2, 8), (config.pad_token_id + 1) % config.vocab_size)  # (a token, not padding)
    example = {name: (ids if name == "input_ids" else torch.ones_like(ids) if name == "attention_mask" else
                      torch.zeros_like(ids)) for name in input_names(config)}
    dims = {i: torch.export.Dim(name) for i, name in AXES.items()}
    # the exporter's notes on every export, no fault of the model's (torchvision missing, axis names, deprecations)
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"# The axis name")
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning)
            program = torch.onnx.export(Exported().eval(), (), kwargs=example, dynamo=True, opset_version=opset,
                                        input_names=list(example), output_names=[output],
                                        dynamic_shapes={name: dims for name in example}, verbose=False)
    except Exception as err:  # (the exporter raises many types; each is a limit of torch's, not a bug here)
        reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise ValueError(f"torch {torch.__version__}'s ONNX exporter cannot export {what} ({type(err).__name__}: "
                         f"{reason}); a newer torch may, else report it with the checkpoint's config.json") from err
    finally:
        registration.setLevel(level)
    return program.model_proto


def fused_graph(tables: dict[str, np.ndarray], eps: float, *, inputs: tuple[str, ...] = ("input_ids", "token_type_ids"),
                pad: int | None = None, int32_inputs: bool = False, opset: int = 18) -> onnx.ModelProto:
    """One EmbedLayerNormalization node over float32 `tables` (state-dict names; the segment table optional), with
    `eps`, giving `embeddings` [B, L, E]. `inputs`: the [B, L] id inputs, int64 cast to int32 inside (int32 with
    `int32_inputs`); without `token_type_ids`, segment 0 for every token. `pad`: positions counted from the padding
    id, as RoBERTa's; None: 0, 1, 2, ... An `attention_mask` input is taken, as optimum's graphs take it, and only
    checked."""
    require_onnx()
    from onnx import TensorProto, checker, helper, numpy_helper

    ids = {name: name if int32_inputs else f"{name}_i32" for name in inputs}
    nodes = [] if int32_inputs else [helper.make_node("Cast", [n], [ids[n]], to=TensorProto.INT32) for n in inputs]
    segment = "token_type_embeddings.weight" in tables
    if segment and "token_type_ids" not in ids:
        ids["token_type_ids"] = "token_type_ids_i32"
        nodes.append(helper.make_node("Shape", [ids["input_ids"]], ["ids_shape"]))
        nodes.append(helper.make_node("ConstantOfShape", ["ids_shape"], [ids["token_type_ids"]],
                                      value=helper.make_tensor("zero", TensorProto.INT32, [1], [0])))
    if pad is not None:  # cumsum(ids != pad) * (ids != pad) + pad
        nodes += [helper.make_node("Constant", [], [k], value=helper.make_tensor(k, TensorProto.INT32, [], [v]))
                  for k, v in (("pad_id", pad), ("length_axis", 1))]
        nodes += [helper.make_node("Equal", [ids["input_ids"], "pad_id"], ["is_pad"]),
                  helper.make_node("Not", ["is_pad"], ["is_token"]),
                  helper.make_node("Cast", ["is_token"], ["token_mask"], to=TensorProto.INT32),
                  helper.make_node("CumSum", ["token_mask", "length_axis"], ["token_count"]),
                  helper.make_node("Mul", ["token_count", "token_mask"], ["token_positions"]),
                  helper.make_node("Add", ["token_positions", "pad_id"], ["position_ids"])]
    operands = [ids["input_ids"], ids["token_type_ids"] if segment else "", "word_embeddings.weight",
                "position_embeddings.weight", "token_type_embeddings.weight" if segment else "", "LayerNorm.weight",
                "LayerNorm.bias", ids.get("attention_mask", ""), "position_ids" if pad is not None else ""]
    nodes.append(helper.make_node("EmbedLayerNormalization", operands, [OUTPUT, "mask_index"],
                                  domain="com.microsoft", epsilon=float(eps)))
    width = tables["word_embeddings.weight"].shape[1]
    id_type = TensorProto.INT32 if int32_inputs else TensorProto.INT64
    graph = helper.make_graph(
        nodes, "bert_embeddings", [helper.make_tensor_value_info(n, id_type, list(AXES.values())) for n in inputs],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [*AXES.values(), width])],
        [numpy_helper.from_array(v, k) for k, v in tables.items() if k in operands])
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    # the oldest IR the opsets allow (9 for opset 18): newer onnx writes its newest, which older ORT cannot read
    model = helper.make_model(graph, opset_imports=opsets,
                              ir_version=helper.find_min_ir_version_for(opsets, ignore_unknown=True))
    checker.check_model(model)
    return model


def require_onnx():
    """The onnx package, or an ImportError that says how to install it."""
    try:
        import onnx
    except ImportError as err:
        raise ImportError(f"ONNX export needs onnx and onnxscript ({err}); pip install 'bertembed[onnx]'") from err
    return onnx
