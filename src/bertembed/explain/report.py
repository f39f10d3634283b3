"""The HTML report and the PNG files: every analysis of one text, its figures and their captions.

The report is one self-contained file (inline PNGs and CSS, nothing external), so it opens from disk offline. Every
file is written atomically: a failure never leaves a half-written report or PNG.
"""

from __future__ import annotations

import html
import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bertembed.atomic import write_atomic
from bertembed.explain._common import (
    ModelArg,
    NotInThisMember,
    NotMeasured,
    figure_png,
    html_table,
    img_tag,
    load_layer,
    summary_rows,
)

CSS = """body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
.scroll{overflow-x:auto;max-width:100%}table{border-collapse:collapse;font-size:.8em;margin:1em 0}
td,th{border:1px solid #ddd;padding:2px 6px;
text-align:right}th{background:#f4f4f4}caption{text-align:left;font-style:italic;padding:4px 0}
figure{margin:1.2em 0}figure img{max-width:100%;border:1px solid #eee}figcaption{font-size:.92em;color:#333}
.verdict{background:#f0f6ff;border-left:4px solid #4c72b0;padding:.5em 1em}
.tag{font-size:.75em;color:#555;border:1px solid #bbb;border-radius:3px;padding:0 4px;margin-left:.5em}"""

# Counts the images that decoded (naturalWidth > 0) into a hidden element's attributes, which the browser test reads.
CHECK_SCRIPT = """<script>window.addEventListener("load",function(){var i=document.images,n=0;
for(var k=0;k<i.length;k++){if(i[k].complete&&i[k].naturalWidth>0)n++;}
var p=document.getElementById("image-check");
p.setAttribute("data-loaded",n);p.setAttribute("data-total",i.length);});</script>"""
STRUCTURAL, MEASURED = "holds for every BERT checkpoint", "measured on this checkpoint"
INTRO = ("Before any attention layer runs, the model turns text into vectors: each token's id picks a row of the "
         "word table, its position a row of the position table, its segment a row of the segment table; the rows "
         "are summed and LayerNorm normalises the sum. Each section below answers one question people ask about "
         "this layer, by measuring it on the checkpoint named above. Tags say whether a claim holds for every BERT "
         "checkpoint (the structure of the layer) or was measured on this one (its numbers).")


@dataclass
class Section:
    title: str
    intro: str  # plain text, escaped when rendered
    table: str = ""  # ready HTML
    figures: list[tuple[str, bytes, str]] = field(default_factory=list)  # (title, png, caption)
    tag: str = MEASURED


@dataclass
class Report:
    title: str
    model: str
    sections: list[Section]

    def to_html(self) -> str:
        """The whole report as one HTML string."""
        body = [f"<h1>{html.escape(self.title)}</h1>", f"<p>checkpoint: {html.escape(self.model)}</p>",
                f"<p>{html.escape(INTRO)}</p><ol>"]
        body += [f'<li><a href="#s{i}">{html.escape(s.title)}</a></li>' for i, s in enumerate(self.sections)]
        body.append("</ol>")
        for i, s in enumerate(self.sections):
            body += [f'<h2 id="s{i}">{html.escape(s.title)}<span class="tag">{html.escape(s.tag)}</span></h2>',
                     f'<p class="verdict">{html.escape(s.intro)}</p>', f'<div class="scroll">{s.table}</div>']
            for title, png, caption in s.figures:
                body.append(f"<figure>{img_tag(png, title)}<figcaption><b>{html.escape(title)}.</b> "
                            f"{html.escape(caption)}</figcaption></figure>")
        body.append('<p id="image-check" hidden></p>')
        return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(self.title)}</title>'
                f"<style>{CSS}</style></head><body>{''.join(body)}{CHECK_SCRIPT}</body></html>")

    def _repr_html_(self) -> str:
        return self.to_html()


def run_analyses(text: str, text_b: str | None = None, model: ModelArg = None, *, token: str | None = None,
                 finetune: bool = False, steps: int = 12,
                 progress: Callable[[str, int, int], None] | None = None) -> list[Any]:
    """All analyses for one text: decomposition, positions, segments, tokens, one-hot; with `finetune`, the fine-tune
    demo too (needs torch; seconds)."""
    from bertembed import explain

    layer = load_layer(model)
    dec = explain.explain_text(text, text_b, layer)
    token = token or _first_word(dec.tokens)
    results = [dec, _or_why("Positions", explain.analyze_positions, layer),
               _or_why("Segments", explain.analyze_segments, text, text_b, layer),
               explain.analyze_tokens(token, layer), explain.analyze_onehot(text, layer)]
    if finetune:
        results.append(explain.finetune_demo(layer.source.name, steps=steps, progress=progress))
    return results


def _or_why(title: str, analysis: Callable, *args) -> Any:
    """The analysis's result, or a `NotMeasured` saying why it does not apply to this member (no such table)."""
    try:
        return analysis(*args)
    except NotInThisMember as err:
        return NotMeasured(title, str(err))


def _first_word(tokens: list[str]) -> str:
    """The first whole-word token of a text (not special, not a ## piece), for the neighbours analysis."""
    return next((t for t in tokens[1:] if t.isalpha() and not t.startswith("##")), tokens[1] if len(tokens) > 2
                else "[CLS]")


# per result type: the question its section answers, a one-line answer (None: the result's verdict), the claim's tag
INTROS = {
    "TextDecomposition": ("What does the layer add to each token?", "Each token's vector is the sum of its rows "
                          "(word, and position and segment where the member has those tables), then LayerNorm. The "
                          "table gives each part's norm and its share of the variance LayerNorm sees.", MEASURED),
    "PositionReport": ("Why don't the learned positions look like sin/cos?", None, MEASURED),
    "SegmentReport": ("What are segment embeddings: zeros and ones?", "No: two learned vectors. Segment A's is added "
                      "to [CLS], sentence A and its [SEP]; segment B's to sentence B and the last [SEP]. Both "
                      "sentences are one sequence.", MEASURED),
    "TokenReport": ("What is in the word table?", "nn.Embedding is a table; a token id picks its row. Rows of related "
                    "words point the same way.", MEASURED),
    "OneHotReport": ("Is nn.Embedding a one-hot matrix product?", "Yes: one_hot(ids) @ W picks the same rows as "
                     "W[ids], bit for bit; the lookup skips the product. Pretrained static vectors (word2vec, GloVe) "
                     "can be loaded into such a table too; BERT's is trained with the model (and tied to its MLM "
                     "decoder), and Google's original TPU code could do the lookup as this product.", STRUCTURAL),
    "FinetuneReport": ("Does fine-tuning change the tables?", "Every table is a trainable parameter: which rows move "
                       "depends on which tokens, positions and segments occur, and on the optimiser. The demo's "
                       "magnitudes are a toy's (its learning rate, its two-class head); which rows move is not.",
                       MEASURED),
    "DriftReport": ("How far did each tensor move between two checkpoints?", "How far each tensor moved from "
                    "checkpoint A to B.", MEASURED),
    "NotMeasured": ("Not measured in this member", None, MEASURED),
}


def render_figures(result: Any) -> list[tuple[Any, bytes]]:
    """Every figure of one result as (FigureSpec, PNG bytes)."""
    from bertembed.explain.figures import specs_for

    return [(s, figure_png(s.draw(result))) for s in specs_for(result)]


_rendering: list[Any] = []  # the results a forked worker of `render_all` draws (inherited, never pickled)


def _render_one(index: int) -> list[bytes]:
    return [png for _, png in render_figures(_rendering[index])]


def render_all(results: list[Any]) -> list[list[tuple[Any, bytes]]]:
    """`render_figures` of every result. Matplotlib draws on one thread and the figures are most of a report's
    time, so on Linux two forked processes draw them at once (about 1 s sooner on two cores); elsewhere, in order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from bertembed.explain.figures import specs_for

    if sys.platform != "linux" or (os.cpu_count() or 1) < 2 or len(results) < 2:
        return [render_figures(r) for r in results]
    _rendering[:] = results
    try:
        with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
            drawn = list(pool.map(_render_one, range(len(results))))
    finally:
        _rendering.clear()
    return [list(zip(specs_for(r), pngs, strict=True)) for r, pngs in zip(results, drawn, strict=True)]


def section_for(result: Any, pngs: list[tuple[Any, bytes]] | None = None) -> Section:
    """A report section: title, a one-line answer, a table and the captioned figures of one result."""
    pngs = render_figures(result) if pngs is None else pngs
    title, intro, tag = INTROS[type(result).__name__]
    summary = result.summary()
    verdict = summary.pop("verdict", "")
    rows = result.rows() if hasattr(result, "rows") else summary_rows(summary)
    return Section(title, intro or verdict, html_table(rows),
                   [(s.title, png, s.caption(result)) for s, png in pngs], tag)


def build_report(results: list[Any], title: str | None = None,
                 pngs: list[list[tuple[Any, bytes]]] | None = None) -> Report:
    """Turn analysis results (see `run_analyses`) into a `Report`; `pngs`: figures already rendered, per result.
    The title names the checkpoint measured, and says so where the bundled default is not BERT itself."""
    source = getattr(results[0], "source", None)
    pngs = pngs or render_all(results)
    if title is None:
        name = source.name if source else "the checkpoint"
        title = f"How {name}'s embedding layer builds these vectors"
        if source is not None and source.kind == "bundled":
            title += " (all-MiniLM-L6-v2: BERT's architecture, fine-tuned for sentences; not bert-base-uncased)"
    sections = [section_for(r, p) for r, p in zip(results, pngs, strict=True)]
    return Report(title, source.describe() if source else "", sections)


def write_report(report: Report, path: str | Path) -> Path:
    """Write the self-contained HTML report atomically."""
    return write_atomic(path, report.to_html().encode("utf-8"))


def check_folder(folder: str | Path) -> Path:
    """The folder for --plots: created if missing; an error if it is a file or cannot be created."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--plots {folder}: that is a file; give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--plots {folder}: cannot create the folder ({err.strerror})") from err
    return folder


def write_plots(results: list[Any], folder: str | Path,
                pngs: list[list[tuple[Any, bytes]]] | None = None) -> list[Path]:
    """One PNG per figure of every result, named after the figure (e.g. position_similarity.png)."""
    folder = check_folder(folder)
    pngs = pngs or render_all(results)
    return [write_atomic(folder / f"{s.name}.png", png) for per_result in pngs for s, png in per_result]


def combined_png(result: Any) -> bytes:
    """All figures of one result stacked vertically into one PNG (for `--plot FILE`)."""
    import matplotlib.image as mpimg
    import numpy as np

    images = [mpimg.imread(io.BytesIO(png), format="png") for _, png in render_figures(result)]
    width = max(im.shape[1] for im in images)
    padded = [np.pad(im[..., :3], ((0, 0), (0, width - im.shape[1]), (0, 0)), constant_values=1.0) for im in images]
    buf = io.BytesIO()
    mpimg.imsave(buf, np.concatenate(padded, axis=0), format="png")
    return buf.getvalue()
