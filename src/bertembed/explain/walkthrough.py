"""The layer rebuilt by hand in plain torch on a checkpoint's own tensors, each step checked against the member's own
transformers module (its intermediates), or the numpy reference without transformers. `bertembed walkthrough` runs
the steps' code; `bertembed notebook` writes it into Jupyter cells."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bertembed.atomic import check_output, write_atomic
from bertembed.config import EmbeddingConfig
from bertembed.explain._common import ModelArg, load_text
from bertembed.explain.segments import DEFAULT_TEXT, literal_separator
from bertembed.family import module_names, transformers_layer
from bertembed.sources import Source


@dataclass
class Step:
    """One step: a title, why, its code, the value it defines and what that is checked against; once run, results."""

    title: str
    why: str
    code: str
    result: str  # the variable the code defines, shown and checked
    against: str | None = None  # the reference's intermediate it is checked against (a key of `reference`)
    exact: bool = True  # whether the two must be equal bit for bit (else: to float32 rounding)
    shape: list[int] = field(default_factory=list)
    preview: list[dict] = field(default_factory=list)  # every token's first values
    check: str = ""  # what it was compared with, and how close
    max_abs_diff: float | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Walkthrough:
    source: Source
    member: str
    tokens: list[str]
    steps: list[Step]
    reference: str = ""  # what the steps were checked against
    warning: str | None = None  # a literal separator in a text (it stays in that text's segment)

    def summary(self) -> dict:
        return {"model": self.source.describe(), "member": self.member, "tokens": self.tokens,
                "reference": self.reference, "warning": self.warning,
                "steps": [{"title": s.title, "shape": s.shape, "check": s.check, "max_abs_diff": s.max_abs_diff}
                          for s in self.steps]}


def steps(config: EmbeddingConfig) -> list[Step]:
    """The walkthrough's steps for a layer of `config`, as code over `ids`, `types` and `layer`, each checked against
    `ref`, the reference's intermediates of the same ids (`reference`)."""
    c = config
    pad = c.pad_token_id
    if c.position_embedding_type == "none":
        positions = ("position = torch.zeros_like(word)  # no position table: positions enter in attention "
                     "(rotary, ALiBi or relative)")
    else:
        table = ("layer.position_embeddings.weight.detach()" if c.position_embedding_type == "absolute"
                 else "sinusoidal_table(*layer.position_embeddings.weight.shape)")
        counted = (f"real = (ids != {pad}).long()  # positions count from the padding id {pad}: pads get row {pad}\n"
                   f"position_ids = torch.cumsum(real, dim=1) * real + {pad}\n"
                   if c.positions_from_padding else "position_ids = torch.arange(ids.shape[1])[None]\n")
        positions = f"{counted}P = {table}\nposition = P[position_ids]"
    segments = ("T = layer.token_type_embeddings.weight.detach()\nsegment = T[types]" if c.type_vocab_size else
                "segment = torch.zeros_like(word)  # no segment table in this member")
    first, second = ("position", "segment") if c.sum_order == "position_first" else ("segment", "position")
    summed = f"total = (word + {first}) + {second}  # in the member's order: the last bit depends on it"
    x = "projected" if c.projection == "before_norm" else "total"  # LayerNorm's input
    beta = "layer.LayerNorm.bias.detach()" if c.norm_bias else "0.0  # this member's LayerNorm has no bias"
    projection = [Step("4b. The projection E -> H", f"DeBERTa's tables are {c.table_width} wide; a Linear (no bias) "
                       f"maps their sum to the encoder's {c.hidden_size} before the norm.",
                       "projected = total @ layer.projection.weight.detach().T", "projected", "projected",
                       exact=False)] if x == "projected" else []
    return [
        Step("1. The ids and the tokens", "The tokenizer turns the text into ids; the specials are ordinary rows.",
             "enc = tokenizer(text, text_b, padding=False, return_tensors='pt')\n"
             "ids, types = enc.input_ids, enc.token_type_ids\nprint(list(zip(enc.tokens, ids[0].tolist())))",
             "ids"),
        Step("2. The word rows", "Row `id` of the word table for every token: a lookup, no arithmetic.",
             "W = layer.word_embeddings.weight.detach()\nword = W[ids]", "word", "word"),
        Step("3a. The position rows", "The position table's rows at the member's position ids." if
             c.position_embedding_type != "none" else "No position table: the positions enter in attention.", positions,
             "position", None if c.position_embedding_type == "none" else "position"),
        Step("3b. The segment rows", {0: "No segment table: nothing is added.", 1: "The segment table's one row, at "
                                      "every token (type 0 throughout)."}.get(c.type_vocab_size, "The segment "
             "table's rows at the token types (0 for text A, 1 for text B)."), segments, "segment",
             "segment" if c.type_vocab_size else None),
        Step("4. Their sum", "LayerNorm's input." if not projection else "The projection's input.", summed, "total",
             "sum"),
        *projection,
        Step("5. Mean and standard deviation", f"Per token, over its {c.output_width} features; eps inside the "
             f"square root.",
             f"mean = {x}.mean(-1, keepdim=True)\nvar = (({x} - mean) ** 2).mean(-1, keepdim=True)\n"
             f"std = torch.sqrt(var + {c.layer_norm_eps!r})", "std", "std", exact=False),
        Step("6. Normalise, then scale and shift", "(sum - mean) / std has mean 0 and variance 1 per token; "
             + ("gamma and beta are learned." if c.norm_bias else "gamma is learned (this norm has no beta)."),
             f"normed = ({x} - mean) / std\nout = normed * layer.LayerNorm.weight.detach() + {beta}", "out",
             "layernorm", exact=False),
        Step("7. The layer's own output", "The same ids through bertembed's layer (eval mode: no dropout)." + (
             f" The encoder then maps it {c.table_width} -> {c.hidden_size} (`layer.project`)."
             if c.projection == "output" else ""),
             "with torch.no_grad():\n    output = layer(ids, types)" if c.type_vocab_size else
             "with torch.no_grad():\n    output = layer(ids)", "output", "output", exact=False),
    ]


def walkthrough(text: str, text_b: str | None = None, model: ModelArg = None) -> Walkthrough:
    """Run the steps on `text` (and `text_b`) with `model`'s tensors, checking each against `reference` (bit for bit
    where the operations are the same, else to float32 rounding)."""
    import torch

    from bertembed.embeddings import BertEmbeddings, sinusoidal_table

    checkpoint, _ = load_text(model, text, text_b)  # (no tokens, or more than the positions: refused)
    layer = BertEmbeddings.from_pretrained(checkpoint.source, dtype=torch.float32)
    space: dict[str, Any] = {"torch": torch, "layer": layer, "tokenizer": checkpoint.tokenizer, "text": text,
                             "text_b": text_b, "sinusoidal_table": sinusoidal_table, "print": lambda *a, **k: None}
    results, against = [], ""
    for step in steps(layer.config):
        exec(step.code, space)  # noqa: S102  (the steps' own code, the same the notebook shows)
        if step.result == "ids":
            against, space["ref"] = reference(layer, space["ids"], space["types"])
        if step.result == "output" and against.startswith("transformers'"):  # (its own module: bit for bit)
            step = replace(step, exact=True)
        results.append(_result(step, space))
    tokens, ids = space["enc"].tokens, space["ids"][0].tolist()
    # step 2's note: a repeated id gets the very same row (at its second place), else the first token's lookup
    repeats = [f"{tokens[i]} at {ids.index(t)} and {i}: the same id, so the same row, in any sentence"
               for i, t in enumerate(ids) if ids[:i].count(t) == 1]
    first = f"{tokens[0]} (id {ids[0]}) gets this same row in every sentence: it is a lookup"
    results[1].notes.extend(repeats or [first])
    return Walkthrough(checkpoint.source, layer.config.model_type, tokens, results, against,
                       literal_separator(checkpoint.tokenizer, text, text_b))


def reference(layer, ids, types) -> tuple[str, dict]:
    """(what it is, its intermediates on `ids` [1, L] and `types`): the member's own transformers embeddings module
    holding `layer`'s tables, its submodules' outputs and its LayerNorm's (and projection's) input caught by hooks;
    without transformers, or where it has no such module, bertembed's numpy reference."""
    import numpy as np
    import torch

    from bertembed.numpy_layer import NumpyEmbeddings

    config = layer.config
    try:
        import transformers

        module = transformers_layer(config, layer.state_dict()).eval()
    except (ImportError, ValueError, RuntimeError) as err:
        tensors = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
        args = ids.numpy(), types.numpy() if config.type_vocab_size else None
        ref = NumpyEmbeddings(config, tensors, layer.source).decompose(*args)
        if config.projection == "before_norm":  # (its parts come projected to H: the same without the projection)
            e, ref["projected"] = config.table_width, ref["sum"]
            tables = {**tensors, "LayerNorm.weight": np.ones(e, "f4"), "LayerNorm.bias": np.zeros(e, "f4")}
            flat = config.replace(hidden_size=e, embedding_size=None, projection="none")
            unprojected = NumpyEmbeddings(flat, tables, layer.source).decompose(*args)
            ref |= {k: unprojected[k] for k in ("word", "position", "segment", "sum")}
        ref = {k: torch.from_numpy(np.asarray(v)) for k, v in ref.items()}
        return (f"the numpy reference (bertembed.numpy_layer), for want of a transformers module: {err}",
                ref | {"std": ref["std"][..., None], "layernorm": ref["output"]})
    ours = module_names(config.model_type)
    caught = [("word_embeddings", "word", False), ("position_embeddings", "position", False),
              ("token_type_embeddings", "segment", False), ("projection", "sum", True),
              ("LayerNorm", "projected" if config.projection == "before_norm" else "sum", True),
              ("LayerNorm", "layernorm", False)]  # (submodule, key, its input rather than its output)
    ref = {}
    for sub, key, taken in caught:  # (on a module made for this call alone: the hooks go with it)
        if getattr(module, ours.get(sub, sub), None) is not None:  # (copies: it may add to them in place)
            getattr(module, ours.get(sub, sub)).register_forward_hook(
                lambda _, args, out, key=key, taken=taken: ref.update({key: (args[0] if taken else out).clone()}))
    with torch.no_grad():
        ref["output"] = module(input_ids=ids, **({"token_type_ids": types} if config.type_vocab_size else {}))
    return f"transformers' {type(module).__name__} (transformers {transformers.__version__}) on the same tables", ref


def _result(step: Step, space: dict, values: int = 4) -> Step:
    """`step` run: its shape, every token's first `values` values, and its check against the reference's value."""
    value = space[step.result]
    shape = list(value.shape)
    tokens = space["enc"].tokens
    if value.dim() == 2:  # ids
        preview = [{"token": t, "id": int(i), "type": int(s)} for t, i, s in
                   zip(tokens, value[0].tolist(), space["types"][0].tolist(), strict=True)]
    elif shape[-1] == 1:  # the statistics
        preview = [{"token": t, "mean": float(m), "std": float(s)} for t, m, s in
                   zip(tokens, space["mean"][0, :, 0].tolist(), value[0, :, 0].tolist(), strict=True)]
    else:
        preview = [{"token": tokens[i], **{f"[{j}]": float(value[0, i, j]) for j in range(min(values, shape[-1]))}}
                   for i in range(shape[1])]
    if step.against not in space["ref"]:
        why = {"ids": "the tokenizer's output, the layer's input", "std": "not compared: its LayerNorm computes them "
               "inside its kernel; step 6 checks what they give"}
        return replace(step, shape=shape, preview=preview, check=why.get(
            step.result, "not compared: this member has no such table, so zeros"))
    against = f"ref[{step.against!r}]"
    diff = float((value.double() - space["ref"][step.against].double()).abs().max())
    if diff == 0:
        check = f"equal to {against} bit for bit"
    elif step.exact or not diff <= 1e-5:
        check = f"differs from {against} by {diff:.3g}"
    else:
        check = f"equal to {against} to float32 rounding: max |diff| = {diff:.2g}"
    return replace(step, shape=shape, preview=preview, check=check, max_abs_diff=diff)


def check_walkthrough(result: Walkthrough) -> list[str]:
    """The steps whose check failed (an exact step that differs), for tests and the command's exit status."""
    return [s.title for s in result.steps if s.check.startswith("differs")]


def notebook_cells(model: str | None, layer, text: str, text_b: str | None = None) -> list[tuple[str, str]]:
    """(kind, source) of each cell, "markdown" or "code", for `model` as the user named it and read (`layer`)."""
    config, where, source = layer.config, layer.source.describe(), layer.source
    if source.kind in ("folder", "file"):  # (absolute: Jupyter runs a notebook from the notebook's own folder)
        model = str(Path(source.weights_file or source.folder).resolve())
    intro = (f"# The embedding layer, rebuilt by hand\n\nCheckpoint: `{where}` ({config.model_type}). Each step "
             f"below does with plain torch what the layer does, and checks the result against `ref`, the "
             f"intermediates of the member's own transformers module on the same tables (without transformers, "
             f"bertembed's numpy reference): bit for bit where the operations are the same, to float32 rounding "
             f"where LayerNorm computes its statistics its own way. Edit the texts and run again.")
    setup = ("import torch\nfrom bertembed import BertEmbeddings, Tokenizer, sinusoidal_table\n"
             "from bertembed.explain.walkthrough import reference\n\n"
             f"MODEL = {model!r}  # None: the bundled all-MiniLM-L6-v2 (a BERT, not bert-base-uncased)\n"
             f"text, text_b = {text!r}, {text_b!r}\n"
             "layer = BertEmbeddings.from_pretrained(MODEL, dtype=torch.float32)  # eval mode: no dropout\n"
             "tokenizer = Tokenizer.from_pretrained(MODEL)")
    cells = [("markdown", intro), ("code", setup)]
    for step in steps(config):
        cells.append(("markdown", f"## {step.title}\n\n{step.why}"))
        source = step.code
        if step.result == "ids":
            source += "\nname, ref = reference(layer, ids, types)  # what each step is checked against\nprint(name)"
        if step.against is not None:
            against = f"ref[{step.against!r}]"
            check = (f"torch.equal({step.result}, {against})" if step.exact else
                     f"torch.allclose({step.result}, {against}, rtol=0, atol=1e-5)")
            check = f"assert {check}" if step.against != "std" else \
                f"if 'std' in ref:  # (transformers' LayerNorm keeps them inside its kernel)\n    assert {check}"
            source += f"\n{check}\nprint({step.result}.shape, {step.result}[0, :, :4])"
        cells.append(("code", source))
    cells.append(("markdown", "## The figures\n\nThe same text measured by `bertembed explain`: each part's norm and "
                              "share of the variance LayerNorm divides by."))
    cells.append(("code", "from bertembed.explain import explain_text\nexplain_text(text, text_b, MODEL)"))
    return cells


def write_notebook(path: str | Path, model: str | None = None, text: str = DEFAULT_TEXT,
                   text_b: str | None = None) -> Path:
    """Write the walkthrough notebook to `path` (needs nbformat: pip install -e ".[notebook]")."""
    import nbformat

    layer, _ = load_text(model, text, text_b)  # a text the layer takes: with tokens, within the positions, UTF-8
    path = check_output(path)
    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_markdown_cell(s) if kind == "markdown" else nbformat.v4.new_code_cell(s)
                  for kind, s in notebook_cells(model, layer, text, text_b)]
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.validate(book)
    return write_atomic(path, nbformat.writes(book).encode("utf-8"))
