"""The embedding layer, or a whole transformers model, as an ONNX graph: plain operators (torch's dynamo exporter),
optionally rewritten to ONNX Runtime's fused EmbedLayerNormalization (`fuse_embeddings`); docs/onnx.md. B batch,
L length."""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bertembed.atomic import check_output, write_atomic
from bertembed.family import MEMBERS, NAMES, layout

if TYPE_CHECKING:
    from collections.abc import Callable

    import onnx

    from bertembed.config import EmbeddingConfig
    from bertembed.embeddings import BertEmbeddings

MIN_OPSET = 17  # LayerNormalization entered the standard domain in opset 17
log = logging.getLogger(__name__)
TABLES = NAMES[:3]  # word, position, segment
NOT_FUSED_FIX = ("export it without fusing (fused=False, optimize=False; no --fused or --optimize): plain operators, "
                 "which ONNX Runtime runs for every member")


def input_names(config: EmbeddingConfig) -> tuple[str, ...]:
    """optimum's input names for `config`'s member: `token_type_ids` only where it takes segment ids."""
    segments = config.type_vocab_size > 0 and MEMBERS[config.model_type].token_types_input
    return ("input_ids", "attention_mask", "token_type_ids") if segments else ("input_ids", "attention_mask")


def unfusable(config: EmbeddingConfig, dtype: Any = "float32") -> str | None:
    """Why ONNX Runtime's EmbedLayerNormalization cannot compute `config`'s layer, or None where it can."""
    this = f"this {config.model_type} layer"
    return next((problem for refused, problem in (
        (config.position_embedding_type == "none", f"{this} has no position table (its positions enter in attention), "
         f"but the fused op always adds a position row"),
        (config.projection == "before_norm", f"{this} projects E={config.table_width} -> H={config.hidden_size} "
         f"before its LayerNorm, but the fused op normalises the sum of the rows itself"),
        (config.mask_output, f"{this} multiplies its output by the attention mask, which the fused op does not"),
        (str(dtype) not in ("torch.float32", "float32"), f"its tables are {dtype}, but ONNX Runtime's fused op runs "
         f"float32 on the CPU; convert with .float()")) if refused), None)


def refuse_unfusable(config: EmbeddingConfig, dtype: Any = "float32") -> None:
    """ValueError naming why ONNX Runtime's EmbedLayerNormalization cannot compute `config`'s layer."""
    if (problem := unfusable(config, dtype)) is not None:
        whole = " (a whole model: --whole --optimize leaves these embeddings unfused and fuses the rest)" * \
            config.norm_bias  # (ModernBERT's it refuses)
        raise ValueError(f"cannot write ONNX Runtime's fused EmbedLayerNormalization: {problem}; "
                         f"{NOT_FUSED_FIX}{whole}")


def export_onnx(layer: BertEmbeddings, path: str | Path, *, fused: bool = False, opset: int = 18) -> Path:
    """Write `layer` in eval mode as an ONNX model to `path`, atomically (`layer_graph`); returns the path."""
    target = check_output(path)  # (before the export's seconds are spent)
    return write_model(layer_graph(layer, fused=fused, opset=opset), target)


def layer_graph(layer: BertEmbeddings, *, fused: bool = False, opset: int = 18) -> onnx.ModelProto:
    """`layer` in eval mode as an ONNX graph: the export of a reference copy (the fused kernels refuse tracing), its
    embedding subgraph rewritten by `fuse_embeddings` where `fused`."""
    from bertembed.embeddings import BertEmbeddings

    if not isinstance(layer, BertEmbeddings):
        raise TypeError(f"export_onnx takes a bertembed.BertEmbeddings, got {type(layer).__name__}; for a whole "
                        f"transformers model use bertembed.onnx_export.export_whole")
    config = layer.config
    reference = copy.deepcopy(layer).cpu().eval()  # (the example ids, and ONNX's initializers, live on the CPU)
    reference.backend = "reference"

    def call(ref, attention_mask, **ids):  # (the mask only where the layer reads it: DeBERTa's)
        return ref(**ids, attention_mask=attention_mask if config.mask_output else None)

    return torch_export(reference, call, config, "embeddings", opset, f"this {config.model_type} layer", fused,
                        layer.tables()[0].dtype)


def export_whole(model: str | Path | None, path: str | Path, *, fused: bool = False, optimize: bool = False,
                 quantize: str | None = None, opset: int = 18) -> Path:
    """Export the transformers model of checkpoint `model` (hub id, folder; None: the bundled default) to `path`,
    atomically, with optimum's inputs and its `last_hidden_state` [B, L, H] float32; returns the path. `fused`:
    `fuse_embeddings`; `optimize`: that, then `optimize_graph`; `quantize="int8"`: `quantize_int8`."""
    target, opset = check_output(path), check_opset(opset)
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize={quantize!r}: the one quantization offered is 'int8' (ONNX Runtime's dynamic)")
    hf, config = load_model(model, fused, optimize)
    problem = None if fused or not optimize else unfusable(config)  # (--optimize: the op where it can compute)
    fuse = (fused or optimize) and problem is None
    if problem is not None:
        log.warning("no fused embeddings: %s; ONNX Runtime's optimizer fuses what it matches of the rest", problem)
    graph = export_model(hf, config, opset, fuse)
    if optimize:
        graph = optimize_graph(graph, hf.config.num_attention_heads, config.hidden_size, masks=fuse)
    return write_model(quantize_int8(graph, config.positions_from_padding) if quantize else graph, target)


def load_model(model: str | Path | None, fused: bool = False, optimize: bool = False) -> tuple[Any, EmbeddingConfig]:
    """(transformers' base model of the checkpoint, float32, eval, eager attention: SDPA exports with a NaN guard
    ONNX Runtime cannot fuse; the layer's config). `fused`, `optimize`: a layer the fused op, or a model ONNX
    Runtime's optimizer, cannot take is refused before the model is built."""
    from bertembed.config import EmbeddingConfig
    from bertembed.sources import network_errors, resolve

    source = resolve(model)
    if source.kind == "file":
        raise ValueError(f"{source.weights_file} is a single weights file, but exporting the whole model needs its "
                         f"config.json: give the checkpoint's folder or hub id")
    config = EmbeddingConfig.from_hf_config(source.file("config.json") or source.folder)
    if fused:
        refuse_unfusable(config)
    if optimize and not config.norm_bias:
        raise ValueError(f"ONNX Runtime's transformer optimizer cannot take the {config.model_type} model (it fails "
                         f"on LayerNorms without a bias, and has no fusion for its attention or GeGLU); export it "
                         f"without --optimize: ONNX Runtime's session fuses what it can as it loads the graph")
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"exporting the whole model builds it with transformers ({err}); pip install transformers, "
                          f"or export the embedding layer alone (no --whole)") from err

    from safetensors import SafetensorError

    where = source.name if source.kind == "hub" else str(source.folder)
    try:
        hf, info = transformers.AutoModel.from_pretrained(where, revision=source.revision, attn_implementation="eager",
                                                          local_files_only=source.local_files_only,
                                                          output_loading_info=True)
    except (ValueError, KeyError) as err:  # a member this transformers lacks (ModernBERT before 4.48, nomic_bert)
        raise ValueError(f"transformers {transformers.__version__} cannot build the {config.model_type} model of "
                         f"{where} ({str(err)[:200]}); export the embedding layer alone (no --whole)") from err
    except (OSError, SafetensorError, *network_errors()) as err:  # no weights it reads, a broken file, a failed request
        raise ValueError(f"transformers cannot load the model of {where} ({str(err)[:200]}); pass a whole "
                         f"checkpoint") from err
    # a folder of the embeddings alone (bertembed's save_pretrained, finetune-demo --save): the rest would be random
    prefix = f"{hf.base_model_prefix}."  # (transformers 4 names a head checkpoint's missing keys with it)
    if missing := [k for k in info["missing_keys"] if not k.removeprefix(prefix).startswith("pooler.")]:  # (unused)
        raise ValueError(f"{where} lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}, ...), which "
                         f"transformers would draw at random: it is not a whole model; export the embedding layer "
                         f"alone (no --whole)")
    return hf.float().eval(), config


def export_model(hf, config: EmbeddingConfig, opset: int = 18, fused: bool = False) -> onnx.ModelProto:
    """`torch_export` of transformers model `hf`, its `last_hidden_state` the one output."""
    return torch_export(hf, lambda model, **inputs: model(**inputs).last_hidden_state, config, "last_hidden_state",
                        opset, f"the {config.model_type} model", fused)


def check_opset(opset: Any) -> int:
    """`opset` as an int between 17 and the installed onnx's newest; ValueError otherwise (ImportError: no onnx)."""
    try:
        import onnx
    except ImportError as err:
        raise ImportError(f"ONNX export needs onnx and onnxscript ({err}); pip install 'bertembed[onnx]'") from err
    newest = onnx.defs.onnx_opset_version()
    if not isinstance(opset, int) or isinstance(opset, bool) or not MIN_OPSET <= opset <= newest:
        raise ValueError(f"opset={opset!r} must be an integer in [{MIN_OPSET}, {newest}] (LayerNormalization needs "
                         f"17; the installed onnx knows up to {newest}); optimum uses 18")
    return opset


def write_model(model: onnx.ModelProto, path: Path) -> Path:
    """Check `model` with onnx.checker and write it to `path` through a temporary file and a rename."""
    import onnx

    if (size := model.ByteSize()) >= 2**31:
        raise ValueError(f"the model is {size / 2**30:.1f} GiB, past the 2 GiB limit of a single ONNX file "
                         f"(protobuf); export a smaller model or convert it to float16 first")
    onnx.checker.check_model(model)
    return write_atomic(path, model.SerializeToString())


def torch_export(module, call: Callable, config: EmbeddingConfig, output: str, opset: int, what: str,
                 fused: bool = False, dtype: Any = "float32") -> onnx.ModelProto:
    """torch.onnx.export(dynamo=True) of `call(module, **inputs)`, inputs [B, L] named by `input_names(config)`, axes
    dynamic, one output; ValueError naming `what` where torch cannot. `fused`: then `fuse_embeddings`."""
    import torch

    opset = check_opset(opset)
    if fused:  # (refused before the export's seconds are spent)
        refuse_unfusable(config, dtype)

    class Exported(torch.nn.Module):  # (torch.export reads the input names off forward's signature)
        def __init__(self) -> None:
            super().__init__()
            self.model = module

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            given = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
            return call(self.model, input_ids=input_ids, attention_mask=attention_mask, **given)

    ids = torch.full((2, 8), ((config.pad_token_id or 0) + 1) % config.vocab_size)  # (a token, not padding)
    example = dict(zip(input_names(config), (ids, torch.ones_like(ids), torch.zeros_like(ids)), strict=False))
    dims = {0: torch.export.Dim("batch_size"), 1: torch.export.Dim("sequence_length")}
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
    return fuse_embeddings(program.model_proto, config) if fused else program.model_proto


def fuse_embeddings(model: onnx.ModelProto, config: EmbeddingConfig) -> onnx.ModelProto:
    """A copy of `model` whose embedding LayerNormalization and the Gathers and Adds feeding it are one
    EmbedLayerNormalization (docs/onnx.md, "Whole models"); ValueError where the member or the graph cannot be fused."""
    import onnx
    from onnx import helper
    from onnxscript.optimizer import remove_unused_nodes

    refuse_unfusable(config)
    fused = copy.deepcopy(model)
    graph = fused.graph
    norm, gathers = _embedding_subgraph(graph, config)
    casts = {role: helper.make_node("Cast", [gathers[role].input[1]], [f"embeddings_{role}_ids_i32"],
                                    to=onnx.TensorProto.INT32) for role in gathers}
    ids = {role: cast.output[0] for role, cast in casts.items()}
    tables = {role: gather.input[0] for role, gather in gathers.items()}
    word, position, segment = TABLES
    node = helper.make_node(
        "EmbedLayerNormalization", [ids[word], ids.get(segment, ""), tables[word], tables[position],
                                    tables.get(segment, ""), norm.input[1], norm.input[2], "", ids[position]],
        [norm.output[0], "embeddings_mask_index"], name="EmbedLayerNormalization", domain="com.microsoft",
        epsilon=next((a.f for a in norm.attribute if a.name == "epsilon"), 1e-5))
    at = list(graph.node).index(norm)
    nodes = [*graph.node[:at], *casts.values(), node, *graph.node[at + 1:]]
    del graph.node[:]
    graph.node.extend(nodes)
    _import_microsoft_domain(fused)
    remove_unused_nodes(fused)  # (in place: the Gathers and Adds the fused node replaced, their tables too)
    onnx.checker.check_model(fused)
    return fused


def _embedding_subgraph(graph, config: EmbeddingConfig) -> tuple[Any, dict[str, Any]]:
    """(the first LayerNormalization over a sum of Gathers of the tables alone; table name -> its Gather). A table is
    found by its name (the checkpoint key or the layer's own), not as the norm's weight (the exporter may share it)."""
    keys, producer = layout(config.model_type), {out: node for node in graph.node for out in node.output}

    def leaves(name: str) -> list:  # (the operands of the sum of Adds that gives `name`; None: a graph input)
        node = producer.get(name)
        return [leaf for i in node.input for leaf in leaves(i)] if node is not None and node.op_type == "Add" \
            else [node]

    def table(node) -> str | None:  # (the layer's table whose rows a Gather reads)
        if node is None or node.op_type != "Gather" or any(a.name == "axis" and a.i != 0 for a in node.attribute):
            return None
        return next((t for t in TABLES for name in (keys[t], t) if f".{node.input[0]}".endswith(f".{name}")), None)

    norms = [(n, {table(x): x for x in leaves(n.input[0])}) for n in graph.node if n.op_type == "LayerNormalization"]
    norm, gathers = next(((n, g) for n, g in norms if TABLES[0] in g), (None, {}))
    if norm is None or len(norm.input) < 3 or any(a.name == "axis" and a.i != -1 for a in norm.attribute):
        raise ValueError(f"found no LayerNormalization (with a bias and axis -1) over a sum of Gathers of the word "
                         f"table; cannot fuse this graph's embeddings; {NOT_FUSED_FIX}")
    if None in gathers or len(gathers) != len(leaves(norm.input[0])) or TABLES[1] not in gathers:
        raise ValueError(f"the embedding LayerNormalization's input is not a sum of Gathers of {list(TABLES)}; "
                         f"cannot fuse this graph's embeddings; {NOT_FUSED_FIX}")
    return norm, gathers


def optimize_graph(model: onnx.ModelProto, heads: int, hidden: int, masks: bool = True) -> onnx.ModelProto:
    """`model` (a whole encoder with eager attention) through ONNX Runtime's transformer optimizer, which fuses each
    layer's attention, SkipLayerNormalization and Gelu; `masks`: its attention masks first rewritten by
    `_padding_masks` (BERT's attention, the members whose embeddings the op computes)."""
    from onnxruntime.transformers.fusion_options import AttentionMaskFormat, FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    if masks:
        _padding_masks(model)
    options = FusionOptions("bert")
    options.attention_mask_format = AttentionMaskFormat.AttentionMask  # (the default counts ones: right padding only)
    # opt_level 0: the fusions alone (ONNX Runtime's own pass first would drop the mask's Expand they match)
    optimized = optimize_model(model, model_type="bert", num_heads=heads, hidden_size=hidden,
                               optimization_options=options, opt_level=0).model
    return _import_microsoft_domain(optimized)  # (where no fused embeddings imported it: DeBERTa)


def _import_microsoft_domain(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`, in place, importing ONNX Runtime's com.microsoft operators (opset 1) if it did not."""
    from onnx import helper

    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def _padding_masks(model: onnx.ModelProto) -> None:
    """In place: each additive mask in `Softmax(Add(Mul|Div(MatMul), mask))` becomes `Where(bool(1 - attention_mask[:,
    None, None, :]), lowest, 0)`, the same values in the one form ONNX Runtime's attention fusion matches."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnxscript.optimizer import remove_unused_nodes

    graph, mask = model.graph, "attention_mask_additive"
    producer = {out: node for node in graph.node for out in node.output}

    def scores(name: str) -> bool:  # (QK^T, scaled or not)
        node = producer.get(name)
        return node is not None and (node.op_type == "MatMul" or node.op_type in ("Mul", "Div") and any(
            getattr(producer.get(i), "op_type", None) == "MatMul" for i in node.input))

    for softmax in (n for n in graph.node if n.op_type == "Softmax"):
        add = producer.get(softmax.input[0])
        if add is not None and add.op_type == "Add" and [scores(i) for i in add.input].count(True) == 1:
            add.input[[scores(i) for i in add.input].index(False)] = mask
    constants = {"mask_axis_1": np.array([1]), "mask_axis_2": np.array([2]), "mask_ones": np.ones(4, np.int64),
                 "mask_one": np.array(1), "mask_lowest": np.finfo(np.float32).min, "mask_zero": np.float32(0)}
    nodes = [*(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))
               for name, value in constants.items()),  # (nodes: ONNX Runtime's optimizer moves initializers out)
             helper.make_node("Unsqueeze", ["attention_mask", "mask_axis_1"], ["mask_3d"]),
             helper.make_node("Unsqueeze", ["mask_3d", "mask_axis_2"], ["mask_4d"]),
             helper.make_node("Expand", ["mask_4d", "mask_ones"], ["mask_expanded"]),
             helper.make_node("Sub", ["mask_one", "mask_expanded"], ["mask_inverted"]),
             helper.make_node("Cast", ["mask_inverted"], ["mask_masked"], to=TensorProto.BOOL),
             helper.make_node("Where", ["mask_masked", "mask_lowest", "mask_zero"], [mask]), *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    remove_unused_nodes(model)


def quantize_int8(model: onnx.ModelProto, computed_positions: bool = False) -> onnx.ModelProto:
    """`model` with int8 weights, a scale per output channel (ONNX Runtime's `quantize_dynamic`), for the CPU; per
    channel keeps all-MiniLM-L6-v2's cosine to float32 at 0.993, against 0.962 per tensor (BENCHMARKS.md).
    `computed_positions` (RoBERTa's, counted from the padding): the fused EmbedLayerNormalization stays float32, since
    its int8 form (QEmbedLayerNormalization) has no position-ids input and would count positions from 0."""
    import tempfile

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # its advice to pre-process the graph, logged on the root logger itself: a filter there drops it, not others' logs
    root, quiet = logging.getLogger(), lambda record: record.levelno >= logging.ERROR
    root.addFilter(quiet)
    try:
        with tempfile.TemporaryDirectory() as folder:
            kept = [n.name for n in model.graph.node if n.op_type == "EmbedLayerNormalization" and computed_positions]
            quantize_dynamic(model, Path(folder) / "int8.onnx", weight_type=QuantType.QInt8, per_channel=True,
                             nodes_to_exclude=kept)
            return onnx.load(Path(folder) / "int8.onnx")
    finally:
        root.removeFilter(quiet)
