"""`bertembed export onnx --whole --optimize` beside the anchor, in ONNX Runtime on the CPU.

    python benchmarks/onnx_optimized.py [--threads 2] [--pairs 9] [--texts 1200]

The anchor: ONNX Runtime's transformer optimizer (`optimize_model(model_type="bert")`, its defaults, the heads and
hidden size given) on `torch.onnx.export(dynamo=False)` of the transformers model with eager attention: the clean
graph optimum feeds it. Against it: bertembed's `--whole --optimize` and `--whole --fused`, on all-MiniLM-L6-v2 (the
bundled checkpoint) and on RoBERTa and XLM-R of the same shape (6 layers, hidden 384, 12 heads; XLM-R with its 250,002
rows; random weights written by transformers' save_pretrained). Per (B, L): one call of each graph in turn, the order
rotated every round, `--pairs` rounds (a (1, 16) call is the mean of 20); the median ms of each, and the median of the
rounds' anchor / graph ratios (above 1: faster than the anchor). Every graph is checked against transformers within
1e-4 first, and the fused nodes of each are counted.

int8: bertembed's `--optimize --quantize int8` of all-MiniLM-L6-v2 against its float32 graph: the cosine between
their sentence embeddings (mean pooling over the mask, as sentence-transformers does for this model) over `--texts`
real texts, the first paragraphs of the docstrings of Python's standard library, tokenized by the model's tokenizer
(truncated to 128 tokens, batches of 32); then timed as above.

`--embedding-profile`: instead, ONNX Runtime's own per-node profile of the anchor and of `--optimize`, RoBERTa and
XLM-R: the kernel time of the embedding part (the first norm, EmbedLayerNormalization or LayerNormalization, and every
node it depends on: positions, gathers, sums) against all nodes' time, per call, where a whole model's timing cannot
resolve a part this small.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers
from onnxruntime.transformers.optimizer import optimize_model

from bertembed.onnx_export import export_whole
from bertembed.sources import bundled_folder

SHAPES = ((32, 128), (1, 16))
FUSED = ("EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu", "FastGelu", "Gelu")


def anchor(hf, path: Path, names: list[str]) -> Path:
    """ORT's optimizer on the TorchScript export of `hf` (eager attention), saved to `path`."""

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = hf

        def forward(self, *inputs):
            return self.model(**dict(zip(names, inputs, strict=True))).last_hidden_state

    ids = torch.ones(2, 8, dtype=torch.long)
    raw = path.with_suffix(".raw.onnx")
    torch.onnx.export(Wrapped().eval(), tuple(ids for _ in names), str(raw), dynamo=False, opset_version=18,
                      input_names=names, output_names=["last_hidden_state"],
                      dynamic_axes={n: {0: "batch", 1: "length"} for n in [*names, "last_hidden_state"]})
    optimize_model(str(raw), model_type="bert", num_heads=hf.config.num_attention_heads,
                   hidden_size=hf.config.hidden_size).save_model_to_file(str(path))
    return path


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def race(runs: dict[str, ort.InferenceSession], feed: dict[str, np.ndarray], pairs: int, calls: int) -> dict:
    """name -> list of ms per call, one call (or the mean of `calls`) of each in turn per round."""
    times = {name: [] for name in runs}
    names = list(runs)
    for round_ in range(pairs + 1):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            start = time.perf_counter()
            for _ in range(calls):
                runs[name].run(None, feed)
            if round_:  # (the first round warms up)
                times[name].append((time.perf_counter() - start) / calls * 1e3)
    return times


def embedding_profile(path: Path, feed: dict[str, np.ndarray], calls: int, threads: int) -> tuple[int, float, float]:
    """(nodes in the embedding part, its kernel time, all nodes' kernel time) in us per call, ONNX Runtime's profile."""
    graph = onnx.load(str(path)).graph
    producer = {out: node for node in graph.node for out in node.output}
    norm = next(n for n in graph.node if n.op_type in ("EmbedLayerNormalization", "LayerNormalization"))
    part, stack = set(), [norm]
    while stack:  # the norm and its ancestors
        node = stack.pop()
        if node.name not in part:
            part.add(node.name)
            stack += [producer[name] for name in node.input if name in producer]
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level, options.enable_profiling = 3, True
    options.profile_file_prefix = str(path.with_suffix(""))
    run = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for _ in range(calls + 1):
        run.run(None, feed)
    with open(run.end_profiling()) as f:
        events = json.load(f)
    kernels = [(e["name"].removesuffix("_kernel_time"), e["dur"]) for e in events
               if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    kernels = kernels[len(kernels) // (calls + 1):]  # (the first call warms up)
    return len(part), sum(d for n, d in kernels if n in part) / calls, sum(d for _, d in kernels) / calls


def random_checkpoint(model_type: str, folder: Path, **kwargs) -> Path:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=kwargs.pop("vocab_size"), hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
        intermediate_size=1536, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, layer_norm_eps=1e-5)
    transformers.AutoModel.from_config(config).save_pretrained(folder)
    return folder


def real_texts(count: int) -> list[str]:
    """The first paragraphs of the standard library's docstrings, 40 to 600 characters, deduplicated, in file order."""
    texts: dict[str, None] = {}
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = (ast.get_docstring(node) or "").split("\n\n")[0]
                text = " ".join(doc.split())
                if 40 <= len(text) <= 600:
                    texts[text] = None
        if len(texts) >= count:
            return list(texts)[:count]
    return list(texts)


def sentence_vectors(run: ort.InferenceSession, batches: list[dict[str, np.ndarray]]) -> np.ndarray:
    out = []
    for feed in batches:
        hidden, mask = run.run(None, feed)[0], feed["attention_mask"][..., None]
        out.append((hidden * mask).sum(1) / mask.sum(1))
    return np.concatenate(out)


def int8_check(folder: Path, work: Path, args) -> None:
    from tokenizers import Tokenizer

    paths = {"float32": work / "minilm-optimize.onnx", "int8": work / "minilm-int8.onnx"}
    export_whole(folder, paths["int8"], optimize=True, quantize="int8")
    runs = {name: session(path, args.threads) for name, path in paths.items()}
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_truncation(128)
    tokenizer.enable_padding(pad_id=0)
    texts = real_texts(args.texts)
    batches = []
    for start in range(0, len(texts), 32):
        encoded = tokenizer.encode_batch(texts[start:start + 32])
        ids = np.array([e.ids for e in encoded], dtype=np.int64)
        batches.append({"input_ids": ids, "attention_mask": np.array([e.attention_mask for e in encoded]),
                        "token_type_ids": np.zeros_like(ids)})
    vectors = {name: sentence_vectors(run, batches) for name, run in runs.items()}
    a, b = vectors["int8"], vectors["float32"]
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    print(f"\nint8 vs float32, all-MiniLM-L6-v2 --optimize, {len(texts)} standard-library docstrings: cosine mean "
          f"{cosine.mean():.5f}, median {np.median(cosine):.5f}, min {cosine.min():.5f}, 1st percentile "
          f"{np.percentile(cosine, 1):.5f}; size {paths['float32'].stat().st_size / 2**20:.1f} -> "
          f"{paths['int8'].stat().st_size / 2**20:.1f} MiB")
    for batch, length in SHAPES:
        ids = np.random.default_rng(0).integers(1000, 30000, (batch, length))
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        times = race(runs, feed, args.pairs, 20 if batch == 1 else 1)
        ratios = [f / q for f, q in zip(times["float32"], times["int8"], strict=True)]
        print(f"({batch}, {length}): float32 {statistics.median(times['float32']):.2f} ms, int8 "
              f"{statistics.median(times['int8']):.2f} ms, float32 / int8 {statistics.median(ratios):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--texts", type=int, default=1200)
    parser.add_argument("--embedding-profile", action="store_true", help="per-node profile of the embedding part")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"onnxruntime {ort.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.threads} threads, {args.pairs} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        members = {"all-MiniLM-L6-v2": bundled_folder(),
                   "RoBERTa": random_checkpoint("roberta", work / "roberta", vocab_size=50265),
                   "XLM-R": random_checkpoint("xlm-roberta", work / "xlmr", vocab_size=250002)}
        if args.embedding_profile:
            print("| model | (B, L) | graph | embedding nodes | their us a call | all nodes' us | share |")
            print("|---|---|---|---:|---:|---:|---:|")
        else:
            print("| model | graph | fused nodes | (32, 128) ms | vs anchor | (1, 16) ms | vs anchor |")
            print("|---|---|---|---:|---:|---:|---:|")
        for member, folder in members.items():
            hf = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
            names = ["input_ids", "attention_mask", *(["token_type_ids"] if member.startswith("all") else [])]
            paths = {"anchor": anchor(hf, work / f"{member}-anchor.onnx", names),
                     "--optimize": export_whole(folder, work / f"{member}-optimize.onnx", optimize=True)}
            if args.embedding_profile:
                print_profile(member, paths, names, hf.config.vocab_size, args.threads)
                continue
            if member.startswith("all"):
                (work / "minilm-optimize.onnx").write_bytes(paths["--optimize"].read_bytes())
            paths["--fused"] = export_whole(folder, work / f"{member}-fused.onnx", fused=True)
            runs = {name: session(path, args.threads) for name, path in paths.items()}
            rows = {name: [] for name in runs}
            for batch, length in SHAPES:
                gen = torch.Generator().manual_seed(0)
                ids = torch.randint(5, hf.config.vocab_size, (batch, length), generator=gen)
                feed = dict(zip(names, (ids, torch.ones_like(ids), torch.zeros_like(ids)), strict=False))
                with torch.inference_mode():
                    expected = hf(**feed).last_hidden_state.numpy()
                arrays = {k: v.numpy() for k, v in feed.items()}
                for run in runs.values():
                    np.testing.assert_allclose(run.run(None, arrays)[0], expected, rtol=0, atol=1e-4)
                times = race(runs, arrays, args.pairs, 20 if batch == 1 else 1)
                for name, ms in times.items():
                    ratios = [a / m for a, m in zip(times["anchor"], ms, strict=True)]
                    q1, _, q3 = statistics.quantiles(ratios, n=4)
                    rows[name] += [f"{statistics.median(ms):.2f}", f"{statistics.median(ratios):.2f}x "
                                   f"({q1:.2f}-{q3:.2f})"]
            for name, path in paths.items():
                ops = Counter(n.op_type for n in onnx.load(str(path)).graph.node)
                fused = ", ".join(f"{ops[op]} {op}" for op in FUSED if ops[op])
                print(f"| {member} | {name} | {fused or 'none'} | {' | '.join(rows[name])} |")
        if not args.embedding_profile:
            int8_check(bundled_folder(), work, args)


def print_profile(member: str, paths: dict[str, Path], names: list[str], vocab: int, threads: int) -> None:
    for batch, length in SHAPES:
        ids = np.random.default_rng(0).integers(5, vocab, (batch, length))
        feed = dict(zip(names, (ids, np.ones_like(ids), np.zeros_like(ids)), strict=False))
        for name in ("anchor", "--optimize"):
            nodes, part, total = embedding_profile(paths[name], feed, 200 if batch == 1 else 20, threads)
            print(f"| {member} | ({batch}, {length}) | {name} | {nodes} | {part:.0f} | {total:.0f} | "
                  f"{100 * part / total:.2f}% |")


if __name__ == "__main__":
    main()
