"""Reading the embedding tensors out of a checkpoint of BERT or its family, and writing an embedding-only one.

What is read, checked and refused: docs/checkpoints.md. With framework="np" torch is imported only if a file needs it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, Any

from bertembed.atomic import atomic_folder
from bertembed.config import EmbeddingConfig, read_json
from bertembed.family import LEGACY, MEMBERS, SUPPORTED, check_key_family, layout
from bertembed.sources import Source, fetch_hint, resolve
from bertembed.tensor_files import open_weights, read_tensor, tensor_problem, unshared

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
BUFFERS = ("position_ids", "token_type_ids")  # default-id buffers that older saves hold beside the tables
# a position table that is computed, not read ("sinusoidal", or "none"'s id buffers), is sized by config.json alone
COMPUTED_POSITIONS_LIMIT = 1 << 20


@dataclass
class Checkpoint:
    """What `load_checkpoint` found: where, the config, and the tensors under `BertEmbeddings` state-dict names."""

    source: Source
    config: EmbeddingConfig
    tensors: dict[str, Any]  # torch.Tensor (framework="pt") or numpy.ndarray (framework="np")


def load_checkpoint(name_or_path: str | Path | None = None, *, revision: str | None = None,
                    local_files_only: bool = False, framework: str = "pt",
                    word_reader: Callable[[Any], Any] | None = None) -> Checkpoint:
    """Resolve a checkpoint and read its embedding tensors, checking every name, dtype and shape against its config.

    framework="np" gives numpy arrays (bfloat16 tables as float32, which numpy lacks). `word_reader` reads the word
    table from safetensors' slice of it (`get_slice`), part of it say (`bertembed.parallel.rank_reader`); its result
    stands for the table (with its shape). Raises ValueError or FileNotFoundError naming the file and fix.
    """
    if framework not in ("pt", "np"):
        raise ValueError(f"framework={framework!r} is not 'pt' (torch tensors) or 'np' (numpy arrays)")
    source = resolve(name_or_path, revision=revision, local_files_only=local_files_only)
    # A save may switch a new version in between config.json and the weights, which would load one version's config
    # with the other's tables (tests/test_atomic_save.py, test_a_reader_never_sees_two_saves_mixed): read again. The
    # folder is held open while it is read, so that its inode number, which tells a new folder from it, is not reused
    # meanwhile. (The hub's cache and the bundled default are never replaced; Windows cannot open a folder.)
    pin = source.kind in ("folder", "file") and os.name == "posix"
    for attempt in range(5):
        fd = None
        try:
            fd = os.open(source.folder, os.O_RDONLY) if pin else None
            checkpoint = _read(source, framework, word_reader)
            if _unchanged(fd, source.folder):
                return checkpoint
        except (OSError, ValueError):  # from a mix of two versions, or the folder gone between a save's two renames
            if attempt == 4 or not pin or fd is not None and _unchanged(fd, source.folder):
                raise
        finally:
            if fd is not None:
                os.close(fd)
    raise ValueError(f"{name_or_path} was replaced while being read, five times in a row; is something saving to it "
                     f"in a loop? Read it when the saves are done")


def _unchanged(fd: int | None, folder: Path) -> bool:
    """Whether `folder` is still the folder open as `fd` (a save switches in a new one); True without `fd`."""
    try:
        return fd is None or os.path.samestat(os.fstat(fd), os.stat(folder))
    except OSError:  # (no folder there: between the two renames of a switch without the exchange)
        return False


def _read(source: Source, framework: str, word_reader) -> Checkpoint:
    config_path = source.file("config.json")
    # the config first: an unsupported member is refused before any weights are read (or downloaded)
    config = EmbeddingConfig.from_hf_config(config_path) if config_path is not None else None
    member = "bert" if config is None else config.model_type
    files, index = weight_files(source, member)
    tensors = _select(files, index, framework, member, word_reader)
    if config is None:
        config = _infer_config(tensors, files[0])
        log.info("no config.json beside %s: sizes read from the tensor shapes, other settings are BERT's defaults",
                 files[0])
    if config.position_embedding_type != "absolute":
        if config.max_position_embeddings > COMPUTED_POSITIONS_LIMIT:
            raise ValueError(f"{config_path}: max_position_embeddings={config.max_position_embeddings} rows of a "
                             f"computed ({config.position_embedding_type}) position table; at most "
                             f"{COMPUTED_POSITIONS_LIMIT}: fix the config")
        if tensors.pop("position_embeddings.weight", None) is not None:
            log.info("position_embedding_type=%r: the checkpoint's learned position table is not used",
                     config.position_embedding_type)
    _check_shapes(tensors, config, source)
    # an all-zero row with nonzero rows after it: the padding row of a RoBERTa-style table, which BERT's never has
    positions = tensors.get("position_embeddings.weight")  # (numpy or torch)
    zero = [] if positions is None or config.positions_from_padding else (positions == 0).all(1).tolist()
    row = zero.index(True) if True in zero else None
    if row is not None and not all(zero[row:]):
        raise ValueError(f"checkpoint {source.describe()}: row {row} of the position table is all zeros, the padding "
                         f"row of a RoBERTa-style table that counts positions from the padding id, but its config "
                         f"says {config.model_type!r}, which counts from 0: is config.json the checkpoint's own?")
    return Checkpoint(source, config, tensors)


def weight_files(source: Source, member: str | None = None) -> tuple[list[Path], dict[str, Path]]:
    """The weight files to read and, for a sharded checkpoint, which shard holds each key: every key, or with
    `member`, its embedding keys alone (so that only their shards are read, or downloaded)."""
    if source.kind == "file":
        return [source.weights_file], {}
    index = next((path for name in WEIGHT_FILES if (path := source.file(name)) is not None), None)
    if index is None:
        raise FileNotFoundError(f"{source.describe()} has none of {', '.join(WEIGHT_FILES)}"
                                f"{fetch_hint(source, *WEIGHT_FILES)}; pass a folder with PyTorch weights, or the "
                                f"weights file itself")
    if not index.name.endswith(".index.json"):
        return [index], {}
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no 'weight_map' object; the sharded checkpoint's index is corrupt")
    if member is not None:
        weight_map = {k: weight_map[k] for k in embedding_keys(list(weight_map), member, index) if k in weight_map}
    bad = next((k for k, v in weight_map.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise ValueError(f"{index}: weight_map[{bad!r}] is a {type(weight_map[bad]).__name__}, not a shard's file "
                         f"name; the index is corrupt: re-download the checkpoint")
    shards = {name: _shard(source, index, name) for name in sorted(set(weight_map.values()))}
    return list(shards.values()), {k: shards[v] for k, v in weight_map.items()}


def _shard(source: Source, index: Path, name: str) -> Path:
    """The path of a shard named by an index: never outside the checkpoint's folder (the hub's snapshot folder)."""
    posix = PurePosixPath(name.replace("\\", "/"))
    if not name or "\x00" in name or posix.is_absolute() or PureWindowsPath(name).drive or ".." in posix.parts:
        raise ValueError(f"{index} names shard {name!r}, which is not a file inside the checkpoint's folder; the "
                         f"index is corrupt or hostile, and is not followed")
    path = source.file(name)
    if path is None:
        raise FileNotFoundError(f"{index} lists shard {name}, which is missing; re-download the checkpoint")
    real, root = path.resolve(), source.folder.resolve()
    blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else root  # (a hub cache's snapshot)
    if source.kind != "hub" and not (real.is_relative_to(root) or real.is_relative_to(blobs)):
        raise ValueError(f"{index} names shard {name!r}, a link to {real}, outside the checkpoint's folder "
                         f"{source.folder}; it is not followed: copy the shard into the folder")
    return path


def _select(files: list[Path], index: dict[str, Path], framework: str, member: str,
            word_reader) -> dict[str, Any]:
    """Read the embedding tensors of one model from the files, choosing one model prefix if several share them."""
    handles = {path: open_weights(path, framework) for path in files}
    keys = list(index) or [k for handle in handles.values() for k in handle.keys()]
    wanted = embedding_keys(keys, member, files[0])
    seen: dict[str, str] = {}  # state-dict name -> the checkpoint key it was read from
    tensors = {}
    for path, handle in handles.items():
        for key in handle.keys():
            if key in wanted and index.get(key, path) == path:
                name = wanted[key]
                if name in seen:  # LayerNorm.gamma beside LayerNorm.weight: which one the model used is unknowable
                    raise ValueError(f"{path} holds both {seen[name]!r} and {key!r} for {name}; the checkpoint is "
                                     f"ambiguous: delete one of them and load again")
                seen[name] = key
                tensors[name] = read_tensor(handle, path, key, framework,
                                            word_reader if name == "word_embeddings.weight" else None)
    return tensors


def embedding_keys(keys: list[str], member: str, where: Path) -> dict[str, str]:
    """Which of a checkpoint's `keys` are the embedding tensors: checkpoint key -> the layer's state-dict name (legacy
    names included), under one model prefix ("bert.", or none) chosen if several models share a file; ValueError for
    keys of another member (`check_key_family`)."""
    check_key_family(keys, str(where), member)
    layer = layout(member)  # the layer's name -> the member's key, after the model prefix
    word = layer["word_embeddings.weight"]
    found = {k[: -len(word)] for k in keys if k == word or k.endswith("." + word)}
    if not found and "word_embeddings.weight" in keys:  # a bare state dict of the layer itself
        found, layer = {""}, {n: n for n in layer}
    if not found:
        raise ValueError(f"{where} holds no {member} word embeddings (no '*{word}' among {len(keys)} keys such as "
                         f"{keys[:3]}); is it a {member} checkpoint? {SUPPORTED}")
    prefix = next((p for p in (*MEMBERS[member].prefixes, "") if p in found), None)  # (a head's, then a base model)
    if prefix is None:
        if len(found) > 1:
            raise ValueError(f"{where} holds several embedding layers {sorted(found)}; extract one first")
        prefix = found.pop()
    names = {prefix + key: name for name, key in layer.items()}
    for old, new in LEGACY.items():  # TF-era LayerNorm.gamma and .beta
        names |= {k.removesuffix(new) + old: new for k, name in list(names.items()) if name == new and k.endswith(new)}
    extra = sorted(k for k in keys if k.startswith(prefix + "embeddings.") and k not in names
                   and k.rpartition(".")[2] not in BUFFERS)
    if extra:  # (LayoutLM's box tables, RoCBert's shape and sound tables: more rows in the sum, never left out)
        raise ValueError(f"{where} holds {extra[0]!r}, a table no {member} embedding layer has: this model adds more "
                         f"to the sum than BERT's family does, and leaving it out would compute something else; "
                         f"{SUPPORTED}")
    return names


def _infer_config(tensors: dict[str, Any], path: Path) -> EmbeddingConfig:
    """Sizes from the tensors' shapes, for a checkpoint without config.json."""
    shapes = {k.removesuffix("_embeddings.weight"): tuple(v.shape) for k, v in tensors.items()
              if k.endswith("_embeddings.weight")}  # (the word, token type and position tables)
    if "word" not in shapes or "token_type" not in shapes:
        raise ValueError(f"cannot size the layer without config.json: {path} has only {sorted(tensors)}; {SUPPORTED}")
    if any(len(shape) != 2 for shape in shapes.values()):
        shown = ", ".join(f"{k}_embeddings.weight {shape}" for k, shape in shapes.items())
        raise ValueError(f"{path}: the tables' shapes {shown} are not all [rows, hidden]; re-save the checkpoint")
    positions = {"max_position_embeddings": shapes["position"][0]} if "position" in shapes else {
        "position_embedding_type": "none"}
    try:
        return EmbeddingConfig(vocab_size=shapes["word"][0], hidden_size=shapes["word"][1],
                               type_vocab_size=shapes["token_type"][0], **positions)
    except ValueError as err:
        raise ValueError(f"{path}: the tables' shapes give no valid config ({err}); re-save the checkpoint") from err


def expected_shapes(config: EmbeddingConfig) -> dict[str, tuple[int, ...]]:
    """The state-dict name and shape of every tensor a layer of this config holds."""
    e, n, h, absolute = config.table_width, config.output_width, config.hidden_size, config.position_embedding_type
    shapes = {"word_embeddings.weight": (config.vocab_size, e), "LayerNorm.weight": (n,),
              "LayerNorm.bias": (n,) if config.norm_bias else None,
              "token_type_embeddings.weight": (config.type_vocab_size, e) if config.type_vocab_size else None,
              "position_embeddings.weight": (config.max_position_embeddings, e) if absolute == "absolute" else None,
              "projection.weight": (h, e) if config.projection != "none" else None,
              "projection.bias": (h,) if config.projection == "output" else None}
    return {k: shape for k, shape in shapes.items() if shape is not None}


def _check_shapes(tensors: dict[str, Any], config: EmbeddingConfig, source: Source) -> None:
    expected = expected_shapes(config)
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise ValueError(f"checkpoint {source.describe()} is missing embedding tensor(s) {missing} that its config "
                         f"({config.model_type}) implies; found {sorted(tensors)}. Re-download it, or fix config.json")
    unexpected = [k for k in tensors if k not in expected]
    if unexpected:
        raise ValueError(f"checkpoint {source.describe()} holds {unexpected}, which its config ({config.model_type}: "
                         f"type_vocab_size={config.type_vocab_size}, position_embedding_type="
                         f"{config.position_embedding_type!r}, embedding_size={config.table_width}, hidden_size="
                         f"{config.hidden_size}, norm_bias={config.norm_bias}) has no place for: is config.json the "
                         f"checkpoint's own?")
    wrong = [f"{k} is {tuple(tensors[k].shape)}, config says {shape}"
             for k, shape in expected.items() if tuple(tensors[k].shape) != shape]
    if wrong:
        raise ValueError(f"checkpoint {source.describe()} disagrees with its config.json: " + "; ".join(wrong)
                         + ". The weights and the config come from different models")


def _config_text(config: EmbeddingConfig, dtype) -> str:
    """config.json's text, with the tables' `dtype` where the source's config named one (transformers loads by it,
    and would round a wider table); ValueError for extra keys JSON cannot hold."""
    hf_config = config.to_hf_config()
    named = str(dtype).removeprefix("torch.")
    try:
        return json.dumps(hf_config | {k: named for k in ("dtype", "torch_dtype") if k in hf_config}, indent=2) + "\n"
    except (TypeError, ValueError, RecursionError) as err:
        raise ValueError(f"cannot save: the config's extra keys cannot be written as JSON ({str(err)[:200]}); "
                         f"fix layer.config.extra") from err


def checkpoint_writer(layer, folder: str | Path) -> Callable[[Path], None]:
    """Check `layer` against its config (ValueError for a table of another size or dtype, or LayerNorm's eps changed:
    its checkpoint would load wrongly) and return a function that writes config.json and model.safetensors into a
    staging folder, for `atomic_folder` to switch in as `folder` (the name in its errors)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    if hasattr(layer, "_bertembed_original"):  # (its config is read off the model's modules, some held outside it)
        raise ValueError("cannot save a layer that bertembed.patch put into a model; nothing was written. Save the "
                         "model (model.save_pretrained keeps transformers' keys), then BertEmbeddings.from_pretrained "
                         "reads its embeddings")
    config, state = layer.config, layer.state_dict()
    expected = expected_shapes(config)
    problems = [f"{k} is missing" for k in expected if k not in state]
    problems += [f"{k} is not in a layer of this config" for k in state if k not in expected]
    for key, value in state.items():
        if (problem := tensor_problem(value)) is not None:
            problems.append(f"{key} is {problem}")
        elif key in expected and tuple(value.shape) != expected[key]:
            problems.append(f"{key} is {tuple(value.shape)}, but layer.config says {expected[key]}")
    for what, actual, configured in (("LayerNorm.eps", getattr(layer.LayerNorm, "eps", None), config.layer_norm_eps),
                                     ("dropout.p", getattr(layer.dropout, "p", None), config.hidden_dropout_prob)):
        if actual != configured:
            problems.append(f"{what} is {actual}, but layer.config says {configured}")
    if problems:
        raise ValueError("cannot save: the layer disagrees with layer.config (" + "; ".join(problems) + "); nothing "
                         "was written. Restore the tables, or set layer.config = layer.config.replace(...) to match")
    config_text = _config_text(config, layer.tables()[0].dtype)
    if (found := _whole_model_in(Path(folder).expanduser())) is not None:
        raise ValueError(f"cannot save to {folder}: it holds {found}, which this embedding-only save would replace or "
                         f"hide (transformers reads model.safetensors first); nothing was written. Save the layer to "
                         f"a folder of its own")
    # under the member's base model keys (`embeddings.*`), on the CPU; a sharded table's rows gathered (`full_tensor`,
    # a collective: every rank saves)
    tensors = unshared({layout(config.model_type)[k]: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
                        .cpu().contiguous() for k, v in state.items()})

    def write(staging: Path) -> None:  # (`atomic_folder` names `folder` in an OSError)
        try:
            save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        except SafetensorError as err:
            raise OSError(f"writing model.safetensors failed ({err})") from err
        (staging / "config.json").write_text(config_text, encoding="utf-8")
    return write


def _whole_model_in(folder: Path) -> str | None:
    """The weights in `folder` that are more than an embedding layer's (a whole model's, sharded, or a .bin that a new
    model.safetensors would hide), named; None for none, or for a layer's own (saved before: replaced)."""
    if not folder.is_dir():
        return None
    hidden = [name for name in WEIGHT_FILES[1:] if (folder / name).is_file()]
    if hidden:
        return hidden[0]
    if not (folder / "model.safetensors").is_file():
        return None
    try:
        keys = set(open_weights(folder / "model.safetensors", "pt").keys())
    except (OSError, ValueError):  # (a file that cannot be read holds no model to lose)
        return None
    layers = {key for member in MEMBERS for key in layout(member).values()}
    more = sorted(k for k in keys - layers if k.rpartition(".")[2] not in BUFFERS)
    return f"a model.safetensors of {len(more)} tensors beyond an embedding layer's ({more[0]}, ...)" if more else None


def _skip_init():
    """A torch function mode in which torch.nn.init's functions return their tensor untouched."""
    from torch.overrides import TorchFunctionMode

    class SkipInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__module__", None) == "torch.nn.init":
                return args[0] if args else kwargs["tensor"]
            return func(*args, **(kwargs or {}))
    return SkipInit()


class Pretrained:
    """`from_pretrained`, `load_pretrained_weights` and `save_pretrained` of `BertEmbeddings` (an nn.Module built from
    an `EmbeddingConfig`, with `load_state_dict` and `config`)."""

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | Path | None = None, *, revision: str | None = None, local_files_only: bool = False,
        backend: str = "reference", dtype: torch.dtype | None = None, device_mesh: DeviceMesh | None = None,
    ) -> Pretrained:
        """Load the embedding tables of a checkpoint of BERT or its family (`bertembed.family.MEMBERS`).

        `name_or_path`: a hub id ("bert-base-uncased"), a local folder, a single weights file, or None for the
        bundled default (`bertembed.DEFAULT_MODEL`). `backend`: as in `BertEmbeddings(config, backend=...)`.
        `dtype`: the layer's float dtype; None keeps the checkpoint's word table's (float16 stays float16).
        `device_mesh`: a 1-D DeviceMesh, to shard the word table by rows over it (`bertembed.parallel.shard_vocab`):
        each rank reads only its own rows from safetensors (a `.bin` is refused); the layer is on the mesh's device.
        The layer comes back in eval mode, as transformers' `from_pretrained` models do; `.train()` to fine-tune it.
        """
        import torch

        reader = None
        if device_mesh is not None:
            from bertembed import parallel

            reader = parallel.rank_reader(device_mesh)
        checkpoint = load_checkpoint(name_or_path, revision=revision, local_files_only=local_files_only,
                                     word_reader=reader)
        # the checkpoint's tensors replace the tables at once: nothing drawn; on the meta device only for a mesh (the
        # meta device's first draw and arange import torch._dynamo and sympy: seconds)
        with torch.device("cpu" if device_mesh is None else "meta"), _skip_init():
            layer = cls(checkpoint.config, backend=backend)
        if device_mesh is not None:
            parallel.shard_vocab(layer, device_mesh)  # (on the meta device: to_empty allocates the rank's rows alone)
        dtype = dtype or checkpoint.tensors["word_embeddings.weight"].dtype
        # (sharded: on the mesh's device, where its rows are; "cuda" is the current device, as torchrun users set it)
        layer = layer.to_empty(device="cpu" if device_mesh is None else device_mesh.device_type).to(dtype)
        layer.reset_buffers()  # (the checkpoint holds every parameter: only the buffers are left to fill)
        layer.load_state_dict(checkpoint.tensors)
        layer.source = checkpoint.source
        return layer.eval()

    def load_pretrained_weights(self, name_or_path: str | Path | None = None, **kwargs) -> None:
        """Replace this layer's weights with a checkpoint's; on any error the layer is left as it was."""
        checkpoint = load_checkpoint(name_or_path, **kwargs)
        if checkpoint.config != self.config:
            raise ValueError(f"checkpoint {checkpoint.source.name} has config {checkpoint.config}, this layer has "
                             f"{self.config}; build a new layer with BertEmbeddings.from_pretrained instead")
        self.load_state_dict(checkpoint.tensors)

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write config.json and an embedding-only model.safetensors (keys as the member's base model keeps them) that
        both bertembed and transformers read; returns `folder`. ValueError, before anything is written, for a layer
        that disagrees with its config. The folder is replaced as a whole, its other files kept (`atomic_folder`).
        A layer whose word table is sharded (`bertembed.parallel`): every rank calls this, the rows are gathered, the
        mesh's first rank writes, and every rank returns once it has (or raises if it failed)."""
        write = checkpoint_writer(self, folder)  # (checks first: nothing is written for a layer that cannot be saved)
        mesh = next((t.device_mesh for t in self.state_dict().values() if hasattr(t, "device_mesh")), None)
        failed = None
        if mesh is None or mesh.get_local_rank() == 0:
            try:
                with atomic_folder(folder) as staging:
                    write(staging)
            except Exception as err:
                if mesh is None:
                    raise
                failed = err
        if mesh is not None:  # (the others wait for the folder, and learn of a failure instead of reading half)
            import torch

            flag = torch.tensor([float(failed is not None)], device=mesh.device_type)
            torch.distributed.all_reduce(flag, group=mesh.get_group())
            if failed is not None:
                raise failed
            if flag.item():
                raise OSError(f"cannot save to {folder}: the mesh's first rank failed to write it (its error says why)")
        return Path(folder)
