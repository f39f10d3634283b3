"""A whole transformers model as ONNX, its embedding subgraph (Gather, Add, LayerNormalization, which ONNX Runtime
leaves unfused) optionally replaced by ONNX Runtime's fused EmbedLayerNormalization; docs/onnx.md, "Whole models".
Dimension letters: B batch, L length, H hidden.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from bertembed.atomic import check_output
from bertembed.family import layout
from bertembed.onnx_export import NOT_FUSED_FIX, check_opset, refuse_unfusable, require_onnx, torch_export, write_model

if TYPE_CHECKING:
    import onnx

    from bertembed.config import EmbeddingConfig

OUTPUT = "last_hidden_state"


def export_whole(model: str | Path | None, path: str | Path, *, fused: bool = False, opset: int = 18) -> Path:
    """Export the transformers model of checkpoint `model` (hub id, local folder; None: the bundled default) to
    `path`, atomically; returns the path. Inputs as optimum's (int64 [B, L] `input_ids`, `attention_mask`, and
    `token_type_ids` where the member takes them), output `last_hidden_state` [B, L, H] float32, B and L dynamic;
    `fused`: `fuse_embeddings`."""
    target, opset = check_output(path), check_opset(opset)
    hf, config = load_model(model)
    if fused:  # (refused before the export's seconds are spent)
        refuse_unfusable(config)
    graph = export_model(hf, config, opset)
    return write_model(fuse_embeddings(graph, config) if fused else graph, target)


def load_model(model: str | Path | None) -> tuple[Any, EmbeddingConfig]:
    """(transformers' base model of the checkpoint in float32 eval mode, the embedding layer's config)."""
    from bertembed.config import EmbeddingConfig
    from bertembed.sources import resolve

    source = resolve(model)
    if source.kind == "file":
        raise ValueError(f"{source.weights_file} is a single weights file, but exporting the whole model needs its "
                         f"config.json: give the checkpoint's folder or hub id")
    config = EmbeddingConfig.from_hf_config(source.file("config.json") or source.folder)
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"exporting the whole model builds it with transformers ({err}); pip install transformers, "
                          f"or export the embedding layer alone (no --whole)") from err

    where = source.name if source.kind == "hub" else str(source.folder)
    try:
        hf = transformers.AutoModel.from_pretrained(where, revision=source.revision,
                                                    local_files_only=source.local_files_only)
    except (ValueError, KeyError) as err:  # a member this transformers lacks (ModernBERT before 4.48, nomic_bert)
        raise ValueError(f"transformers {transformers.__version__} cannot build the {config.model_type} model of "
                         f"{where} ({str(err)[:200]}); export the embedding layer alone (no --whole)") from err
    return hf.float().eval(), config


def export_model(hf, config: EmbeddingConfig, opset: int = 18) -> onnx.ModelProto:
    """`torch_export` of transformers model `hf`, its `last_hidden_state` [B, L, H] the one output."""
    return torch_export(hf, lambda model, **inputs: model(**inputs).last_hidden_state, config, OUTPUT, opset,
                        f"the {config.model_type} model")


def fuse_embeddings(model: onnx.ModelProto, config: EmbeddingConfig) -> onnx.ModelProto:
    """A copy of `model` (from `export_model`) whose embedding LayerNormalization and the Gathers and Adds feeding it
    are one EmbedLayerNormalization; ValueError where the member or the graph cannot be fused."""
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
    """The layer's table name -> the graph's initializer of that table (the member's checkpoint key, `layout`). Only
    the tables: the exporter merges equal initializers, so a fresh model's LayerNorm weights share one name."""
    keys = {k: v for k, v in layout(config.model_type).items() if k.endswith("embeddings.weight")}
    names = {}
    for ours, key in keys.items():
        found = [i.name for i in graph.initializer if i.name == key or i.name.endswith("." + key)]
        if len(found) == 1:  # (none: the member lacks it; several: ambiguous, so not taken)
            names[ours] = found[0]
    missing = [k for k in ("word_embeddings.weight", "position_embeddings.weight") if k not in names]
    if missing:
        raise ValueError(f"the exported {config.model_type} graph has no initializer for {missing} (looked for "
                         f"{[keys[k] for k in missing]}); cannot fuse its embeddings; {NOT_FUSED_FIX}")
    return names


def _embedding_subgraph(graph, tables: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    """(the embedding LayerNormalization: the first whose input is a sum reading the word table, found by its place
    in the graph; table name -> the Gather that reads it), checking that the sum is of those Gathers alone and that
    the norm normalises over the last axis with a scale and a bias."""
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
