"""Does fine-tuning change the embedding tables? A short, deterministic fine-tune (the embedding layer, a mean-pool
and a linear head on a few sentences) counting the rows that move (docs/how-bert-embeddings-work.md, section 6)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bertembed.explain._common import STRUCTURAL, Figure, ModelArg, Result, axes, load_layer, plotly_fig
from bertembed.sources import Source

SENTENCES = (
    ("a wonderful, moving film", 1), ("i loved every minute of it", 1), ("great acting and a clever plot", 1),
    ("the best meal we had all year", 1), ("a dull and tedious mess", 0), ("i hated the ending", 0),
    ("boring, slow and far too long", 0), ("the worst service we have ever had", 0),
)
TABLES = {"word": "word_embeddings", "position": "position_embeddings", "segment": "token_type_embeddings"}


@dataclass(frozen=True)
class RunSpec:  # one optimiser setting of the demo
    name: str
    weight_decay: float = 0.0  # > 0 selects AdamW (decoupled decay), 0 plain Adam
    frozen: tuple[str, ...] = ()  # table names ("word", ...) whose requires_grad is switched off


DEFAULT_RUNS = (RunSpec("Adam, no weight decay"), RunSpec("AdamW, weight decay 0.01", weight_decay=0.01),
                RunSpec("Adam, word table frozen", frozen=("word",)))


@dataclass
class TableChange:  # how one table moved in one run
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

    question = "Does fine-tuning change the tables?"
    answer = ("Every table is a trainable parameter: which rows move depends on which tokens, positions and segments "
              "occur, and on the optimiser. The demo's magnitudes are a toy's (its learning rate, its two-class head); "
              "which rows move is not.")
    rows_title = "rows moved per run and table"
    tag = STRUCTURAL

    source: Source
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
        return [{"run": r.spec.name, "table": t.table, "moved": t.moved, "rows": t.rows, "expected": t.expected,
                 "max_abs_change": t.max_abs_change, "median_relative_change": t.median_relative_change}
                for r in self.runs for t in r.tables]

    def figures(self) -> list[Figure]:
        runs = "; ".join(f"{r.spec.name}: {', '.join(f'{t.table} {t.moved}/{t.rows}' for t in r.tables)} (loss "
                         f"{r.loss_first:.3f} -> {r.loss_last:.3f})" for r in self.runs)
        used = [f"{len(self.occurred[t])} {what}" for t, what in (("word", "distinct tokens"),
                                                                  ("position", "positions"), ("segment", "segment(s)"))
                if self.occurred[t]]
        rows = (f"{self.steps} steps on {len(self.sentences)} sentences, lr {self.lr:g}. Rows moved per table: {runs}. "
                f"The sentences use {', '.join(used)} (of the tables this member has); every row that moved is one "
                f"of them unless weight decay is on. All {len(self.trainable)} embedding parameters are trainable by "
                f"default.")
        figures = [Figure("finetune_rows", "Rows moved by fine-tuning", rows, self.plot_rows, self.plotly_rows)]
        if not self.occurred["position"]:  # (no position table: ModernBERT's and DeBERTa's positions are in attention)
            return figures
        used = self.occurred["position"]
        positions = (f"Change of each of the first position rows. With Adam and no weight decay, position rows "
                     f"{used[0]}-{used[-1]} (the longest sentence's) move and every other row stays exactly equal "
                     f"(change 0); AdamW's decay nudges every row that is not zero; freezing the word table does not "
                     f"stop the position table from training.")
        return figures + [Figure("finetune_positions", "Position rows after fine-tuning", positions,
                                 self.plot_positions, self.plotly_positions)]

    def plotly_rows(self):
        traces = [{"type": "bar", "name": run.spec.name, "x": [t.table for t in run.tables],
                   "y": [t.moved or None for t in run.tables], "customdata": [[t.moved, t.rows] for t in run.tables],
                   "hovertemplate": f"{run.spec.name}, %{{x}}: %{{customdata[0]}} of %{{customdata[1]}} rows moved"
                                    f"<extra></extra>"} for run in self.runs]
        return plotly_fig(traces, f"Fine-tuning for {self.steps} steps: rows moved (none: no bar)", "table",
                          "rows that moved (log)", yaxis={"type": "log"})

    def plotly_positions(self, first: int = 24):
        traces = [{"type": "scatter", "mode": "lines+markers", "name": run.spec.name, "y": change[:first],
                   "hovertemplate": f"{run.spec.name}, position %{{x}}: |change| %{{y:.3g}}<extra></extra>"}
                  for run in self.runs if (change := run.row_change.get("position")) is not None]
        end = max(self.occurred["position"]) + 0.5
        return plotly_fig(traces, "Position rows after fine-tuning (dashed: the longest sentence ends)", "position",
                          "|row after - row before|", shapes=[{"type": "line", "yref": "paper", "x0": end, "x1": end,
                                                               "y0": 0, "y1": 1, "line": {"dash": "dash"}}])

    def plot_rows(self, ax=None):
        """Rows moved per table in each run (log scale), with the table sizes for reference."""
        fig, ax = axes(ax)
        width = 0.8 / len(self.runs)
        for i, run in enumerate(self.runs):
            x = np.arange(len(run.tables)) + (i - (len(self.runs) - 1) / 2) * width
            moved = [t.moved for t in run.tables]
            # a log axis has no 0: a table with no row moved gets no bar, only its "0" label at the axis
            bars = ax.bar(x, [m if m > 0 else np.nan for m in moved], width, label=run.spec.name)
            ax.bar_label(bars, labels=[str(m) if m > 0 else "" for m in moved], fontsize=7)
            for xi in x[np.equal(moved, 0)]:
                ax.annotate("0", (xi, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(self.runs[0].tables)), [f"{t.table}\n({t.rows} rows)" for t in self.runs[0].tables])
        ax.set(yscale="log", ylabel="rows that moved (log)", title=f"Fine-tuning for {self.steps} steps: rows moved")
        ax.legend(fontsize=8)
        return fig

    def plot_positions(self, ax=None, first: int = 24):
        """|change| of the first position rows in each run: only positions that occurred move under Adam."""
        fig, ax = axes(ax)
        for run, style in zip(self.runs, ("-o", "--s", ":^", "-.d"), strict=False):
            if (change := run.row_change.get("position")) is not None:
                ax.plot(range(min(first, len(change))), change[:first], style, ms=4, label=run.spec.name)
        ax.axvline(max(self.occurred["position"]) + 0.5, color="k", ls="--", lw=0.8, label="longest sentence ends")
        ax.set(xlabel="position", ylabel="|row after - row before|", title="Position rows after fine-tuning",
               yscale="symlog", ylim=(0, None))
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.legend(fontsize=8)
        return fig


def _run(spec: RunSpec, start: dict, config, enc, labels, occurred: dict, steps: int, lr: float, seed: int,
         progress: Callable[[str, int, int], None] | None) -> tuple[RunResult, object]:
    """One run of the demo: its losses and, per table, the rows it moved against those theory says move."""
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
    tables, per_row = [], {}
    for name, attr in TABLES.items():
        if f"{attr}.weight" not in start:  # (a table the member lacks)
            continue
        before, after = start[f"{attr}.weight"], getattr(layer, attr).weight.detach()
        delta = (after - before).double()
        moved = (after != before).any(1).nonzero()[:, 0]
        relative = delta.norm(dim=1)[moved] / before.double().norm(dim=1)[moved].clamp_min(1e-30)
        per_row[name] = delta.norm(dim=1).numpy()
        if name in spec.frozen:
            expected = 0
        elif spec.weight_decay > 0:  # decay moves every row that is not exactly zero, and the rows with gradient
            expected = int(((before != 0).any(1).numpy() | np.isin(np.arange(before.shape[0]), occurred[name])).sum())
        else:  # Adam leaves a row whose gradient was always zero exactly as it was
            expected = len(occurred[name])
        tables.append(TableChange(name, before.shape[0], len(moved), expected, float(delta.abs().max()),
                                  float(relative.median()) if len(moved) else 0.0, moved.tolist()))
    return RunResult(spec, losses[0], losses[-1], tables, per_row), layer


def finetune_demo(model: ModelArg = None, *, steps: int = 12, lr: float = 1e-3, seed: int = 0, runs=DEFAULT_RUNS,
                  sentences=SENTENCES, progress: Callable[[str, int, int], None] | None = None,
                  save: str | Path | None = None) -> FinetuneReport:
    """Fine-tune the embedding layer of `model` on `sentences` once per run, calling `progress(run_name, step, steps)`
    after every step. `save`: a new (or empty) folder for the first run's layer and tokenizer, checked first."""
    import torch

    from bertembed.atomic import atomic_folder
    from bertembed.checkpoint import checkpoint_writer
    from bertembed.embeddings import BertEmbeddings
    from bertembed.functional import default_positions

    if steps < 1:
        raise ValueError(f"steps={steps}: run at least 1 step")
    if not lr > 0:
        raise ValueError(f"lr={lr}: the learning rate must be positive, e.g. 1e-3")
    folder = check_save_folder(save) if save is not None else None
    checkpoint = load_layer(model)
    source, tokenizer = checkpoint.source, checkpoint.tokenizer
    base = BertEmbeddings.from_pretrained(source)
    start = {k: v.detach().clone() for k, v in base.state_dict().items()}
    for i, (sentence, _) in enumerate(sentences):
        tokenizer.require_tokens(sentence, f"sentence {i}")
    enc = tokenizer([s for s, _ in sentences], return_tensors="pt")  # padded into one batch: [B, L] tensors
    labels = torch.tensor([label for _, label in sentences])
    mask = enc.attention_mask.bool()  # the rows with gradient: ids (not [PAD]), positions, segments at unpadded places
    config = base.config  # (positions as the layer counts them: from pad + 1 for RoBERTa and MPNet)
    positions = default_positions(mask.shape[1], 0, enc.input_ids,
                                  config.pad_token_id if config.positions_from_padding else None)
    occurred = {"word": sorted(set(enc.input_ids[mask].tolist()) - {config.pad_token_id}),
                "position": sorted(set(positions.expand_as(mask)[mask].tolist())),
                "segment": sorted(set(enc.token_type_ids[mask].tolist()))}
    occurred |= {name: [] for name, table in (("position", base.position_embeddings),  # (a table the member lacks)
                                              ("segment", base.token_type_embeddings)) if table is None}
    trainable = [{"name": n, "shape": list(p.shape), "requires_grad": p.requires_grad}
                 for n, p in base.named_parameters()]
    began, results = time.perf_counter(), []
    for i, spec in enumerate(runs):
        result, layer = _run(spec, start, base.config, enc, labels, occurred, steps, lr, seed, progress)
        results.append(result)
        if folder is not None and i == 0:  # (all or nothing: a failure or Ctrl-C leaves no folder, nor a partial one)
            write = checkpoint_writer(layer, folder)
            with atomic_folder(folder, keep_others=False) as staging:
                write(staging)
                for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                    if (path := source.file(name)) is not None:
                        shutil.copyfile(path, staging / name)
    return FinetuneReport(source=source, trainable=trainable, occurred=occurred, runs=results, steps=steps,
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

