"""Fuzzing the loaders: several hundred broken checkpoints, built from a small valid one, must each load or fail
with ValueError/FileNotFoundError naming the checkpoint, never a raw TypeError, RecursionError, IndexError, ..."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from bertembed import BertEmbeddings, load_checkpoint
from test_checkpoint_safety import _quantized, _sharded, _tiny

_ODD_VALUES = [None, True, 0, -1, 1.5, "12", "x", [], [1, 2], {}, {"a": {"b": []}}, 10**30, 2**63, float("nan"),
               float("inf"), "bert", ["BertModel"], 1e-12]
_CONFIG_FIELDS = ["vocab_size", "hidden_size", "max_position_embeddings", "type_vocab_size", "layer_norm_eps",
                  "hidden_dropout_prob", "initializer_range", "pad_token_id", "position_embedding_type", "model_type",
                  "architectures"]


def _nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def _write(path, data) -> None:
    if isinstance(data, bytes):
        path.write_bytes(data)
    elif data == "folder":
        path.unlink(missing_ok=True)
        path.mkdir()
    else:
        path.write_text(data if isinstance(data, str) else json.dumps(data))


def _fuzz_cases(rng):
    """(name, form, edit) triples: `form` is the valid checkpoint to start from, `edit(folder)` breaks it."""
    cases = []
    for field in _CONFIG_FIELDS:
        for value in [*_ODD_VALUES, _nested(50), _nested(900)]:
            def edit(folder, field=field, value=value):
                config = json.loads((folder / "config.json").read_text())
                _write(folder / "config.json", {**config, field: value})
            cases.append((f"config {field}={str(value)[:20]}", "safetensors", edit))
    whole = [b"", b"\xff\xfe\x00garbage", "[]", "null", "1", '"text"', "[" * 100_000, "{" + '"a":' * 3000 + "1",
             "9" * 5000, "folder", "{", '{"vocab_size": NaN}', '{"hidden_size": 8, "extra": ' + "[" * 950 + "]" * 950
             + "}"]
    cases += [(f"config file {str(data)[:12]!r}", "safetensors", lambda f, d=data: _write(f / "config.json", d))
              for data in whole]
    size = 0

    def cut(folder, at):
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:at])

    def flip(folder, at, byte):
        data = bytearray((folder / "model.safetensors").read_bytes())
        data[at % len(data)] = byte
        (folder / "model.safetensors").write_bytes(bytes(data))

    def header(folder, change):
        data = (folder / "model.safetensors").read_bytes()
        length = int.from_bytes(data[:8], "little")
        head = json.loads(data[8:8 + length])
        change(head)
        text = json.dumps(head).encode()
        (folder / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])

    size = 2000  # (about the tiny checkpoint's length; positions past its end cut nothing)
    cases += [(f"safetensors cut at {at}", "safetensors", lambda f, at=at: cut(f, at))
              for at in [0, 1, 7, 8, 9, 20, 100, *rng.sample(range(size), 25)]]
    cases += [(f"safetensors byte {at}={byte}", "safetensors", lambda f, at=at, byte=byte: flip(f, at, byte))
              for at, byte in zip(rng.sample(range(400), 40), rng.choices(range(256), k=40), strict=True)]
    cases += [(f"safetensors length {n}", "safetensors", lambda f, n=n: flip(f, 0, n) or cut(f, 10**9))
              for n in (0, 1, 255)]
    word = "embeddings.word_embeddings.weight"
    changes = {"dtype I8": lambda h: h[word].update(dtype="I8"), "dtype BOOL": lambda h: h[word].update(dtype="BOOL"),
               "dtype XX": lambda h: h[word].update(dtype="XX"), "dtype F8": lambda h: h[word].update(dtype="F8_E4M3"),
               "shape []": lambda h: h[word].update(shape=[]), "shape [3]": lambda h: h[word].update(shape=[3]),
               "shape huge": lambda h: h[word].update(shape=[10**12, 8]), "shape -1": lambda h: h[word].update(
                   shape=[-1, 8]), "offsets huge": lambda h: h[word].update(data_offsets=[0, 10**12]),
               "offsets reversed": lambda h: h[word].update(data_offsets=[5, 2]),
               "offsets text": lambda h: h[word].update(data_offsets="x"), "entry list": lambda h: h.update({word: []}),
               "no word": lambda h: h.pop(word)}
    cases += [(f"safetensors header {name}", "safetensors", lambda f, c=c: header(f, c)) for name, c in changes.items()]
    cases += [(f"safetensors is {str(d)[:10]}", "safetensors", lambda f, d=d: _write(f / "model.safetensors", d))
              for d in [b"", b"\x00" * 64, rng.randbytes(1000), "folder"]]
    return cases + _fuzz_index_cases() + _fuzz_bin_cases()


def _fuzz_index_cases():
    word = "embeddings.word_embeddings.weight"
    cases = []
    for value in [[], "a.safetensors", None, 1, {}]:
        cases.append((f"index weight_map={value}", "sharded", lambda f, v=value: _write(
            f / "model.safetensors.index.json", {"weight_map": v})))
    for shard in [1, None, [], ["a.safetensors"], {}, "", ".", "..", "../outside.safetensors", "/etc/passwd",
                  "sub/../../outside.safetensors", "missing.safetensors", "model.safetensors.index.json", "a\x00b",
                  "config.json", "c:evil.safetensors", "shards"]:
        def edit(folder, shard=shard):
            (folder / "shards").mkdir(exist_ok=True)
            (folder.parent / "outside.safetensors").write_bytes((folder / "a.safetensors").read_bytes())
            index = json.loads((folder / "model.safetensors.index.json").read_text())
            index["weight_map"][word] = shard
            _write(folder / "model.safetensors.index.json", index)
        cases.append((f"index shard {shard!r}", "sharded", edit))
    for data in [b"\xff\xfe", "[" * 100_000, "folder", "", '{"weight_map": {}}']:
        cases.append((f"index file {str(data)[:10]!r}", "sharded",
                      lambda f, d=data: _write(f / "model.safetensors.index.json", d)))
    cases += [(f"shard a is {str(d)[:8]}", "sharded", lambda f, d=d: _write(f / "a.safetensors", d))
              for d in [b"", b"\x01" * 50, "folder"]]
    return cases


def _fuzz_bin_cases():
    def state(folder):
        return load_file(folder / "model.safetensors")

    def save(folder, payload):
        full = state(folder)
        (folder / "model.safetensors").unlink()
        torch.save(payload(full) if callable(payload) else payload, folder / "pytorch_model.bin")

    word = "embeddings.word_embeddings.weight"
    payloads = {
        "list": lambda s: list(s.values()), "tuple": lambda s: tuple(s.values()), "tensor": lambda s: s[word],
        "nested": lambda s: {"a": {"b": s}}, "int keys": lambda s: {i: v for i, v in enumerate(s.values())},
        "state_dict list": lambda s: {"state_dict": list(s.values())}, "state_dict ok": lambda s: {"state_dict": s},
        "parameter": lambda s: {k: torch.nn.Parameter(v) for k, v in s.items()},
        "sparse": lambda s: {**s, word: s[word].to_sparse()}, "csr": lambda s: {**s, word: s[word].to_sparse_csr()},
        "meta": lambda s: {**s, word: s[word].to("meta")}, "quantized": lambda s: {**s, word: _quantized(s[word])},
        "0-d": lambda s: {**s, word: torch.tensor(1.0)}, "1-d": lambda s: {**s, word: s[word].flatten()},
        "3-d": lambda s: {**s, word: s[word][None]}, "empty table": lambda s: {**s, word: s[word][:0]},
        "bool": lambda s: {**s, word: s[word] > 0}, "complex": lambda s: {**s, word: s[word].to(torch.complex64)},
        "bfloat16": lambda s: {k: v.bfloat16() for k, v in s.items()}, "float16": lambda s: {
            k: v.half() for k, v in s.items()}}
    payloads |= {f"value {v!r}": (lambda s, v=v: {**s, word: v}) for v in (None, 1, "x", [1.0], {"a": 1}, (1, 2))}
    cases = [(f"bin {name}", "safetensors", lambda f, p=p: save(f, p)) for name, p in payloads.items()]
    for name, data in [("empty", b""), ("garbage", b"\x80\x02garbage"), ("zip", b"PK\x03\x04" + b"\x00" * 40)]:
        cases.append((f"bin {name}", "safetensors", lambda f, d=data: save(f, {}) or _write(f / "pytorch_model.bin",
                                                                                             d)))
    cases.append(("bin cut", "safetensors", lambda f: save(f, state(f)) or _write(
        f / "pytorch_model.bin", (f / "pytorch_model.bin").read_bytes()[:300])))
    # the same without config.json: sizes come from the shapes
    return cases + [(f"{name}, no config", form, lambda f, e=edit: e(f) or (f / "config.json").unlink())
                    for name, form, edit in cases[:: 2]]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fuzzed_checkpoints_raise_only_clear_errors(tmp_path):
    rng = random.Random(31)
    bases = {"safetensors": tmp_path / "base"}
    _tiny(bases["safetensors"])
    bases["sharded"] = tmp_path / "base-sharded"
    _sharded(bases["sharded"])
    raw: dict[str, list[str]] = {}
    cases = _fuzz_cases(rng)
    assert len(cases) >= 400
    for number, (name, form, edit) in enumerate(cases):
        folder = tmp_path / f"case-{number}"
        shutil.copytree(bases[form], folder)
        try:
            edit(folder)
        except RuntimeError:  # torch cannot save this payload at all: nothing to load
            continue
        for label, read in (("from_pretrained", BertEmbeddings.from_pretrained),
                            ("np", lambda p: load_checkpoint(p, framework="np"))):
            try:
                read(folder)
            except (ValueError, FileNotFoundError) as err:
                if folder.name not in str(err):
                    raw.setdefault(f"{type(err).__name__} without the path", []).append(f"{name} ({label}): {err}")
            except Exception as err:  # noqa: BLE001 (what the test is looking for)
                raw.setdefault(type(err).__name__, []).append(f"{name} ({label}): {str(err)[:150]}")
    assert not raw, "\n".join(f"{kind}: {len(found)}, e.g. {found[:3]}" for kind, found in raw.items())
