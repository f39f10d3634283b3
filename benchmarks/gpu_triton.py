"""The Triton kernels on a GPU, in one call of a lent machine: checks, then times, then a table.

    python benchmarks/gpu_triton.py [--out DIR]

1. Copy bandwidth (a 1 GiB device-to-device copy, bytes read + written) and the issue's bound per case.
2. Correctness on the GPU at the timed shapes: the forward against a float64 reference, the output poisoned with NaN
   first (every element must be written), relative error ||out - ref|| / ||ref||.
3. Times (`triton.testing.do_bench`, median, L2 flushed between calls): the raw forward kernel at several
   `num_warps`, bertembed's module (ids checked on the host, and with `id_checks = "device"`), transformers' eager
   layer and `torch.compile` of it;
   forward and forward plus backward.

Dimension letters: B batch, L length, H hidden, N tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bertembed.bench.candidates import DTYPES, Case, inputs
from bertembed.config import EmbeddingConfig
from bertembed.embeddings import BertEmbeddings
from bertembed.fast import triton as triton_kernels

CASES = [Case(1024, 64, 512), Case(1024, 64, 512, dtype="bfloat16"), Case(1024, 64, 512, dtype="float16"),
         Case(768, 32, 128), Case(768, 1, 11), Case(1024, 64, 512, "fwdbwd"), Case(768, 32, 128, "fwdbwd")]
# (rows per program, num_warps) of the raw forward kernel
VARIANTS = [(1, 2), (1, 4), (2, 2), (2, 8)]  # the best of (1, 2, 4) x (2, 4, 8) in an earlier run


@dataclass
class Workload:
    """Weights (float32, CPU, Hugging Face names) and inputs of one case."""

    case: Case
    config: EmbeddingConfig
    state_dict: dict
    input_ids: torch.Tensor
    token_type_ids: torch.Tensor
    grad_output: torch.Tensor


def bound_bytes(case: Case) -> int:
    """Least bytes a forward moves: B*L gathered word, position and segment rows of H values, gamma and beta, and
    the [B, L, H] output written once (ids left out)."""
    tokens, size = case.batch * case.length, DTYPES[case.dtype].itemsize
    return (tokens * 3 * case.hidden + 2 * case.hidden + tokens * case.hidden) * size


def make_workload(case: Case, vocab_size: int = 30522) -> Workload:
    """Random BERT-like weights (LayerNorm off the identity) and the bench's ids and output gradient."""
    torch.manual_seed(0)
    config = EmbeddingConfig(vocab_size=vocab_size, hidden_size=case.hidden)
    ref = BertEmbeddings(config)
    with torch.no_grad():
        ref.LayerNorm.weight.add_(0.1 * torch.randn(case.hidden))
        ref.LayerNorm.bias.add_(0.1 * torch.randn(case.hidden))
    return Workload(case, config, ref.state_dict(), *inputs(case, vocab=vocab_size))


def _hf_module(work: Workload):
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertEmbeddings as HFBertEmbeddings

    c = work.config
    hf = HFBertEmbeddings(BertConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, pad_token_id=c.pad_token_id,
                                     layer_norm_eps=c.layer_norm_eps))
    hf.load_state_dict(work.state_dict)
    return hf


def median_ms(fn) -> float:
    """Median milliseconds of `fn()`: device events with the L2 flushed between calls on CUDA, a host clock on CPU."""
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a 1 GiB copy (256 KiB on CPU), counting read and write."""
    n = (1 << 28) if device == "cuda" else (1 << 16)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return 2 * 4 * n / (median_ms(lambda: dst.copy_(src)) / 1e3)


def modules(work: Workload, device: str):
    dtype = DTYPES[work.case.dtype]
    ours = BertEmbeddings(work.config, backend="triton")
    ours.load_state_dict(work.state_dict)
    hf = _hf_module(work)
    ref = BertEmbeddings(work.config)
    ref.load_state_dict(work.state_dict)
    return ours.to(device, dtype), hf.to(device, dtype), ref.double()


def _name(variant) -> str:
    rows, warps = variant
    return f"r{rows}w{warps}"


def raw_forward(ours: BertEmbeddings, ids: torch.Tensor, tts: torch.Tensor, variant, out: torch.Tensor):
    """The forward kernel alone (no input checks, no statistics, explicit ids as the layer passes them), as `variant`
    says."""
    rows, warps = variant
    flat, types = ids.reshape(-1), tts.reshape(-1)
    positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape).reshape(-1)
    tables = [t.weight for t in (ours.word_embeddings, ours.token_type_embeddings, ours.position_embeddings)]
    ln = ours.LayerNorm

    def run():
        triton_kernels.run_forward(flat, types, positions, *tables, ln.weight, ln.bias, ln.eps, 0.0, 0, out=out,
                                   stats=False, num_warps=warps, rows=rows)
    return run


def check(ours, ref, work: Workload) -> dict:
    """Relative errors against the float64 reference: the module's eval output, and the raw kernel at each
    `num_warps` into an output poisoned with NaN (every element must be overwritten)."""
    ids, tts = work.input_ids, work.token_type_ids
    with torch.no_grad():
        expected = ref.eval()(ids.cpu(), tts.cpu())
        errors = {"err module": _rel_err(ours.eval()(ids, tts), expected)}
        out = torch.empty((*ids.shape, work.case.hidden), device=ids.device, dtype=DTYPES[work.case.dtype])
        for variant in VARIANTS:
            out.fill_(float("nan"))
            raw_forward(ours, ids, tts, variant, out)()
            errors[f"err {_name(variant)}"] = _rel_err(out, expected)
    return errors


def _rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    got = got.double().cpu()
    assert not got.isnan().any(), "some output elements were never written"
    return float((got - expected).norm() / expected.norm())


def time_forward(case: Case, work: Workload, ours, hf, device: str) -> dict:
    ids, tts = work.input_ids, work.token_type_ids
    out = torch.empty((*ids.shape, case.hidden), device=device, dtype=DTYPES[case.dtype])
    variants = VARIANTS if ids.numel() >= 4096 else [(1, 4)]  # a sentence: launch-bound, one is enough
    row = {_name(v): median_ms(raw_forward(ours, ids, tts, v, out)) for v in variants}
    ours.eval(), hf.eval()
    compiled = torch.compile(hf, dynamic=False)
    with torch.no_grad():
        row["bertembed"] = median_ms(lambda: ours(ids, tts))
        ours.id_checks = "device"
        row["bertembed dev"] = median_ms(lambda: ours(ids, tts))
        ours.id_checks = "host"
        row["hf eager"] = median_ms(lambda: hf(ids, tts))
        compiled(ids, tts)
        row["hf compile"] = median_ms(lambda: compiled(ids, tts))
    return row


def time_training(case: Case, work: Workload, ours, hf) -> dict:
    ids, tts, grad = work.input_ids, work.token_type_ids, work.grad_output
    compiled = torch.compile(hf, dynamic=False)
    row = {}
    dev = BertEmbeddings(work.config, backend="triton").to(ours.word_embeddings.weight.device)
    dev.load_state_dict(ours.state_dict())
    dev.id_checks = "device"
    for name, module in (("bertembed", ours), ("bertembed dev", dev), ("hf eager", hf), ("hf compile", compiled)):
        module.train()
        params = [p for p in module.parameters() if p.requires_grad]

        def step(module=module, params=params):
            module(ids, tts).backward(grad)
            for p in params:
                p.grad = None
        step()
        row[name] = median_ms(step)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--small", action="store_true", help="tiny shapes, for a smoke test on CPU (interpreter)")
    parser.add_argument("--only", default="", help="only the cases whose key contains this, e.g. bfloat16")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [c for c in ([Case(96, 2, 5), Case(96, 2, 5, "fwdbwd")] if args.small else CASES) if args.only in c.key]
    report = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
              "bandwidth": copy_bandwidth(device), "cases": []}
    print(f"device {report['device']}, copy bandwidth {report['bandwidth'] / 1e9:.0f} GB/s", flush=True)
    for case in cases:
        on_device = Case(case.hidden, case.batch, case.length, case.mode, case.dtype, device)
        work = make_workload(on_device, vocab_size=30522)
        ours, hf, ref = modules(work, device)
        row = {"case": case.key.replace("cpu ", ""), "bound_ms": bound_bytes(case) / report["bandwidth"] * 1e3}
        if case.mode == "fwd":
            row.update(check(ours, ref, work))
            row.update(time_forward(case, work, ours, hf, device))
        else:
            row.update(time_training(case, work, ours, hf))
        report["cases"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_triton.json").write_text(json.dumps(report, indent=1))
    _print_table(report)


def _print_table(report: dict) -> None:
    print(f"\n{report['device']}  copy {report['bandwidth'] / 1e9:.0f} GB/s  (times in us, medians)")
    for row in report["cases"]:
        times = {k: v for k, v in row.items() if k not in ("case", "bound_ms") and not k.startswith("err")}
        cells = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in times.items())
        worst = max((v for k, v in row.items() if k.startswith("err")), default=None)
        err = f"  worst err {worst:.1e}" if worst is not None else ""
        print(f"{row['case']:<28} bound {row['bound_ms'] * 1e3:.1f}{err}  {cells}")


if __name__ == "__main__":
    main()
