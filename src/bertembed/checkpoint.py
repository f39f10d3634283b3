"""Reading the five embedding tensors out of a BERT checkpoint, and writing an embedding-only one.

Only the embedding tensors are read: from `.safetensors` by name (the rest of the file is never touched), from `.bin`
through `torch.load(weights_only=True, mmap=True)`, from sharded checkpoints only the shards that hold them. Keys are
returned under `BertEmbeddings.state_dict()` names. With framework="np" nothing imports torch unless the file needs it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bertembed.config import EmbeddingConfig
from bertembed.sources import Source, read_json, resolve

log = logging.getLogger(__name__)

NAMES = ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
         "LayerNorm.weight", "LayerNorm.bias")
LEGACY = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}  # TF-era checkpoints
PREFERRED_PREFIXES = ("bert.embeddings.", "embeddings.", "")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


@dataclass
class Checkpoint:
    """What `load_checkpoint` found: where, the config, and the tensors under `BertEmbeddings` state-dict names."""

    source: Source
    config: EmbeddingConfig
    tensors: dict[str, Any]  # torch.Tensor (framework="pt") or numpy.ndarray (framework="np")


def load_checkpoint(name_or_path: str | Path | None = None, *, revision: str | None = None,
                    local_files_only: bool = False, framework: str = "pt") -> Checkpoint:
    """Resolve a checkpoint and read its embedding tensors, checking every name and shape against its config."""
    source = resolve(name_or_path, revision=revision, local_files_only=local_files_only)
    files, keys = _weight_files(source)
    tensors = _select(files, keys, framework)
    config_path = source.file("config.json")
    if config_path is not None:
        config = EmbeddingConfig.from_hf_config(config_path)
    else:
        config = _infer_config(tensors)
        log.info("no config.json beside %s: sizes read from the tensor shapes, other settings are BERT's defaults",
                 files[0])
    if config.position_embedding_type != "absolute" and tensors.pop("position_embeddings.weight", None) is not None:
        log.info("position_embedding_type=%r: the checkpoint's learned position table is not used",
                 config.position_embedding_type)
    _check_shapes(tensors, config, source)
    return Checkpoint(source, config, tensors)


def _weight_files(source: Source) -> tuple[list[Path], dict[str, Path]]:
    """The weight files to read and, for sharded checkpoints, which file holds each key."""
    if source.kind == "file":
        return [source.weights_file], {}
    for candidate in WEIGHT_FILES:
        path = source.file(candidate)
        if path is None:
            continue
        if not candidate.endswith(".index.json"):
            return [path], {}
        weight_map = read_json(path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path} has no 'weight_map' object; the sharded checkpoint's index is corrupt")
        wanted = {k: v for k, v in weight_map.items() if _embedding_name(k) is not None}
        shards = {}
        for shard in sorted(set(wanted.values())):  # only the shards that hold embedding tensors
            shard_path = source.file(shard)
            if shard_path is None:
                raise FileNotFoundError(f"{path} lists shard {shard}, which is missing; re-download the checkpoint")
            shards[shard] = shard_path
        return list(shards.values()), {k: shards[v] for k, v in wanted.items()}
    raise FileNotFoundError(f"{source.describe()} has none of {', '.join(WEIGHT_FILES)}; pass a folder with "
                            f"PyTorch weights, or the weights file itself")


def _embedding_name(key: str) -> str | None:
    """The state-dict name a checkpoint key maps to (or None): any prefix ending in 'embeddings.', legacy names."""
    for name in (*NAMES, *LEGACY):
        if key == name or key.endswith("embeddings." + name):
            return LEGACY.get(name, name)
    return None


def _select(files: list[Path], index: dict[str, Path], framework: str) -> dict[str, Any]:
    """Read the embedding tensors of one BERT from the files, choosing one key prefix if several models share them."""
    handles = {path: _open(path, framework) for path in files}
    keys = list(index) or [k for handle in handles.values() for k in handle.keys()]
    prefixes = {k[: -len("word_embeddings.weight")] for k in keys if k.endswith("word_embeddings.weight")}
    prefixes = {p for p in prefixes if p == "" or p.endswith("embeddings.")}
    if not prefixes:
        raise ValueError(f"{files[0]} holds no BERT word embeddings (no '*embeddings.word_embeddings.weight' among "
                         f"{len(keys)} keys such as {keys[:3]}); is it a BERT checkpoint?")
    prefix = next((p for p in PREFERRED_PREFIXES if p in prefixes), None)
    if prefix is None:
        if len(prefixes) > 1:
            raise ValueError(f"{files[0]} holds several embedding layers {sorted(prefixes)}; extract one first")
        prefix = prefixes.pop()
    wanted = {prefix + n: n for n in NAMES} | {prefix + old: new for old, new in LEGACY.items()}
    tensors = {}
    for path, handle in handles.items():
        for key in handle.keys():
            if key in wanted and index.get(key, path) == path:
                tensors[wanted[key]] = _get(handle, path, key, framework)
    return tensors


def _get(handle, path: Path, key: str, framework: str) -> Any:
    try:
        tensor = handle.get_tensor(key)
    except Exception as err:  # safetensors raises its own error type for a short or damaged data section
        if framework == "np" and ("bfloat16" in str(err).lower() or "bf16" in str(err).lower()):
            raise TypeError(f"{path}: {key} is bfloat16, which numpy cannot hold; read with framework='pt'") from err
        raise ValueError(f"{path} is truncated or corrupt ({err}); re-download or re-save it") from err
    return tensor.numpy() if framework == "np" and isinstance(handle, _StateDictHandle) else tensor


class _StateDictHandle:
    """A loaded `.bin` state dict behind the same keys()/get_tensor() interface as safetensors' safe_open."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def keys(self) -> list[str]:
        return list(self.state)

    def get_tensor(self, key: str) -> Any:
        return self.state[key]


def _open(path: Path, framework: str):
    if path.suffix == ".safetensors":
        return _open_safetensors(path, framework)
    return _StateDictHandle(_torch_load(path))


def _open_safetensors(path: Path, framework: str):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="numpy" if framework == "np" else "pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is truncated or corrupt ({err}); re-download or re-save it") from err


def _torch_load(path: Path) -> dict[str, Any]:
    """A `.bin`/`.pt` state dict, memory-mapped so only the tensors used are paged in."""
    import pickle
    import zipfile

    import torch

    if path.suffix not in (".bin", ".pt", ".pth"):
        raise ValueError(f"{path}: unknown weights format {path.suffix!r}; use .safetensors, .bin, .pt or .pth")
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # legacy (pre-zip) format
    except (RuntimeError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"{path} is truncated or corrupt ({err}); re-download or re-save it") from err
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
    return state.get("state_dict", state) if isinstance(state.get("state_dict"), dict) else state


def _infer_config(tensors: dict[str, Any]) -> EmbeddingConfig:
    if "word_embeddings.weight" not in tensors or "token_type_embeddings.weight" not in tensors:
        raise ValueError(f"cannot size the layer without config.json: the checkpoint has only {sorted(tensors)}")
    vocab, hidden = tensors["word_embeddings.weight"].shape
    kwargs = {"vocab_size": int(vocab), "hidden_size": int(hidden),
              "type_vocab_size": int(tensors["token_type_embeddings.weight"].shape[0])}
    if "position_embeddings.weight" in tensors:
        kwargs["max_position_embeddings"] = int(tensors["position_embeddings.weight"].shape[0])
    else:
        kwargs["position_embedding_type"] = "none"
    return EmbeddingConfig(**kwargs)


def _check_shapes(tensors: dict[str, Any], config: EmbeddingConfig, source: Source) -> None:
    h = config.hidden_size
    expected = {"word_embeddings.weight": (config.vocab_size, h), "token_type_embeddings.weight":
                (config.type_vocab_size, h), "LayerNorm.weight": (h,), "LayerNorm.bias": (h,)}
    if config.position_embedding_type == "absolute":
        expected["position_embeddings.weight"] = (config.max_position_embeddings, h)
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise ValueError(f"checkpoint {source.describe()} is missing embedding tensor(s) {missing}; "
                         f"found {sorted(tensors)}. Re-download it, or check it is a BERT model")
    wrong = [f"{k} is {tuple(tensors[k].shape)}, config says {shape}"
             for k, shape in expected.items() if tuple(tensors[k].shape) != shape]
    if wrong:
        raise ValueError(f"checkpoint {source.describe()} disagrees with its config.json: " + "; ".join(wrong)
                         + ". The weights and the config come from different models")


def save_checkpoint(layer, folder: str | Path) -> Path:
    """Write `config.json` and `model.safetensors` (keys `embeddings.*`, as in a transformers `BertModel`).

    Both files are written to temporary names and renamed into place only when both are complete, so a failed save
    leaves any earlier files intact.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"embeddings.{k}": v.detach().cpu().contiguous() for k, v in layer.state_dict().items()}
    payloads = {"model.safetensors": lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
                "config.json": lambda p: p.write_text(json.dumps(layer.config.to_hf_config(), indent=2) + "\n")}
    temps: dict[str, Path] = {}
    try:
        for name, write in payloads.items():
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
            os.close(fd)
            temps[name] = Path(tmp)
            write(temps[name])
            with open(temps[name], "rb+") as handle:
                os.fsync(handle.fileno())
        for name, tmp in temps.items():
            os.replace(tmp, folder / name)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    return folder
