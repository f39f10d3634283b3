"""Replacing a folder as a whole: a reader finds the whole old folder or the whole new one, even if the writer is
killed at any moment.

How: the new files are written into a fresh sibling folder `.NAME.tmp-PID-XXXXXXXX` (same parent, so the same file
system), flushed to disk, and switched in
- on Linux by one `renameat2(RENAME_EXCHANGE)`, which swaps the two folders in a single atomic step: NAME is never
  missing, and the old files, now under the temporary name, are deleted after;
- elsewhere (or where a file system refuses the exchange) by two renames, NAME -> `.NAME.old-PID-XXXXXXXX` and the
  new folder -> NAME. A crash between the two leaves NAME missing and `.NAME.old-*` whole: loaders read that one
  (`interrupted_save`), and the next save renames it back first.
Making NAME a symlink to versioned folders would also switch in one step everywhere, but NAME would stop being a real
folder (git, rsync and `shutil.rmtree` treat links differently), so it was not chosen. What a killed save leaves (its
`.NAME.tmp-*`, `.NAME.old-*` folders) is removed by the next save of the same folder, once its process is gone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


@contextlib.contextmanager
def atomic_folder(path: str | Path, *, keep_others: bool = True) -> Iterator[Path]:
    """Yield an empty folder beside `path`; on a clean exit it replaces `path` as a whole (created if missing).

    Write every file of the new folder into the folder yielded. With `keep_others`, files and subfolders of the old
    `path` that the new one lacks (a tokenizer beside saved weights, say) are carried over, hard-linked where the file
    system allows, else copied. On an exception `path` is left as it was and the yielded folder is removed. The old
    folder's permissions are kept (a new one gets mkdir's); `path` may be a symlink to a folder (the folder it points
    to is replaced, the link kept), and a process whose working directory was `path` is moved into the new one.
    Raises NotADirectoryError if `path` is a file, PermissionError if its parent cannot be written (the new folder is
    made there), and OSError for other failures, all leaving `path` as it was.
    """
    target = _target(path)
    recover(target)
    staging = _make_sibling(target, "tmp")
    try:
        yield staging
        try:
            _fsync_tree(staging, files=True)  # the caller's files reach the disk before the switch shows them
            if target.is_dir():
                if keep_others:
                    _carry_over(target, staging)
                    _fsync_tree(staging, files=False)  # (files linked in are on the disk already; their entries not)
                os.chmod(staging, stat.S_IMODE(target.stat().st_mode))
            _fsync_dir(staging)
            _switch(staging, target)
        except OSError as err:
            raise os_error(err, f"cannot replace {target} (it is left as it was)") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # unfinished new files, or (after the switch) the old ones


def interrupted_save(path: str | Path) -> Path | None:
    """The whole old folder that a save killed between its two renames left beside a missing `path`, or None."""
    target = Path(os.path.abspath(Path(path).expanduser()))
    if target.exists() or not target.parent.is_dir():
        return None
    olds = []
    for old in _siblings(target, "old"):
        try:
            olds.append((old.lstat().st_mtime_ns, old))
        except OSError:  # the save finished meanwhile and removed it
            continue
    return max((o for o in olds if o[1].is_dir() and not o[1].is_symlink()), default=(0, None))[1]


def recover(path: str | Path) -> None:
    """Undo what killed saves left beside `path`: a `.NAME.old-*` renamed back where NAME is missing, then the
    temporary folders of saves whose process is gone deleted."""
    target = Path(os.path.abspath(Path(path).expanduser()))
    old = interrupted_save(target)
    if old is not None:
        log.warning("%s was missing after an interrupted save; restoring the previous version from %s", target, old)
        os.rename(old, target)
    for litter in [*_siblings(target, "tmp"), *_siblings(target, "old")]:
        if not _alive(litter.name.split("-")[-2]):
            shutil.rmtree(litter, ignore_errors=True)


def os_error(err: OSError, what: str) -> OSError:
    """`err` again, of the same class (PermissionError, ...), its message led by `what` and the file it concerns."""
    if err.errno is None:
        return OSError(f"{what}: {err}")
    where = f" ({err.filename})" if err.filename else ""
    return OSError(err.errno, f"{what}: {err.strerror}{where}")


def _target(path: str | Path) -> Path:
    """The absolute folder to replace, its parent created; a symlink stands for the folder it points to."""
    target = Path(os.path.abspath(Path(path).expanduser()))
    if target.is_symlink():
        target = target.resolve()
    if not target.name:
        raise ValueError(f"cannot save to {path}: it is a file system root; pass a folder inside it")
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"cannot save to {target}: it is a file, not a folder; pass a folder path")
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def _sibling_name(target: Path, kind: str) -> Path:
    """`.NAME.{kind}-PID-RANDOM` beside `target`: the process id tells a later save whether it is litter."""
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{os.urandom(4).hex()}"


def _make_sibling(target: Path, kind: str) -> Path:
    """A new folder `_sibling_name(target, kind)`, made by mkdir so that the umask applies."""
    folder = _sibling_name(target, kind)
    try:
        folder.mkdir()
    except PermissionError as err:
        raise PermissionError(f"cannot save to {target}: cannot create a folder in {target.parent} ({err.strerror}); "
                              f"a save replaces the folder as a whole and needs write access to its parent") from err
    return folder


def _siblings(target: Path, kind: str) -> list[Path]:
    """The `.NAME.{kind}-PID-RANDOM` entries beside `target` (`_sibling_name`)."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.{kind}-\d+-[0-9a-f]{{8}}")
    try:
        return [p for p in target.parent.iterdir() if pattern.fullmatch(p.name)]
    except OSError:
        return []


def _alive(pid: str) -> bool:
    """Whether the process that made a temporary folder may still be using it (True when it cannot be told)."""
    if os.name != "posix" or not pid.isdigit():
        return True  # (on Windows os.kill would terminate the process, not probe it)
    if int(pid) == os.getpid():
        return True  # another thread's save, perhaps: every save of this process removes its own
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _carry_over(old: Path, new: Path) -> None:
    """Link (or copy) into `new` the entries of `old` that `new` lacks, recursing into folders both have."""
    for entry in old.iterdir():
        dest = new / entry.name
        if entry.is_dir() and not entry.is_symlink():
            if not dest.exists() and not dest.is_symlink():
                shutil.copytree(entry, dest, symlinks=True, copy_function=_link_or_copy)
            elif dest.is_dir() and not dest.is_symlink():
                _carry_over(entry, dest)
        elif not dest.exists() and not dest.is_symlink():
            if entry.is_symlink():
                os.symlink(os.readlink(entry), dest)
            else:
                _link_or_copy(entry, dest)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)  # the old folder is deleted after the switch, so the new one ends up the only owner
    except OSError:
        shutil.copy2(src, dst)


def _fsync_tree(folder: Path, files: bool) -> None:
    """Flush the folders under `folder` (not `folder` itself) and, with `files`, every file in them."""
    for root, dirs, names in os.walk(folder):
        for name in names if files else ():
            path = os.path.join(root, name)
            if not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        for name in dirs:
            _fsync_dir(Path(root, name))


def _fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (POSIX only: Windows cannot open a folder)."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _switch(staging: Path, target: Path) -> None:
    """Make `staging` the folder at `target`; afterwards `staging` holds the old files (or nothing)."""
    in_it = _is_cwd(target)
    if not target.exists():
        os.rename(staging, target)  # (replaces an empty folder made meanwhile; fails if one with files appeared)
    elif not _exchange(staging, target):
        old = _sibling_name(target, "old")
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(old, target)
            raise
        os.rename(old, staging)  # so that the caller's cleanup deletes the old files
    _fsync_dir(target.parent)
    if in_it:
        os.chdir(target)


def _is_cwd(target: Path) -> bool:
    try:
        return os.path.samefile(os.getcwd(), target)
    except OSError:
        return False


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_libc: list = []


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one step with Linux's renameat2(RENAME_EXCHANGE); False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # (here, not at the top: the command line imports this module on every start)

    if not _libc:
        libc = ctypes.CDLL(None, use_errno=True)
        _libc.append(getattr(libc, "renameat2", None))
    renameat2 = _libc[0]
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False  # an old kernel or a file system without the exchange: two renames instead
    raise OSError(code, os.strerror(code), str(b))


def check_output(path: str | Path) -> Path:
    """Fail early, before any work, if `path` cannot be written: its folder must exist and be writable."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give the name of a file in it")
    if not path.parent.is_dir():
        raise ValueError(f"cannot write {path}: the folder {path.parent} does not exist; create it first")
    if not os.access(path.parent, os.W_OK):
        raise ValueError(f"cannot write {path}: the folder {path.parent} is not writable")
    return path


def write_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to a temporary file beside `path`, then rename it into place (all or nothing)."""
    path = check_output(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the permissions open() would
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
