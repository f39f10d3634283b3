"""Replacing a folder as a whole: a reader finds the whole old folder or the whole new one, even if the writer is
killed at any moment (on Linux: elsewhere see `_switch`). How, and why not a symlink: docs/checkpoints.md, "Saving".
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_folder(path: str | Path, *, keep_others: bool = True) -> Iterator[Path]:
    """Yield an empty folder beside `path`; on a clean exit it replaces `path` as a whole (created if missing; the old
    mode kept, a link kept a link), on an exception `path` is left as it was and nothing beside it. With
    `keep_others`, entries of the old `path` that the new one lacks are carried over. Any OSError, the caller's
    included, comes out as `save_error`'s, naming `path`."""
    target = _followed(path)
    if not target.name:
        raise ValueError(f"cannot save to {path}: it is a file system root; pass a folder inside it")
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"cannot save to {target}: it is a file, not a folder; pass a folder path")
    made = [p for p in target.parents if not os.path.lexists(p)]  # parents this save makes: removed if it fails
    staging = target.parent / f".{target.name}.tmp-{os.urandom(4).hex()}"  # (same file system: renames switch it)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()  # (by mkdir, so that the umask applies)
        yield staging
        if target.is_dir():
            if keep_others:
                _carry_over(target, staging)
            os.chmod(staging, stat.S_IMODE(target.stat().st_mode))
        _fsync_tree(staging)  # on the disk before the switch shows it
        _switch(staging, target)
        made = []
    except OSError as err:
        raise save_error(err, target, staging) from err
    finally:
        _remove(staging)  # unfinished new files, or (after the switch) the old ones
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()


def _followed(path: str | Path) -> Path:
    """`path`, absolute; for a link, what it points to (a save replaces that and keeps the link). FileNotFoundError
    for a link to nothing: what it would create is not where the user looks."""
    target = Path(os.path.abspath(Path(path).expanduser()))
    if target.is_symlink():
        if not target.exists():
            raise FileNotFoundError(f"cannot save to {target}: it is a link to {os.readlink(target)}, which does not "
                                    f"exist (or loops back); remove the link or make what it names")
        target = target.resolve()
    return target


def save_error(err: OSError, target: Path, staging: Path | None = None) -> OSError:
    """A failed save's OSError as one line of the same class that names `target`, why, and the fix where there is one;
    a file inside `staging` is named as it will be inside `target`, a temporary folder never."""
    why, name = err.strerror or str(err)[:300], str(err.filename or "")
    if staging is not None and name.startswith(str(staging)):
        name = os.path.relpath(name, staging) if name != str(staging) else ""
    name = "" if name == str(target) or Path(name).name.startswith(f".{target.name}.") else name
    blocker = next((p for p in target.parents if os.path.lexists(p) and not p.is_dir()), None)
    if blocker is not None:
        new: OSError = NotADirectoryError(f"cannot save to {target}: {blocker} is not a folder (a file is in the way); "
                                          f"pass a path inside a folder")
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and (  # one of the save's own files or folders
            not os.path.isabs(name) or Path(name) in target.parents):
        where = Path(name).parent if os.path.isabs(name) else target.parent
        new = PermissionError(f"cannot save to {target}: {where} refuses new files ({why}); a save writes beside "
                              f"{target.name} first and needs write access there: pass a folder you can write to")
    else:
        kept = " (it is left as it was)" if target.is_dir() else ""
        new = type(err)(f"cannot save to {target}{kept}: {why}{f' ({name})' if name else ''}")
    new.errno = err.errno
    return new


def _remove(folder: Path) -> None:
    """Delete a temporary folder, read-only folders in it included (a save gives the new folder the old one's mode,
    so after the switch the old one may be 0555): never left behind for the next save to trip on."""
    if folder.is_symlink():  # (never a link's target)
        return
    for root, _, _ in os.walk(folder):
        with contextlib.suppress(OSError):
            os.chmod(root, 0o700)
    shutil.rmtree(folder, ignore_errors=True)


def _carry_over(old: Path, new: Path) -> None:
    """Link (or copy) into `new` the entries of `old` that `new` lacks."""
    for entry in old.iterdir():
        if os.path.lexists(dest := new / entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, dest, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, dest)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:  # (a symlink is linked or copied as a link)
        os.link(src, dst, follow_symlinks=False)  # the old folder is deleted after the switch: the new one owns it
    except (OSError, NotImplementedError):
        shutil.copy2(src, dst, follow_symlinks=False)


def _fsync_tree(folder: Path) -> None:
    """Flush every file, and on POSIX every folder, under and at `folder`."""
    for root, _, names in os.walk(folder, topdown=False):
        for path in [os.path.join(root, name) for name in names] + [root] * (os.name == "posix"):
            if not os.path.islink(path):
                _fsync(path)


def _fsync(path: str | Path) -> None:  # (a folder too: its entries)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _switch(staging: Path, target: Path) -> None:
    """Make `staging` the folder at `target`; afterwards `staging` holds the old files (or nothing). Where the exchange
    is missing, two renames: a save killed between them leaves no `target`, the old folder whole at `old`."""
    if not target.exists():
        os.rename(staging, target)  # (replaces an empty folder made meanwhile; fails if one with files appeared)
    elif not _exchange(staging, target):
        old = target.with_name(f".{target.name}.old-{os.urandom(4).hex()}")
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(old, target)
            raise
        os.rename(old, staging)  # so that the caller's cleanup deletes the old files
    if os.name == "posix":
        _fsync(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one step with Linux's renameat2(RENAME_EXCHANGE); False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # (here, not at the top: the command line imports this module)

    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "renameat2") and libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:
        return True  # (-100: AT_FDCWD, 2: RENAME_EXCHANGE)
    code = ctypes.get_errno() if hasattr(libc, "renameat2") else errno.ENOSYS
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False  # an old kernel or a file system without the exchange: two renames instead
    raise OSError(code, os.strerror(code), str(b))


def check_output(path: str | Path) -> Path:
    """Fail early, before any work, if `path` cannot be written: its folder must exist and be writable."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give the name of a file in it")
    if not path.parent.is_dir():
        what = "is a file, not a folder" if path.parent.exists() else "does not exist; create it first"
        raise ValueError(f"cannot write {path}: {path.parent} {what}")
    if not os.access(path.parent, os.W_OK):
        raise ValueError(f"cannot write {path}: the folder {path.parent} is not writable")
    return path


def write_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to a temporary file beside `path` (for a link, beside what it points to), then rename it into place
    (all or nothing)."""
    target = _followed(path := check_output(path))
    tmp = target.with_name(f".{target.name}.{os.urandom(6).hex()}.tmp")
    try:
        with open(tmp, "xb") as handle:  # (a new file, with the permissions open() gives under the umask)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())  # (on the disk before the rename shows it: a crash finds old or new, never empty)
        os.replace(tmp, target)
    except OSError as err:
        raise save_error(err, target) from err
    finally:
        tmp.unlink(missing_ok=True)
    return path
