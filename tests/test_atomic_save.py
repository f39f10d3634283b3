"""Saves replace the checkpoint folder as a whole (`bertembed.atomic`): other files kept, failures change nothing, and
neither a save killed at any moment nor a reader racing a save ever finds a mix of two versions."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from bertembed import BertEmbeddings


def _tagged_layer(tag: str, vocab: int = 50) -> BertEmbeddings:
    """A layer whose config (eps, extra tag) and tables both say which save it came from, so a mix shows."""
    from bertembed import EmbeddingConfig

    torch.manual_seed(ord(tag))
    eps = {"A": 1e-12, "B": 1e-6}[tag]
    return BertEmbeddings(EmbeddingConfig(vocab_size=vocab, hidden_size=64, max_position_embeddings=32,
                                          layer_norm_eps=eps, extra={"tag": tag}))


def _whole(folder: Path, refs: dict, tokenizer: bool = True) -> str:
    """Which of the reference layers the folder holds, asserting it holds all of one (and the tokenizer beside)."""
    layer = BertEmbeddings.from_pretrained(folder)
    tag = layer.config.extra["tag"]
    assert layer.config == refs[tag].config
    for name, value in refs[tag].state_dict().items():
        assert torch.equal(layer.state_dict()[name], value), (tag, name)
    assert not tokenizer or (layer.source.folder / "vocab.txt").read_text() == "[PAD]\n[UNK]\n"
    return tag


def test_save_keeps_other_files_and_leaves_no_litter(tmp_path):
    target = tmp_path / "model"
    _tagged_layer("A").save_pretrained(target)
    (target / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text("{}")
    (target / "link").symlink_to("vocab.txt")
    target.chmod(0o750)
    refs = {"A": _tagged_layer("A"), "B": _tagged_layer("B")}
    inode = target.stat().st_ino
    refs["B"].save_pretrained(target)
    assert _whole(target, refs) == "B"
    assert target.stat().st_ino != inode  # a new folder was switched in, not files rewritten in place
    assert (target / "1_Pooling" / "config.json").read_text() == "{}" and os.readlink(target / "link") == "vocab.txt"
    assert target.stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    (tmp_path / "alias").symlink_to(target)  # through a link: the folder it points to is replaced, the link kept
    refs["A"].save_pretrained(tmp_path / "alias")
    assert (tmp_path / "alias").is_symlink() and _whole(target, refs) == "A"


@pytest.mark.parametrize("failure", ["safetensors error", "switch fails", "parent read-only", "a file"])
def test_a_failed_save_raises_clearly_and_changes_nothing(tmp_path, monkeypatch, failure):
    import errno

    from safetensors import SafetensorError

    target = tmp_path / "model"
    _tagged_layer("A").save_pretrained(target)
    if failure == "a file":
        target = tmp_path / "file"
        target.write_text("x")
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def refuse(*args, **kwargs):
        raise SafetensorError("I/O error: No space left on device")

    def switch_fails(staging, target):
        raise OSError(errno.EIO, "Input/output error", str(target))

    original_mkdir = Path.mkdir

    def read_only_parent(self, *args, **kwargs):
        if self.name.startswith(".model.tmp-"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return original_mkdir(self, *args, **kwargs)

    expected = {"safetensors error": (OSError, "cannot save to .*model.safetensors failed.*No space left"),
                "switch fails": (OSError, r"cannot save to .*model \(it is left as it was\): Input/output error$"),
                "parent read-only": (PermissionError, "cannot save to .*model: .* refuses new files .*needs write "
                                                      "access there"),
                "a file": (NotADirectoryError, "it is a file, not a folder")}[failure]
    if failure == "safetensors error":
        monkeypatch.setattr("safetensors.torch.save_file", refuse)
    elif failure == "switch fails":
        monkeypatch.setattr("bertembed.atomic._switch", switch_fails)
    elif failure == "parent read-only":
        monkeypatch.setattr(Path, "mkdir", read_only_parent)
    with pytest.raises(expected[0], match=expected[1]):
        _tagged_layer("B").save_pretrained(target)
    assert {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # and no temporary folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "model"][failure != "a file":]


def test_atomic_folder_helper(tmp_path):
    from bertembed.atomic import atomic_folder

    target = tmp_path / "out"
    with atomic_folder(target) as staging:
        assert staging.parent == tmp_path and list(staging.iterdir()) == []
        (staging / "a.txt").write_text("1")
        (staging / "b.txt").write_text("1")
    with pytest.raises(KeyError), atomic_folder(target) as staging:
        (staging / "a.txt").write_text("2")
        raise KeyError("the caller failed half way")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (target / "a.txt").read_text() == "1"
    with atomic_folder(target) as staging:
        (staging / "a.txt").write_text("3")
    assert [(target / n).read_text() for n in ("a.txt", "b.txt")] == ["3", "1"]  # b.txt carried over
    with atomic_folder(target, keep_others=False) as staging:
        (staging / "a.txt").write_text("4")
    assert [p.name for p in target.iterdir()] == ["a.txt"]


def test_where_the_exchange_is_missing_two_renames_switch_the_folder(tmp_path, monkeypatch):
    """Without Linux's exchange the old folder is renamed aside, the new one in, and the old one removed; a failing
    second rename puts the old folder back."""
    import errno

    import bertembed.atomic

    monkeypatch.setattr(bertembed.atomic, "_exchange", lambda a, b: False)
    refs = {"A": _tagged_layer("A"), "B": _tagged_layer("B")}
    target = tmp_path / "model"
    refs["A"].save_pretrained(target)
    (target / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    refs["B"].save_pretrained(target)
    assert _whole(target, refs) == "B" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    rename = os.rename

    def second_fails(src, dst):
        if Path(src).name.startswith(".model.tmp-"):
            raise OSError(errno.EIO, "Input/output error", str(dst))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", second_fails)
    with pytest.raises(OSError, match="Input/output error"):
        refs["A"].save_pretrained(target)
    assert _whole(target, refs) == "B" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# the file system operations a save makes, as Python's audit hooks report them (renameat2, called through ctypes,
# comes between its `ctypes.dlsym` and the next one)
_STEPS = {"open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.chmod", "os.link", "os.scandir", "os.listdir",
          "shutil.rmtree", "shutil.copyfile", "ctypes.dlopen", "ctypes.dlsym"}


def _save_killed_at(step: int, write, target: Path) -> bool:
    """Save with `write` into `target` in a forked child that SIGKILLs itself at its `step`-th file system operation
    (no cleanup runs, as for a crash); whether it was killed (False: the save finished first)."""
    from bertembed.atomic import atomic_folder

    pid = os.fork()
    if pid == 0:  # (the child never returns into pytest)
        try:
            count = iter(range(1, 10**6))
            sys.addaudithook(lambda event, args: event in _STEPS and next(count) == step
                             and os.kill(os.getpid(), signal.SIGKILL))
            with atomic_folder(target) as staging:
                write(staging)
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1] == signal.SIGKILL


@pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked child")
@pytest.mark.parametrize("mode", ["exchange", "two renames"])
def test_a_save_killed_at_any_moment_leaves_a_whole_checkpoint(tmp_path, monkeypatch, mode):
    """A real kill at each of a save's file system operations in turn, until a save finishes: each leaves the whole
    old checkpoint or the whole new one (and the killed save's `.model.tmp-*` or `.old-*` folder). Only two renames,
    where the exchange is missing, leave a moment without `model`: the old folder is whole beside it, as
    docs/checkpoints.md says, and renaming it back restores the checkpoint."""
    import bertembed.atomic
    from bertembed.checkpoint import checkpoint_writer

    if mode == "two renames":
        monkeypatch.setattr(bertembed.atomic, "_exchange", lambda a, b: False)
    refs = {"A": _tagged_layer("A"), "B": _tagged_layer("B")}
    target = tmp_path / "model"
    refs["A"].save_pretrained(target)
    (target / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    writers = {tag: checkpoint_writer(layer, target) for tag, layer in refs.items()}  # (torch's work before the fork)
    seen, step, tag = [], 1, "A"
    while _save_killed_at(step, writers["B" if tag == "A" else "A"], target):
        if not target.exists():
            assert mode == "two renames"
            (old,) = tmp_path.glob(".model.old-*")
            old.rename(target)
        tag = _whole(target, refs)
        seen.append(tag)
        step += 1
    assert _whole(target, refs) != tag  # the save that was not killed switched the other version in
    assert "A" in seen and "B" in seen and step > 10, seen  # kills landed before and after the switch
    assert {p.name.split("-")[0] for p in tmp_path.iterdir()} <= {"model", ".model.tmp", ".model.old"}


def test_a_reader_never_sees_two_saves_mixed(tmp_path, monkeypatch):
    """A save that switches in a new version after a load read config.json and before it reads the weights (made to
    happen there): the load reads again and finds one version whole, never one's config with the other's tables; a
    folder replaced during every read is refused after five."""
    import bertembed.checkpoint

    refs = {"A": _tagged_layer("A"), "B": _tagged_layer("B")}
    target = tmp_path / "model"
    refs["A"].save_pretrained(target)
    weight_files, saves = bertembed.checkpoint.weight_files, iter("B")

    def saving_meanwhile(source, member=None):
        if (tag := next(saves, None)) is not None:
            refs[tag].save_pretrained(target)
        return weight_files(source, member)

    monkeypatch.setattr(bertembed.checkpoint, "weight_files", saving_meanwhile)
    assert _whole(target, refs, tokenizer=False) == "B"
    saves = iter("ABABA")
    with pytest.raises(ValueError, match="was replaced while being read, five times in a row"):
        BertEmbeddings.from_pretrained(target)
    assert _whole(target, refs, tokenizer=False) == "A"  # (the last of the five saves)


def _read_only_file_system(monkeypatch, root: Path) -> None:
    """Every folder and file made under `root` fails as on a read-only mount (os.mkdir and open, which saves use)."""
    import builtins
    import errno

    def refused(path):  # (where the folder it goes in is missing, the kernel says so first: ENOENT)
        if str(os.path.abspath(path)).startswith(str(root)) and os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    mkdir, open_ = os.mkdir, builtins.open
    monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: refused(path) or mkdir(path, *a, **k))
    monkeypatch.setattr(builtins, "open", lambda path, mode="r", *a, **k: (
        "r" not in mode and refused(path)) or open_(path, mode, *a, **k))


@pytest.mark.parametrize("case", ["under a file", "deeper under a file", "read-only file system",
                                  "read-only, parents missing", "a link that loops", "a file, read-only"])
def test_a_failed_save_says_why_in_one_line_naming_the_target_and_leaves_nothing(tmp_path, monkeypatch, case):
    """Saving under a file gave a bare FileExistsError [Errno 17]; a read-only file system an OSError naming the hidden
    staging folder; a link that loops a RuntimeError. Each is now one line naming the target, and nothing is left."""
    from bertembed.atomic import write_atomic

    (tmp_path / "afile").write_text("x")
    (tmp_path / "loop").symlink_to("loop")
    target = {"under a file": tmp_path / "afile" / "model", "deeper under a file": tmp_path / "afile" / "a" / "model",
              "read-only file system": tmp_path / "model", "read-only, parents missing": tmp_path / "a" / "b" / "model",
              "a link that loops": tmp_path / "loop", "a file, read-only": tmp_path / "model.onnx"}[case]
    if "read-only" in case:
        _read_only_file_system(monkeypatch, tmp_path)
    error, why = {"under a file": (NotADirectoryError, f"{tmp_path / 'afile'} is not a folder"),
                  "deeper under a file": (NotADirectoryError, f"{tmp_path / 'afile'} is not a folder"),
                  "a link that loops": (FileNotFoundError, "it is a link to loop, which does not exist"),
                  }.get(case, (PermissionError, f"{tmp_path} refuses new files \\(Read-only file system\\)"))
    with pytest.raises(error, match=f"^cannot save to {target}: {why}") as raised:
        if case == "a file, read-only":
            write_atomic(target, b"onnx")
        else:
            _tagged_layer("A").save_pretrained(target)
    assert "\n" not in str(raised.value) and ".tmp" not in str(raised.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "loop"]  # no staging folder, no parents made


def test_a_file_that_cannot_be_carried_over_is_named_and_the_old_checkpoint_kept(tmp_path, monkeypatch):
    """A disk that fills while the old folder's other files are carried into the new one: one OSError line naming
    that file as it is in the target (no temporary folder), and the old checkpoint whole."""
    import errno
    import shutil

    target = tmp_path / "model"
    refs = {"A": _tagged_layer("A"), "B": _tagged_layer("B")}
    refs["A"].save_pretrained(target)
    (target / "vocab.txt").write_text("[PAD]\n[UNK]\n")

    def no_link(src, dst, **kwargs):  # (another file system: the file is copied instead)
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src))

    def full(src, dst, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(shutil, "copy2", full)
    with pytest.raises(OSError, match=f"^cannot save to {target} \\(it is left as it was\\): "
                                      f"{os.strerror(errno.ENOSPC)} \\({target / 'vocab.txt'}\\)$") as raised:
        refs["B"].save_pretrained(target)
    assert raised.value.errno == errno.ENOSPC and ".tmp" not in str(raised.value)
    assert _whole(target, refs) == "A" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_saves_into_a_read_only_folder_leave_no_old_versions_behind(tmp_path, monkeypatch):
    """A save keeps the folder's mode, 0555 say, so after the switch the old version is a 0555 folder too: for a user
    the mode binds it could not be emptied, and each save left one more `.NAME.tmp-*` beside the checkpoint. Root is
    not bound by modes: a folder without write permission refuses removals here as it does for other users."""
    import errno
    import stat

    def bound(remove):
        def checked(path, *, dir_fd=None):
            folder = os.stat(dir_fd) if dir_fd is not None else os.stat(os.path.dirname(os.path.abspath(path)))
            if not folder.st_mode & stat.S_IWUSR:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return remove(path, dir_fd=dir_fd)
        return checked

    refs = {tag: _tagged_layer(tag) for tag in "AB"}
    target = tmp_path / "model"
    refs["A"].save_pretrained(target)
    (target / "sub").mkdir()
    (target / "sub" / "notes.txt").write_text("kept")
    os.chmod(target / "sub", 0o555)
    os.chmod(target, 0o555)
    monkeypatch.setattr(os, "unlink", bound(os.unlink))
    monkeypatch.setattr(os, "rmdir", bound(os.rmdir))
    for tag in "BAB":
        refs[tag].save_pretrained(target)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert _whole(target, refs, tokenizer=False) == "B" and target.stat().st_mode & 0o777 == 0o555
    assert (target / "sub" / "notes.txt").read_text() == "kept"


def test_a_file_saved_through_a_link_keeps_the_link(tmp_path):
    """write_atomic (ONNX export, reports) replaced a link by a file, leaving the file it pointed to stale; now it
    writes what the link points to, as `atomic_folder` does for a folder, and refuses a link to nothing."""
    from bertembed.atomic import write_atomic

    (tmp_path / "real.onnx").write_bytes(b"old")
    (tmp_path / "link.onnx").symlink_to("real.onnx")
    write_atomic(tmp_path / "link.onnx", b"new")
    assert (tmp_path / "link.onnx").is_symlink() and (tmp_path / "real.onnx").read_bytes() == b"new"
    (tmp_path / "dangling.onnx").symlink_to("gone/model.onnx")
    with pytest.raises(FileNotFoundError, match="dangling.onnx: it is a link to gone/model.onnx, which does not exist"):
        write_atomic(tmp_path / "dangling.onnx", b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.onnx", "link.onnx", "real.onnx"]
