"""The embedding layer as an ONNX graph: plain operators (torch's dynamo exporter), optionally rewritten to ONNX
Runtime's fused EmbedLayerNormalization (`fuse_embeddings`, whole models' too); docs/onnx.md. B batch, L length.
"""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bertembed.family import MEMBERS, layout

if TYPE_CHECKING:
    from collections.abc import Callable

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
    """ValueError naming why ONNX Runtime's EmbedLayerNormalization cannot compute `config`'s layer."""
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
    """Write `layer` in eval mode as an ONNX model to `path`, atomically (`layer_graph`); returns the path."""
    from bertembed.atomic import check_output

    target = check_output(path)
    return write_model(layer_graph(layer, fused=fused, opset=opset), target)


def layer_graph(layer: BertEmbeddings, *, fused: bool = False, opset: int = 18) -> onnx.ModelProto:
    """`layer` in eval mode as an ONNX graph: the export of a reference copy (the fused kernels refuse tracing), its
    embedding subgraph rewritten by `fuse_embeddings` where `fused`."""
    from bertembed.embeddings import BertEmbeddings

    if not isinstance(layer, BertEmbeddings):
        raise TypeError(f"export_onnx takes a bertembed.BertEmbeddings, got {type(layer).__name__}; for a whole "
                        f"transformers model use bertembed.onnx_whole.export_whole")
    opset, config = check_opset(opset), layer.config
    if fused:  # (refused before the export's seconds are spent)
        refuse_unfusable(config, layer.tables()[0].dtype)
    reference = copy.deepcopy(layer).cpu().eval()  # (the example ids, and ONNX's initializers, live on the CPU)
    reference.backend = "reference"

    def call(ref, attention_mask, **ids):  # (the mask only where the layer reads it: DeBERTa's)
        return ref(**ids, attention_mask=attention_mask if config.mask_output else None)

    model = torch_export(reference, call, config, OUTPUT, opset, f"this {config.model_type} layer")
    return fuse_embeddings(model, config) if fused else model


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
    both axes dynamic, one output `output`; ValueError naming `what` where torch cannot export it."""
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
    except ImportError:  # (a package the exporter needs, onnxscript: named as it is, not as a limit of torch's)
        raise
    except Exception as err:  # (the exporter raises many types; each is a limit of torch's, not a bug here)
        reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise ValueError(f"torch {torch.__version__}'s ONNX exporter cannot export {what} ({type(err).__name__}: "
                         f"{reason}); a newer torch may, else report it with the checkpoint's config.json") from err
    finally:
        registration.setLevel(level)
    return program.model_proto


def require_onnx():
    """The onnx package, or an ImportError that says how to install it."""
    try:
        import onnx
    except ImportError as err:
        raise ImportError(f"ONNX export needs onnx and onnxscript ({err}); pip install 'bertembed[onnx]'") from err
    return onnx


def fuse_embeddings(model: onnx.ModelProto, config: EmbeddingConfig) -> onnx.ModelProto:
    """A copy of `model` whose embedding LayerNormalization and the Gathers and Adds feeding it are one
    EmbedLayerNormalization (docs/onnx.md, "Whole models"); ValueError where the member or the graph cannot be fused."""
    onnx = require_onnx()
    from onnx import helper
    from onnxscript.optimizer import remove_unused_nodes

    refuse_unfusable(config)
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    graph = fused.graph
    tables = _table_names(graph, config)
    norm, gathers = _embedding_subgraph(graph, tables)
    casts = {role: helper.make_node("Cast", [gathers[role].input[1]], [f"embeddings_{role}_ids_i32"],
                                    to=onnx.TensorProto.INT32) for role in gathers}
    eps = next((a.f for a in norm.attribute if a.name == "epsilon"), 1e-5)
    segment = "token_type_embeddings.weight" in gathers
    node = helper.make_node(
        "EmbedLayerNormalization",
        [casts["word_embeddings.weight"].output[0], casts["token_type_embeddings.weight"].output[0] if segment
         else "", tables["word_embeddings.weight"], tables["position_embeddings.weight"],
         tables["token_type_embeddings.weight"] if segment else "", norm.input[1], norm.input[2],
         "", casts["position_embeddings.weight"].output[0]],
        [norm.output[0], "embeddings_mask_index"], name="EmbedLayerNormalization", domain="com.microsoft",
        epsilon=eps)
    at = list(graph.node).index(norm)
    nodes = [*graph.node[:at], *casts.values(), node, *graph.node[at + 1:]]
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == "com.microsoft" for o in fused.opset_import):
        fused.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    remove_unused_nodes(fused)  # (in place: the Gathers and Adds the fused node replaced, their tables too)
    onnx.checker.check_model(fused)
    return fused


def _table_names(graph, config: EmbeddingConfig) -> dict[str, str]:
    """The layer's table name -> the graph's initializer of it: named as the member's checkpoint key (a whole model's
    graph) or as the layer's own."""
    keys = {k: v for k, v in layout(config.model_type).items() if k.endswith("embeddings.weight")}
    names = {}
    for ours, key in keys.items():
        for name in (key, ours):
            found = [i.name for i in graph.initializer if i.name == name or i.name.endswith("." + name)]
            if found:
                break
        if len(found) == 1:  # (none: the member lacks it; several: ambiguous, so not taken)
            names[ours] = found[0]
    missing = [k for k in ("word_embeddings.weight", "position_embeddings.weight") if k not in names]
    if missing:
        raise ValueError(f"the exported {config.model_type} graph has no initializer for {missing} (looked for "
                         f"{[keys[k] for k in missing]}); cannot fuse its embeddings; {NOT_FUSED_FIX}")
    return names


def _embedding_subgraph(graph, tables: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    """(the first LayerNormalization over a sum that reads the word table, table name -> the Gather that reads it),
    checking that the sum is of those Gathers alone and that the norm has a bias and axis -1."""
    producer = {out: node for node in graph.node for out in node.output}

    def leaves(name: str) -> list:  # (the operands of the sum of Adds that gives `name`; None: a graph input)
        node = producer.get(name)
        return [leaf for i in node.input for leaf in leaves(i)] if node is not None and node.op_type == "Add" \
            else [node]

    word = tables["word_embeddings.weight"]
    sums = [(n, leaves(n.input[0])) for n in graph.node if n.op_type == "LayerNormalization"]  # (in graph order)
    reads_word = [any(x is not None and x.op_type == "Gather" and x.input[0] == word for x in s) for _, s in sums]
    norm, summed = sums[reads_word.index(True)] if any(reads_word) else (None, [])
    if norm is None or len(norm.input) < 3 or any(a.name == "axis" and a.i != -1 for a in norm.attribute):
        raise ValueError(f"found no LayerNormalization (with a bias and axis -1) over a sum of Gathers of {word}; "
                         f"cannot fuse this graph's embeddings; {NOT_FUSED_FIX}")
    by_table = {n.input[0]: n for n in summed if n is not None and n.op_type == "Gather" and  # (rows: axis 0)
                not any(a.name == "axis" and a.i != 0 for a in n.attribute)}
    roles = {ours: by_table.get(name) for ours, name in tables.items()}
    if len(by_table) != len(summed) or None in roles.values() or len(roles) != len(summed):
        raise ValueError(f"the embedding LayerNormalization's input is not a sum of Gathers of {sorted(tables)}; "
                         f"cannot fuse this graph's embeddings; {NOT_FUSED_FIX}")
    return norm, roles
