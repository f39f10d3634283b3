"""`bertembed notebook`: the walkthrough's steps (`walkthrough.steps`) as a Jupyter notebook a user can edit and run:
plain torch operations on the checkpoint's tensors, an assert against the layer after each step, and the figures."""

from __future__ import annotations

from pathlib import Path

from bertembed.explain.walkthrough import steps


def notebook_cells(model: str | None, text: str, text_b: str | None = None) -> list[tuple[str, str]]:
    """(kind, source) of each cell: "markdown" or "code"."""
    from bertembed.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(model, framework="np")
    config, where = checkpoint.config, checkpoint.source.describe()
    intro = (f"# The embedding layer, rebuilt by hand\n\nCheckpoint: `{where}` ({config.model_type}). Each step "
             f"below does with plain torch what the layer does, and checks the result against the layer's own "
             f"intermediate (`layer.decompose`): bit for bit where the operations are the same, to float32 rounding "
             f"where LayerNorm computes its statistics its own way. Edit the text and run again.")
    setup = ("import torch\nfrom bertembed import BertEmbeddings, Tokenizer, sinusoidal_table\n\n"
             f"MODEL = {model!r}  # None: the bundled all-MiniLM-L6-v2 (a BERT, not bert-base-uncased)\n"
             f"text, text_b = {text!r}, {text_b!r}\n"
             "layer = BertEmbeddings.from_pretrained(MODEL, dtype=torch.float32)  # eval mode: no dropout\n"
             "tokenizer = Tokenizer.from_pretrained(MODEL)")
    cells = [("markdown", intro), ("code", setup)]
    for step in steps(config):
        cells.append(("markdown", f"## {step.title}\n\n{step.why}"))
        source = step.code
        if step.result == "ids":
            args = "ids, types" if config.type_vocab_size else "ids"
            source += f"\nwith torch.no_grad():\n    parts = layer.decompose({args})  # the layer's own intermediates"
        if step.against is not None:
            check = (f"torch.equal({step.result}, {step.against})" if step.exact else
                     f"torch.allclose({step.result}, {step.against}, rtol=0, atol=1e-5)")
            source += f"\nassert {check}\nprint({step.result}.shape, {step.result}[0, :3, :4])"
        cells.append(("code", source))
    cells.append(("markdown", "## The figures\n\nThe same text measured by `bertembed explain`: each part's norm and "
                              "share of the variance LayerNorm divides by."))
    cells.append(("code", "from bertembed.explain import explain_text\nexplain_text(text, text_b, MODEL)"))
    return cells


def write_notebook(path: str | Path, model: str | None = None, text: str = "The quick brown fox jumps over the lazy "
                   "dog", text_b: str | None = None) -> Path:
    """Write the walkthrough notebook to `path` (needs nbformat: pip install 'bertembed[notebook]')."""
    try:
        import nbformat
    except ImportError as err:
        raise ValueError("writing a notebook needs nbformat: pip install 'bertembed[notebook]'") from err
    from bertembed.atomic import check_output, write_atomic

    path = check_output(path)
    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_markdown_cell(s) if kind == "markdown" else nbformat.v4.new_code_cell(s)
                  for kind, s in notebook_cells(model, text, text_b)]
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.validate(book)
    write_atomic(path, nbformat.writes(book).encode("utf-8"))
    return Path(path)
