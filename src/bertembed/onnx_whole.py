"""A whole transformers model as ONNX, its embedding subgraph optionally fused (docs/onnx.md, "Whole models")."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from bertembed.atomic import check_output
from bertembed.onnx_export import check_opset, fuse_embeddings, torch_export, write_model  # noqa: F401

if TYPE_CHECKING:
    import onnx

    from bertembed.config import EmbeddingConfig

OUTPUT = "last_hidden_state"


def export_whole(model: str | Path | None, path: str | Path, *, fused: bool = False, opset: int = 18) -> Path:
    """Export the transformers model of checkpoint `model` (hub id, local folder; None: the bundled default) to
    `path`, atomically, with optimum's inputs and its `last_hidden_state` [batch, length, H] float32; returns the
    path. `fused`: `fuse_embeddings`."""
    target, opset = check_output(path), check_opset(opset)
    return write_model(export_model(*load_model(model), opset, fused), target)


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


def export_model(hf, config: EmbeddingConfig, opset: int = 18, fused: bool = False) -> onnx.ModelProto:
    """`torch_export` of transformers model `hf`, its `last_hidden_state` the one output."""
    return torch_export(hf, lambda model, **inputs: model(**inputs).last_hidden_state, config, OUTPUT, opset,
                        f"the {config.model_type} model", fused)
