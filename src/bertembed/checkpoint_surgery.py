"""Surgery on whole checkpoints (docs/surgery.md): every tensor of SRC read, the tables changed by the layer's own
surgery, and a new checkpoint written whole to DST, which must not exist yet. SRC is only read."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bertembed.atomic import atomic_folder
from bertembed.checkpoint import WEIGHT_FILES, embedding_keys, weight_files
from bertembed.config import read_json
from bertembed.embeddings import BertEmbeddings
from bertembed.sources import HubRequestFailed, Source, network_errors, present, resolve
from bertembed.tensor_files import open_weights, unshared

# copies of the model in other formats would keep the old tables: left out of DST (and not downloaded)
STALE = ("*.h5", "*.msgpack", "*.ot", "*.onnx", "*.onnx_data", "*.tflite", "*.mlmodel", "*.mlpackage", "onnx",
         "openvino", "openvino_*", "coreml")
SHARDS = ("model*.safetensors*", "pytorch_model*.bin*")  # the weights in the format not read, stale too (not the hub's)


@dataclass
class WholeCheckpoint:
    """Every tensor of a checkpoint and the files around them, with its embedding layer loaded for the surgery."""

    folder: Path  # SRC's folder (for a hub id, its snapshot in the cache)
    config: dict[str, Any]  # config.json as written, to be updated and written again
    tensors: dict[str, torch.Tensor]  # every tensor, under the checkpoint's own keys
    keys: dict[str, str]  # the layer's state-dict name -> the checkpoint key of each embedding tensor it has
    weight_files: set[str]  # SRC's weight files and index, replaced by DST's own
    layer: BertEmbeddings
    target: Path  # DST, checked
    files: dict[str, str] = field(default_factory=dict)  # text files of DST that replace SRC's (config, tokenizer)
    dropped: set[str] = field(default_factory=set)  # SRC entries DST must not carry (other formats' stale copies)

    def json_file(self, name: str) -> dict[str, Any] | None:
        """One of SRC's JSON files; None where SRC has none."""
        path = self.folder / name
        return read_json(path) if path.is_file() else None

    def set_json(self, name: str, data: dict[str, Any]) -> None:
        self.files[name] = json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def read_whole(src: str | Path | None, dst: str | Path) -> WholeCheckpoint:
    """DST checked first (ValueError if it exists or lies inside SRC, PermissionError if it cannot be made), then
    every tensor of checkpoint `src` (a folder or hub id, safetensors or .bin) and its layer."""
    source = resolve(src)
    target = Path(os.path.abspath(Path(dst).expanduser()))
    if target.exists() or target.is_symlink():
        raise ValueError(f"{target} already exists; surgery writes a new checkpoint and never overwrites one: pass a "
                         f"new folder name, or delete that folder first")
    if target.resolve().is_relative_to(source.folder.resolve()):  # (through a link too)
        raise ValueError(f"{target} lies inside the source checkpoint {source.folder}; write the new checkpoint "
                         f"beside it")
    parent = next(p for p in target.parents if p.exists())
    if not parent.is_dir():
        raise NotADirectoryError(f"cannot write {target}: {parent} is a file, not a folder; pass a path in a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {target}: {parent} is not writable; pass a folder you can write to")
    if source.kind == "file":
        raise ValueError(f"{source.weights_file} is a single weights file; surgery rewrites a whole checkpoint and "
                         f"needs its folder (config.json, tokenizer files): pass the folder")
    folder = source.folder
    if source.kind == "hub":  # the whole snapshot, fetched into the cache
        from huggingface_hub import snapshot_download

        patterns = [*STALE, *(f"{name}/*" for name in STALE if "." not in name)]
        try:
            folder = Path(snapshot_download(source.name, revision=source.revision,
                                            local_files_only=source.local_files_only, ignore_patterns=patterns))
        except network_errors() as err:
            raise HubRequestFailed(f"cannot fetch hub model {source.name!r}: {str(err)[:200]}; try again, or pass a "
                                   f"local folder") from err
    for entry in folder.iterdir():  # (each is read or copied: a link to nothing is refused, never skipped)
        for path in [entry, *(entry.rglob("*") if entry.is_dir() and not entry.name.startswith(".") else ())]:
            if not path.exists():
                present(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; surgery needs the checkpoint's own config")
    layer = BertEmbeddings.from_pretrained(folder)
    files, _ = weight_files(Source("folder", str(folder), folder))  # (every shard; a hub id's from its snapshot)
    tensors = {}
    for path in files:
        handle = open_weights(path, "pt")
        tensors |= {key: handle.get_tensor(key) for key in handle.keys()}
    tensors = unshared(tensors)  # (a tied head in a .bin: written as two tensors, both names kept)
    wanted = embedding_keys(list(tensors), layer.config.model_type, files[0])
    keys = {name: key for key, name in wanted.items() if key in tensors}
    names = {p.name for p in files} | {n for n in WEIGHT_FILES if (folder / n).is_file()}
    stale = {p.name for p in folder.iterdir() if p.name not in names and any(
        fnmatch.fnmatch(p.name, pattern) for pattern in (*STALE, *SHARDS))}
    return WholeCheckpoint(folder, read_json(config_path), tensors, keys, names, layer, target, dropped=stale)


def write_whole(whole: WholeCheckpoint) -> dict[str, Any]:
    """Write DST: SRC's other files copied, the tensors as safetensors (in shards of at most 5 GB with an index above
    that), DST's own text files; the report's entries."""
    # (shards as huggingface_hub's save_torch_state_dict writes them: that one imports torch.distributed, a second or
    # more, to unshare tensors, which `read_whole` did)
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.torch import save_file

    skip = whole.weight_files | set(whole.files) | whole.dropped
    split = split_state_dict_into_shards_factory(whole.tensors, get_storage_size=lambda t: t.nbytes,
                                                 max_shard_size="5GB", filename_pattern="model{suffix}.safetensors")
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        whole.files["model.safetensors.index.json"] = json.dumps(index, indent=2) + "\n"
    with atomic_folder(whole.target, keep_others=False) as staging:
        for entry in whole.folder.iterdir():  # (links, as the hub cache's, copied as the files they point to)
            if entry.name in skip or entry.is_dir() and entry.name.startswith("."):
                continue  # (a hidden folder, .git or .cache: a clone's or the hub's bookkeeping, not the model's)
            copy = shutil.copytree if entry.is_dir() else shutil.copy2
            copy(entry, staging / entry.name)
        for name, keys in split.filename_to_tensors.items():
            save_file({k: whole.tensors[k].contiguous() for k in keys}, str(staging / name), metadata={"format": "pt"})
        for name, text in whole.files.items():
            (staging / name).write_text(text, encoding="utf-8")
    return {"destination": str(whole.target), "dropped_files": sorted(whole.dropped)}


def extend_positions_checkpoint(src: str | Path | None, dst: str | Path, n: int, method: str = "copy") -> dict:
    """Write checkpoint `src` to `dst` with a position table for `n` positions (`BertEmbeddings.extend_positions`);
    `max_position_embeddings`, stored id buffers and the tokenizer's `model_max_length` follow. Returns what changed."""
    whole = read_whole(src, dst)
    if whole.config.get("sinusoidal_pos_embds") and method != "sinusoidal":  # (DistilBERT's; saved, so read as learned)
        raise ValueError(f"this checkpoint's positions are the fixed sin/cos table (sinusoidal_pos_embds), which "
                         f"method={method!r} would not continue: use method 'sinusoidal'")
    layer = whole.layer
    before = layer.config.max_position_embeddings
    rows = layer.extend_positions(n, method=method).config.max_position_embeddings
    key = whole.keys["position_embeddings.weight"]
    whole.tensors[key] = layer.position_embeddings.weight.detach().contiguous()
    prefix = key.removesuffix("position_embeddings.weight")
    for buffer in ("position_ids", "token_type_ids"):  # id buffers some checkpoints store ([1, P] int64)
        if (stored := whole.tensors.get(prefix + buffer)) is not None:
            whole.tensors[prefix + buffer] = getattr(layer, buffer).to(stored.dtype)
    config = dict(whole.config, max_position_embeddings=rows)
    if config.get("relative_attention") and config.get("max_relative_positions", -1) < 1:
        config["max_relative_positions"] = before  # DeBERTa's relative table and log buckets read the position count
    whole.set_json("config.json", config)
    if (tokenizer_config := whole.json_file("tokenizer_config.json")) is not None:
        whole.set_json("tokenizer_config.json", dict(tokenizer_config, model_max_length=n))
    return {"positions_before": before - layer.config.first_position, "positions_after": n, "rows_before": before,
            "rows_after": rows, "method": method} | write_whole(whole)
