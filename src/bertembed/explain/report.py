"""The HTML report and the PNG files of every analysis of one text. The report is one page that opens offline:
plotly.js inlined once, each figure a plotly div (hover, zoom, pan); the PNGs are the same figures in matplotlib."""

from __future__ import annotations

import html
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bertembed import explain
from bertembed.config import NotInThisMember
from bertembed.explain._common import ModelArg, NotMeasured, figure_html, html_table, load_layer, summary_rows
from bertembed.tokenizer import check_not_blank

CSS = """body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;max-width:1300px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
.scroll{overflow-x:auto;max-width:100%}table{border-collapse:collapse;font-size:.8em;margin:1em 0}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}th{background:#f4f4f4;vertical-align:bottom}
caption{text-align:left;font-style:italic;padding:4px 0}figure{margin:1.2em 0}figure img{max-width:100%;
border:1px solid #eee}figcaption{font-size:.92em;color:#333}
.verdict{background:#f0f6ff;border-left:4px solid #4c72b0;padding:.5em 1em}
.tag{font-size:.75em;color:#555;border:1px solid #bbb;border-radius:3px;padding:0 4px;margin-left:.5em}"""
INTRO = ("Before any attention layer runs, the model turns text into vectors: each token's id picks a row of the "
         "word table and, where the model has those tables, its position a row of the position table and its "
         "segment a row of the segment table; the rows are summed and LayerNorm normalises the sum. Each section "
         "below answers one question people ask about this layer, by measuring it on the checkpoint named above. "
         "Tags say whether a claim holds for every checkpoint of this architecture (the structure of the layer) or "
         "was measured on this one (its numbers). Hover over a figure for its values; drag to zoom, double-click to "
         "zoom out.")


def run_analyses(text: str, text_b: str | None = None, model: ModelArg = None, *, token: str | None = None,
                 projector: bool = False, finetune: bool = False, steps: int = 12,
                 progress: Callable[[str, int, int], None] | None = None) -> list[Any]:
    """All analyses of one text (or pair) on one checkpoint read once: decomposition, positions, segments, `token`'s
    neighbours (default: the text's first whole word), one-hot; with `projector` the word table in 2-D (cached), with
    `finetune` the fine-tune demo (torch; seconds). `progress(what, done, total)` follows the long steps."""
    check_not_blank(text, "TEXT", text_b, "TEXT_B")  # (before the checkpoint is read)
    layer = load_layer(model)
    dec = explain.explain_text(text, text_b, layer)  # (the tokenizer first: a text it refuses costs no table read)
    # the neighbours of the word asked for, else of the text's first whole word (not special, not a ## piece)
    token = token or next((t for t in dec.tokens[1:] if t.isalpha() and not t.startswith("##")),
                          dec.tokens[1] if len(dec.tokens) > 2 else "[CLS]")
    results = [dec]
    for title, analysis, args in (("Positions", explain.analyze_positions, [layer]),
                                  ("Segments", explain.analyze_segments, [text, text_b, layer])):
        try:
            results.append(analysis(*args))
        except NotInThisMember as err:  # (the member has no such table: a section saying why)
            results.append(NotMeasured(title, str(err)))
    results += [explain.analyze_tokens(token, layer), explain.analyze_onehot(text, layer, text_b=text_b)]
    if projector:
        results.insert(4, explain.word_map(text, text_b, layer, progress=progress))
    if finetune:
        results.append(explain.finetune_demo(layer, steps=steps, progress=progress))
    return results


def report_html(results: list[Any]) -> str:
    """The report of `results` (see `run_analyses`) as one HTML page. The title names the checkpoint measured, and
    says so where the bundled default is not BERT itself."""
    from plotly.offline import get_plotlyjs

    source = results[0].source
    title = f"How {source.name}'s embedding layer builds these vectors"
    if source.kind == "bundled":
        title += " (all-MiniLM-L6-v2: BERT's architecture, fine-tuned for sentences; not bert-base-uncased)"
    body = [f"<h1>{html.escape(title)}</h1>", f"<p>checkpoint: {html.escape(source.describe())}</p>",
            f"<p>{html.escape(INTRO)}</p><ol>"]
    body += [f'<li><a href="#s{i}">{html.escape(r.question)}</a></li>' for i, r in enumerate(results)]
    body.append("</ol>")
    for i, result in enumerate(results):
        summary = result.summary()
        verdict, warning = summary.pop("verdict", ""), summary.pop("warning", None)
        rows = result.rows() if hasattr(result, "rows") else summary_rows(summary)
        tag = f'<span class="tag">{html.escape(result.tag)}</span>' if result.tag else ""
        body += [f'<h2 id="s{i}">{html.escape(result.question)}{tag}</h2>',
                 f'<p class="verdict">{html.escape(result.answer or verdict)}</p>',
                 f"<p><b>warning:</b> {html.escape(warning)}</p>" if warning else "",
                 f'<div class="scroll">{html_table(rows)}</div>']
        body += [figure_html(f, interactive=True) for f in result.figures()]
        body.append(result.controls())
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style><script>{get_plotlyjs()}</script></head><body>{''.join(body)}</body></html>")


def check_folder(folder: str | Path) -> Path:
    """The folder for --plots, checked but not made yet (a refused input leaves none behind): an error if it or its
    nearest existing parent is a file, or that parent cannot be written."""
    folder = Path(folder).expanduser()
    if folder.is_symlink() and not folder.exists():
        raise ValueError(f"--plots {folder}: a link to {os.readlink(folder)}, which does not exist; give a folder")
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--plots {folder}: {'that' if existing == folder else existing} is a file; give a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--plots {folder}: cannot create or write into it ({existing} is not writable)")
    return folder


def combined_png(result: Any) -> bytes:
    """All figures of one result stacked vertically into one PNG (for `--plot FILE`)."""
    import matplotlib.image as mpimg
    import numpy as np

    images = [mpimg.imread(io.BytesIO(f.png()), format="png") for f in result.figures()]
    width = max(im.shape[1] for im in images)
    padded = [np.pad(im[..., :3], ((0, 0), (0, width - im.shape[1]), (0, 0)), constant_values=1.0) for im in images]
    buf = io.BytesIO()
    mpimg.imsave(buf, np.concatenate(padded, axis=0), format="png")
    return buf.getvalue()
