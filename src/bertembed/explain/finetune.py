"""Does fine-tuning change the embedding tables? A short, deterministic fine-tune (a few sentiment sentences, the
embedding layer plus a mean-pool and linear head, seconds on a CPU) that counts the rows that move with Adam, AdamW
and a frozen word table (docs/how-bert-embeddings-work.md, section 6). B batch, L length, H hidden."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bertembed.explain._common import Result

SENTENCES = (
    ("a wonderful, moving film", 1), ("i loved every minute of it", 1), ("great acting and a clever plot", 1),
    ("the best meal we had all year", 1), ("a dull and tedious mess", 0), ("i hated the ending", 0),
    ("boring, slow and far too long", 0), ("the worst service we have ever had", 0),
)
TABLES = {"word": "word_embeddings", "position": "position_embeddings", "segment": "token_type_embeddings"}


@dataclass(frozen=True)
class RunSpec:
    """One optimiser setting of the demo."""

    name: str
    weight_decay: float = 0.0  # > 0 selects AdamW (decoupled decay), 0 plain Adam
    frozen: tuple[str, ...] = ()  # table names ("word", ...) whose requires_grad is switched off


DEFAULT_RUNS = (RunSpec("Adam, no weight decay"), RunSpec("AdamW, weight decay 0.01", weight_decay=0.01),
                RunSpec("Adam, word table frozen", frozen=("word",)))


@dataclass
class TableChange:
    """How one table moved in one run."""

    table: str
    rows: int
    moved: int  # rows with any element changed
    expected: int  # rows the theory says move in this run
    max_abs_change: float
    median_relative_change: float  # median over moved rows of |row after - row before| / |row before|
    moved_rows: list[int] = field(repr=False)


@dataclass
class RunResult:
    spec: RunSpec
    loss_first: float
    loss_last: float
    tables: list[TableChange]
    row_change: dict[str, np.ndarray] = field(repr=False)  # per table, |delta| per row


@dataclass
class FinetuneReport(Result):
    """Which parameters train by default, which rows occurred, and what each run moved."""

    rows_title = "rows moved per run and table"

    model: str
    trainable: list[dict]  # {"name", "shape", "requires_grad"} of BertEmbeddings.named_parameters()
    occurred: dict[str, list[int]]  # rows that received gradient: unpadded token ids (not [PAD]), positions, segments
    runs: list[RunResult]
    steps: int
    lr: float
    seconds: float
    sentences: tuple = SENTENCES

    def summary(self) -> dict:
        out = {"model": self.model, "steps": self.steps, "lr": self.lr, "seconds": self.seconds,
               "trainable_by_default": all(p["requires_grad"] for p in self.trainable)}
        out |= {f"occurred_{k}": len(v) for k, v in self.occurred.items()}
        for i, run in enumerate(self.runs):
            out |= {f"run{i}_{t.table}_moved": f"{t.moved}/{t.rows}" for t in run.tables}
        return out

    def rows(self) -> list[dict]:
        """One dict per run and table, for tables and JSON."""
        return [{"run": r.spec.name, "table": t.table, "moved": t.moved, "rows": t.rows, "expected": t.expected,
                 "max_abs_change": t.max_abs_change, "median_relative_change": t.median_relative_change}
                for r in self.runs for t in r.tables]


def occurred_rows(enc, pad_id: int) -> dict[str, list[int]]:
    """Rows that get a non-zero gradient: the ids, positions and segments at unpadded places, [PAD] excluded."""
    mask = enc.attention_mask.bool()
    positions = mask.nonzero()[:, 1].unique()
    return {"word": sorted(set(enc.input_ids[mask].tolist()) - {pad_id}), "position": positions.tolist(),
            "segment": sorted(set(enc.token_type_ids[mask].tolist()))}


def _expected(spec: RunSpec, name: str, occurred: list[int], before) -> int:
    """Rows the theory says move: Adam leaves a row whose gradient was always zero exactly as it was."""
    if name in spec.frozen:
        return 0
    if spec.weight_decay > 0:  # decay moves every row that is not exactly zero, plus the rows with gradient
        return int(((before != 0).any(1).numpy() | np.isin(np.arange(before.shape[0]), occurred)).sum())
    return len(occurred)


def _changes(spec, start: dict, layer, occurred) -> tuple[list[TableChange], dict]:
    out, per_row = [], {}
    for name, attr in TABLES.items():
        module = getattr(layer, attr)
        if module is None or not hasattr(module, "weight") or f"{attr}.weight" not in start:
            continue
        before, after = start[f"{attr}.weight"], module.weight.detach()
        delta = (after - before).double()
        moved = (after != before).any(1).nonzero()[:, 0]
        rel = delta.norm(dim=1)[moved] / before.double().norm(dim=1)[moved].clamp_min(1e-30)
        per_row[name] = delta.norm(dim=1).numpy()
        out.append(TableChange(name, before.shape[0], len(moved), _expected(spec, name, occurred[name], before),
                               float(delta.abs().max()), float(rel.median()) if len(moved) else 0.0,
                               moved.tolist()))
    return out, per_row


def _run(spec: RunSpec, start: dict, config, enc, labels, steps: int, lr: float, seed: int,
         progress: Callable[[str, int, int], None] | None):
    import torch
    from torch import nn

    from bertembed.embeddings import BertEmbeddings

    torch.manual_seed(seed)
    layer = BertEmbeddings(config)
    layer.load_state_dict(start)
    head = nn.Linear(config.output_width, 2)
    for name in spec.frozen:
        getattr(layer, TABLES[name]).weight.requires_grad_(False)
    params = [p for p in [*layer.parameters(), *head.parameters()] if p.requires_grad]
    opt = (torch.optim.AdamW(params, lr=lr, weight_decay=spec.weight_decay) if spec.weight_decay > 0
           else torch.optim.Adam(params, lr=lr, weight_decay=0.0))
    mask = enc.attention_mask[..., None].float()
    layer.train()
    losses = []
    for step in range(steps):
        pooled = (layer(enc.input_ids, enc.token_type_ids) * mask).sum(1) / mask.sum(1)
        loss = nn.functional.cross_entropy(head(pooled), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if progress:
            progress(spec.name, step + 1, steps)
    return layer, losses


def finetune_demo(model=None, *, steps: int = 12, lr: float = 1e-3, seed: int = 0, runs=DEFAULT_RUNS,
                  sentences=SENTENCES, progress: Callable[[str, int, int], None] | None = None,
                  save: str | Path | None = None) -> FinetuneReport:
    """Fine-tune the embedding layer of `model` (default: bundled) on `sentences` once per run. `progress(run_name,
    step, steps)` is called after every step. `save`: a new (or empty) folder for the first run's fine-tuned layer
    and the tokenizer files (checked before anything runs, written whole or not at all)."""
    import torch

    from bertembed.embeddings import BertEmbeddings
    from bertembed.tokenizer import Tokenizer

    if steps < 1:
        raise ValueError(f"steps={steps}: run at least 1 step")
    if not lr > 0:
        raise ValueError(f"lr={lr}: the learning rate must be positive, e.g. 1e-3")
    if save is not None:
        check_save_folder(save)
    base = BertEmbeddings.from_pretrained(model)
    start = {k: v.detach().clone() for k, v in base.state_dict().items()}
    tokenizer = Tokenizer.from_pretrained(model)
    for i, (sentence, _) in enumerate(sentences):
        tokenizer.require_tokens(sentence, f"sentence {i}")
    enc = tokenizer([s for s, _ in sentences], return_tensors="pt")  # padded into one batch: [B, L] tensors
    labels = torch.tensor([label for _, label in sentences])
    occurred = occurred_rows(enc, base.config.pad_token_id)
    trainable = [{"name": n, "shape": list(p.shape), "requires_grad": p.requires_grad}
                 for n, p in base.named_parameters()]
    began, results = time.perf_counter(), []
    for i, spec in enumerate(runs):
        layer, losses = _run(spec, start, base.config, enc, labels, steps, lr, seed, progress)
        tables, per_row = _changes(spec, start, layer, occurred)
        results.append(RunResult(spec, losses[0], losses[-1], tables, per_row))
        if save is not None and i == 0:
            save_with_tokenizer(layer, base.source, save)
    return FinetuneReport(model=base.source.name, trainable=trainable, occurred=occurred, runs=results, steps=steps,
                          lr=lr, seconds=time.perf_counter() - began, sentences=tuple(sentences))


def check_save_folder(folder: str | Path) -> Path:
    """Fail before any work unless `folder` is new (or empty) and can be made in its existing parent (tried, not
    guessed from permissions)."""
    folder = Path(folder).expanduser()
    try:
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"cannot save to {folder}: it is a file; give the name of a new folder")
        if folder.is_dir() and any(folder.iterdir()):
            raise ValueError(f"cannot save to {folder}: the folder is not empty; give the name of a new folder")
        if not folder.parent.is_dir():
            raise ValueError(f"cannot save to {folder}: {folder.parent} is not an existing folder; create it first")
        tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.").cleanup()
    except OSError as err:
        raise ValueError(f"cannot save to {folder}: {err.strerror or err}") from err
    return folder


def save_with_tokenizer(layer, source, folder: str | Path) -> Path:
    """Save an embedding layer with its checkpoint's tokenizer files into `folder`, all or nothing
    (`atomic_folder`): a failure or Ctrl-C leaves no folder, partial or temporary."""
    from bertembed.atomic import atomic_folder
    from bertembed.checkpoint import checkpoint_writer

    folder = check_save_folder(folder)
    write = checkpoint_writer(layer, folder)
    try:
        with atomic_folder(folder, keep_others=False) as staging:
            write(staging)
            for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                path = source.file(name)
                if path is not None:
                    shutil.copyfile(path, staging / name)
    except OSError as err:  # the disk filled up, a folder with files appeared meanwhile: nothing was written
        why = err.strerror or str(err)
        raise ValueError(why if why.startswith("cannot ") else f"cannot save to {folder}: {why}") from err
    return folder
