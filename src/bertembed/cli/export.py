"""`bertembed export onnx OUT [--model M] [--fused] [--whole [--optimize] [--quantize int8]]`: the embedding layer, or
the whole model, as ONNX."""

from __future__ import annotations

from typing import Annotated

import typer

from bertembed.cli.app import ModelOpt, app, console, say_model, user_errors

export_app = typer.Typer(help="Write the embedding layer, or the whole model around it, in another format.",
                         no_args_is_help=True)
app.add_typer(export_app, name="export")


@export_app.command("onnx")
def onnx_command(
    out: Annotated[str, typer.Argument(help="the .onnx file to write (its folder must exist)")],
    model: ModelOpt = None,
    fused: Annotated[bool, typer.Option("--fused", help="write ONNX Runtime's com.microsoft EmbedLayerNormalization "
                                        "instead of Gather, Add and LayerNormalization")] = False,
    whole: Annotated[bool, typer.Option("--whole", help="export the whole transformers model (needs transformers); "
                                        "with --fused its embedding subgraph becomes the fused op")] = False,
    optimize: Annotated[bool, typer.Option("--optimize", help="with --whole: --fused where the op computes the layer, "
                                           "then ONNX Runtime's transformer optimizer (fused attention, "
                                           "SkipLayerNormalization, Gelu)")] = False,
    quantize: Annotated[str | None, typer.Option(help="with --whole: 'int8', ONNX Runtime's dynamic quantization "
                                                 "(int8 weights, for the CPU)")] = None,
    opset: Annotated[int, typer.Option(help="ONNX opset of the standard operators (17 or later)")] = 18,
) -> None:
    """Export the embedding layer (or, with --whole, the whole model) to ONNX, float32, dynamic batch and length,
    with optimum's input names; needs onnx and onnxscript, and onnxruntime to run it."""
    # the output, packages and opset checked before any work (onnxscript: torch's exporter, where every graph starts)
    with user_errors(out, needs=("onnx", "onnxscript", *(("onnxruntime",) if optimize or quantize else ()))):
        import torch

        from bertembed import BertEmbeddings
        from bertembed.onnx_export import check_opset, export_onnx, export_whole

        check_opset(opset)
        if (optimize or quantize) and not whole:
            raise ValueError("--optimize and --quantize work on the whole model: add --whole")
        say_model(model)
        if whole:
            path = export_whole(model, out, fused=fused, optimize=optimize, quantize=quantize, opset=opset)
        else:
            layer = BertEmbeddings.from_pretrained(model, dtype=torch.float32)
            path = export_onnx(layer, out, fused=fused, opset=opset)
        what = "the whole model" if whole else "the embedding layer"
        how = ("ONNX Runtime's fused operators" if optimize else "com.microsoft EmbedLayerNormalization" if fused
               else "plain operators") + (", int8 weights" if quantize else "")
        console.print(f"wrote {path}: {what}, {how}, opset {opset}")
