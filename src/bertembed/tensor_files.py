"""Reading tensors out of weight files (safetensors, or `.bin`/`.pt` through `torch.load(weights_only=True)`), each
refused unless it is a dense floating-point table. Torch is imported only for a `.bin`, or bfloat16 for numpy."""

from __future__ import annotations

import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")  # what a table may be stored as
_SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "BOOL": "bool",
                       "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "U8": "uint8"}  # torch's names


def read_tensor(handle, path: Path, key: str, framework: str, reader: Callable[[Any], Any] | None = None) -> Any:
    """One tensor, refused unless it is a dense floating-point array (`tensor_problem`); with `reader`, what it
    reads from safetensors' slice of the tensor (`get_slice`: rows without the rest)."""
    if reader is not None and not isinstance(handle, _SafetensorsHandle):
        raise ValueError(f"{path} cannot be read in part ({key}): only safetensors files can; convert it with "
                         f"transformers' model.save_pretrained(folder) (safetensors by default), or load it whole")
    try:
        stored, value = handle.get_dtype(key), None
        if stored in FLOAT_DTYPES:
            value = handle.handle.get_slice(key) if reader is not None else handle.get_tensor(key)
    except Exception as err:  # safetensors raises its own error type for a short or damaged data section
        raise ValueError(f"{path} is truncated or corrupt ({err}); re-download or re-save it") from err
    problem = f"stored as {stored}" if value is None else None if reader is not None else tensor_problem(value)
    if problem is not None:
        raise ValueError(f"{path}: {key} is {problem}, not a table of floating-point numbers "
                         f"({', '.join(FLOAT_DTYPES)}); re-save it with float tables")
    if reader is not None:
        return reader(value)
    if framework == "np" and not isinstance(value, np.ndarray):  # a torch tensor: from a .bin, or bfloat16
        return (value.detach().float() if str(value.dtype) == "torch.bfloat16" else value.detach()).numpy()
    return value


def tensor_problem(value: Any, *, meta_ok: bool = False) -> str | None:
    """Why `value` cannot be copied into one of the layer's tables as it is, or None if it can: it must be a dense,
    unquantized torch tensor or numpy array of a floating-point dtype, with values (not on meta, unless `meta_ok`)."""
    if isinstance(value, np.ndarray):
        return None if value.dtype.name in FLOAT_DTYPES else f"of dtype {value.dtype}"
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}, not a tensor"
    if value.is_nested or value.layout != torch.strided:
        return f"a {'nested' if value.is_nested else value.layout} tensor, not a dense one"
    if value.is_quantized:
        return f"a quantized tensor ({value.dtype})"
    if value.device.type == "meta" and not meta_ok:
        return "a tensor on the meta device, which holds no values"
    return None if str(value.dtype).removeprefix("torch.") in FLOAT_DTYPES else f"of dtype {value.dtype}"


def unshared(tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` (torch), each one that shares memory with an earlier one cloned: safetensors refuses shared tensors
    (huggingface_hub's save would drop one name of a tied pair), and a custom op's outputs may not alias."""
    seen: set[int] = set()
    out = {}
    for key, value in tensors.items():
        storage = value.untyped_storage().data_ptr()
        out[key] = value.clone() if storage in seen else value
        seen.add(storage)
    return out


class _StateDictHandle(dict):
    """A loaded `.bin` state dict with the get_dtype()/get_tensor() of `_SafetensorsHandle`."""

    get_tensor = dict.__getitem__

    def get_dtype(self, key: str) -> str:
        dtype = getattr(self[key], "dtype", None)
        return str(dtype).removeprefix("torch.") if dtype is not None else type(self[key]).__name__


class _SafetensorsHandle:
    """safetensors' safe_open, with dtypes named as torch names them, and bfloat16 read through torch for numpy."""

    def __init__(self, path: Path, framework: str) -> None:
        from safetensors import safe_open

        self.path, self.framework = path, framework
        self.handle = safe_open(str(path), framework="numpy" if framework == "np" else "pt")
        self.keys = self.handle.keys

    def get_dtype(self, key: str) -> str:
        stored = self.handle.get_slice(key).get_dtype()
        return _SAFETENSORS_DTYPES.get(stored, stored)

    def get_tensor(self, key: str) -> Any:
        if self.framework == "np" and self.get_dtype(key) == "bfloat16":  # numpy has no bfloat16: torch reads it
            from safetensors import safe_open

            return safe_open(str(self.path), framework="pt").get_tensor(key)
        return self.handle.get_tensor(key)


def open_weights(path: Path, framework: str):
    """A handle with keys(), get_dtype(key) and get_tensor(key) on a weights file (a `.bin` is memory-mapped, so only
    the tensors used are paged in); ValueError if it is unreadable."""
    if path.suffix == ".safetensors":
        try:
            return _SafetensorsHandle(path, framework)
        except Exception as err:  # safetensors' own error type, or OSError for a file it cannot open
            raise ValueError(f"{path} is truncated or corrupt ({err}); re-download or re-save it") from err
    if path.suffix not in (".bin", ".pt", ".pth"):
        raise ValueError(f"{path}: unknown weights format {path.suffix!r}; use .safetensors, .bin, .pt or .pth, or "
                         f"pass the checkpoint's folder")
    import torch

    try:  # (a legacy, pre-zip file cannot be memory-mapped)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as err:  # torch.load's many errors for a damaged file (zip, pickle, EOF, I/O, ...)
        raise ValueError(f"{path} is truncated or corrupt ({str(err)[:300]}); re-download or re-save it") from err
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
    state = state["state_dict"] if isinstance(state.get("state_dict"), dict) else state
    return _StateDictHandle((k, v) for k, v in state.items() if isinstance(k, str))  # (no other key names a tensor)
