"""CPU inference (the forward kernel alone, no autograd) against the reference layer: the tables and ids read on each
call, whatever was done to them since the last one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bertembed import BertEmbeddings, EmbeddingConfig
from bertembed.fast import cpu
from kernel_helpers import assert_grad_close


def _pair(hidden=200, positions=64, seed=0):
    torch.manual_seed(seed)
    config = EmbeddingConfig(vocab_size=500, hidden_size=hidden, max_position_embeddings=positions)
    ref = BertEmbeddings(config).eval()
    with torch.no_grad():
        ref.LayerNorm.weight.uniform_(0.5, 1.5)
        ref.LayerNorm.bias.uniform_(-0.5, 0.5)
    fused = BertEmbeddings(config, backend="cpu").eval()
    fused.load_state_dict(ref.state_dict())
    return ref, fused


def _kernel_runs(monkeypatch) -> list:
    """A list that grows by one each time the CPU forward kernel runs."""
    runs, forward = [], cpu.run_forward

    def counted(*args, **kwargs):
        runs.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(cpu, "run_forward", counted)
    return runs


def _close(actual, expected):
    tol = 5e-7 * max(1.0, expected.abs().max().item())
    assert (actual - expected).abs().max().item() <= tol


@pytest.mark.parametrize("shape,offset,types", [((1, 11), 0, True), ((1, 1), 0, False), ((3, 7), 5, True),
                                                 ((2, 64), 0, False), ((1, 4), 60, True),
                                                 ((16, 64), 0, True), ((40, 17), 3, False)])  # these on all threads
def test_inference_matches_the_reference(shape, offset, types, monkeypatch):
    ref, fused = _pair()
    runs = _kernel_runs(monkeypatch)
    ids = torch.randint(0, 500, shape)
    ids[0, -1] = 0  # a [PAD] id
    tts = torch.randint(0, 2, shape) if types else None
    with torch.no_grad():
        _close(fused(ids, tts, past_key_values_length=offset), ref(ids, tts, past_key_values_length=offset))
    assert runs  # the kernel did run


@pytest.mark.parametrize("batch", [3, 64])  # serial; all threads (rows 1 to 64)
def test_ids_that_start_inside_their_storage(batch):
    """Ids that are slices of a larger tensor (their first element inside the storage)."""
    ref, fused = _pair()
    ids, tts = torch.randint(0, 500, (batch, 11)), torch.randint(0, 2, (batch, 11))
    with torch.no_grad():
        for rows in (slice(1, 2), slice(2, 3), slice(1, batch)):
            assert ids[rows].storage_offset() > 0
            _close(fused(ids[rows], tts[rows]), ref(ids[rows], tts[rows]))


@pytest.mark.parametrize("batch", [1, 64])  # serial; all threads
@pytest.mark.parametrize("replaced", ["token_type_embeddings.weight", "LayerNorm.weight", "word_embeddings.weight"])
def test_data_replaced_by_a_view_of_another_shape_raises_as_the_reference_does(replaced, batch):
    """After a warm call, a table's or the LayerNorm's `.data` replaced by a view of another shape (narrower, at the
    same address): the fused layer raises the reference's error, reading nothing past the new shape."""
    ref, fused = _pair()
    ids = torch.randint(0, 500, (batch, 9))
    with torch.no_grad():
        fused(ids)  # a warm call
        for layer in (ref, fused):
            param = layer.get_parameter(replaced)
            param.data = param.data[..., :100]  # the same storage, half the width
        with pytest.raises(ValueError) as expected:
            ref(ids)
        with pytest.raises(ValueError) as got:
            fused(ids)
    assert str(got.value) == str(expected.value)
    assert "share one hidden size" in str(got.value)


def test_bad_ids_get_the_reference_errors():
    ref, fused = _pair()
    large = torch.randint(0, 500, (16, 64))  # the parallel kernel; its last id is the bad one below
    with torch.no_grad():
        for kwargs, pattern in [(dict(input_ids=torch.tensor([[1, 500]])), r"holds 500 .*\[0, 500\)"),
                                (dict(input_ids=torch.tensor([[1, 2]]), token_type_ids=torch.tensor([[0, 2]])),
                                 r"token_type_ids holds 2"),
                                (dict(input_ids=torch.ones(1, 65, dtype=torch.long)), r"65 tokens"),
                                (dict(input_ids=torch.ones(1, 5, dtype=torch.long), past_key_values_length=62),
                                 r"offset"),
                                (dict(input_ids=large.clone().index_put_((torch.tensor(15), torch.tensor(63)),
                                                                         torch.tensor(500))), r"holds 500"),
                                (dict(input_ids=large, token_type_ids=torch.full((16, 64), 2)),
                                 r"token_type_ids holds 2")]:
            with pytest.raises(ValueError, match=pattern):
                fused(**kwargs)


def test_new_weights_are_read_at_the_next_call():
    ref, fused = _pair()
    ids = torch.randint(0, 500, (1, 9))
    with torch.no_grad():
        fused(ids)
        fused.load_state_dict({k: v * 2 for k, v in ref.state_dict().items()})  # in place: same storage
        ref.load_state_dict(fused.state_dict())
        _close(fused(ids), ref(ids))
        fused.word_embeddings.weight.data = torch.randn(500, 200)  # new storage
        ref.word_embeddings.weight.data = fused.word_embeddings.weight.data.clone()
        _close(fused(ids), ref(ids))


@pytest.mark.parametrize("batch", [1, 64])  # serial; all threads
def test_a_table_cut_at_the_same_address_is_seen(batch):
    """A word table replaced by its own first rows (same address, fewer rows) bounds the ids, in both layers, with the
    same error."""
    ref, fused = _pair()
    bad = torch.randint(0, 300, (batch, 9))
    bad[-1, -1] = 400
    with torch.no_grad():
        fused(torch.randint(0, 500, (batch, 9)))  # a warm call
        for layer in (ref, fused):
            layer.word_embeddings.weight.data = layer.word_embeddings.weight.data[:300]
        for layer in (ref, fused):
            with pytest.raises(ValueError, match=r"holds 400 .*\[0, 300\)"):
                layer(bad)
        ids = torch.randint(0, 300, (1, 9))
        _close(fused(ids), ref(ids))


@pytest.mark.parametrize("norm", [torch.bfloat16, torch.float32])  # float32: mixed precision
@pytest.mark.parametrize("shape,offset,types", [((1, 11), 0, True), ((1, 1), 0, False), ((3, 7), 5, True),
                                                 ((16, 64), 0, True), ((40, 17), 3, False)])  # these on all threads
def test_bfloat16_layers(shape, offset, types, norm):
    """A bfloat16 layer (`.to(torch.bfloat16)`: all five tables; or with its LayerNorm kept in float32): the same
    numbers with default and with explicit position ids, the reference's within assert_close's bfloat16 defaults, in
    bfloat16 as the reference's; a LayerNorm weight changed in place is read at the next call."""
    ref, fused = (layer.to(torch.bfloat16) for layer in _pair())
    for layer in (ref, fused):
        layer.LayerNorm.to(norm)
    ids = torch.randint(0, 500, shape)
    tts = torch.randint(0, 2, shape) if types else None
    positions = torch.arange(shape[1])[None] + offset
    with torch.no_grad():
        for _ in range(2):
            out = fused(ids, tts, past_key_values_length=offset)
            assert out.dtype == torch.bfloat16 and out.shape == (*shape, 200)
            assert torch.equal(out, fused(ids, tts, past_key_values_length=offset, position_ids=positions))
            expected = ref(ids, tts, past_key_values_length=offset)
            assert expected.dtype == torch.bfloat16
            torch.testing.assert_close(out, expected)
            for layer in (ref, fused):
                layer.LayerNorm.weight.mul_(-0.5)


def test_float32_tables_with_a_bfloat16_layer_norm_are_refused_as_torch_refuses_them():
    """torch's own LayerNorm refuses this mix, so every backend raises."""
    _, fused = _pair()
    fused.LayerNorm.to(torch.bfloat16)
    with torch.no_grad():
        for shape in ((1, 9), (64, 64)):
            ids = torch.randint(0, 500, shape)
            with pytest.raises(ValueError, match="bfloat16 but the embeddings they normalise are torch.float32"):
                fused(ids)


def test_the_first_fused_forward_keeps_the_thread_counts_asked_for():
    """numba's OpenMP pool, launched by the first fused forward, set the OpenMP thread count that torch reads too:
    `torch.set_num_threads(1)` read 2 afterwards. In a fresh process, where the pool has not started; the batch is
    large enough for the parallel kernel, which must then run on one thread."""
    code = ("import numba, torch\n"
            "from bertembed import BertEmbeddings, EmbeddingConfig\n"
            "torch.set_num_threads(1)\n"
            "layer = BertEmbeddings(EmbeddingConfig(vocab_size=500, hidden_size=384), backend='cpu').eval()\n"
            "with torch.no_grad():\n"
            "    layer(torch.randint(0, 500, (8, 128)))\n"
            "print(torch.get_num_threads(), numba.get_num_threads())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"]


def test_copies_and_pickles_compute_from_their_own_tables():
    """A pickle taken after a call is as large as one taken before it (no second copy of the tables), and each copy
    computes from its own tables, as the reference layer does."""
    import copy
    import io

    def pickled(layer) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save(layer, buffer)
        buffer.seek(0)
        return buffer

    ref, fused = _pair()
    ids = torch.randint(0, 500, (2, 9))
    before = pickled(fused).getbuffer().nbytes
    with torch.no_grad():
        fused(ids)
        assert pickled(fused).getbuffer().nbytes == before
        twin, loaded = copy.deepcopy(fused), torch.load(pickled(fused), weights_only=False)
        for layer in (ref, twin):
            layer.word_embeddings.weight.mul_(2.0)  # the twin's own tables, not the original's
        _close(twin(ids), ref(ids))
        _close(loaded(ids), fused(ids))
        assert not torch.equal(fused(ids), twin(ids))


_FORKED = '''
import logging, os, signal, sys, torch
from bertembed import BertEmbeddings, EmbeddingConfig
pool = sys.argv[2] != "threads set to 1"
torch.manual_seed(0)
config = EmbeddingConfig(vocab_size=500, hidden_size=384, hidden_dropout_prob=0.0)
fused = BertEmbeddings(config, backend="cpu").eval()
ids = torch.randint(0, 500, (16, 128))
upstream = torch.linspace(-1, 1, 384).repeat(16, 128, 1)  # (the sum of squares of a LayerNorm is constant)
if sys.argv[2] != "torch's pool only":  # a batch on numba's pool: the parent's GNU OpenMP is in use
    with torch.no_grad():
        fused(ids)
if pool:  # and torch's own
    torch.set_num_threads(2)
    torch.ones(1 << 22).add_(1)
torch.save(fused.state_dict(), sys.argv[1] + ".weights")
pid = os.fork()
if pid == 0:
    status = 1
    try:
        signal.alarm(120)  # a hang ends the child, and fails the test
        logging.basicConfig(level=logging.INFO)
        if not pool:  # what DataLoader workers do: torch's own OpenMP cannot run in a forked child either
            torch.set_num_threads(1)
        with torch.no_grad():
            out = fused(ids)
        fused.train()
        grad, = torch.autograd.grad(fused(ids), fused.word_embeddings.weight, upstream)  # (no torch op of its own)
        torch.save({"ids": ids, "out": out, "grad": grad}, sys.argv[1])
        status = 0
    finally:
        os._exit(status)
print(os.waitpid(pid, 0)[1])
'''


@pytest.mark.parametrize("pool", ["threads set to 1", "pool", "torch's pool only"])
def test_a_forked_child_runs_where_numbas_pool_cannot(tmp_path, pool):
    """numba's GNU OpenMP pool cannot run in a process forked after it started: numba ends the child ("fork() called
    from a process already using GNU OpenMP"), as multiprocessing's default 'fork' start and DataLoader workers
    would meet. In the child, inference and training take the serial kernels, and give the reference's numbers;
    "pool": also where the parent had used torch's own pool and the child did not set torch's threads to 1 (the
    backward's zeros were torch's, which never returned there); "torch's pool only": the parent built the layer
    but never called it (the kernels not even imported), and their first parallel call in the child hung on the
    state torch's pool left. In a fresh process, with timeouts: a child could hang, not fail."""
    saved = tmp_path / "child.pt"
    done = subprocess.run([sys.executable, "-c", _FORKED, str(saved), pool], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["0"], done.stdout + done.stderr
    child = torch.load(saved)
    ref = BertEmbeddings(EmbeddingConfig(vocab_size=500, hidden_size=384, hidden_dropout_prob=0.0)).eval()
    ref.load_state_dict(torch.load(f"{saved}.weights"))
    with torch.no_grad():
        _close(child["out"], ref(child["ids"]))
    ref.train()
    (ref(child["ids"]) * torch.linspace(-1, 1, 384)).sum().backward()
    assert_grad_close(child["grad"], ref.word_embeddings.weight.grad)
