"""Scaling out on torch's engines (`bertembed.parallel`, docs/distributed.md) with gloo on the CPU: 2 and 3 processes
on this machine stand in for ranks on several hosts (torchrun gives each rank the same few environment variables:
its rank, the world size, the rendezvous address). The vocabulary's 101 rows split unevenly: 51 + 50, 34 + 34 + 33.

One spawn per world size runs every case on every rank and saves what each rank saw; the tests hold it to the
single-process model, built from the same seed:
- tensor parallel (`shard_vocab`) on bertembed's layer (reference, fused CPU and Triton backends: Triton's kernel in
  its interpreter, TRITON_INTERPRET=1, as no GPU is here, on 2 ranks), on a patched transformers model and on a plain
  one: outputs and whole gradients, and no allocation the size of a whole [V, H] table in the step (torch's profiler:
  each rank writes its own rows' gradient); a sharded nn.Embedding's lookup makes one [B, L, H] tensor, its output,
  and its backward none;
- a masked-LM model whose head is tied to the word table, sharded: the head's logits rest sharded by columns, the
  vocab-parallel cross-entropy gives one process's loss and gradients (the tied table's: the sum of both uses), and no
  allocation holds the whole logits; the cross-entropy alone against torch's (ignore_index, label smoothing);
- a bad id: the same ValueError on every rank, and a collective after it still pairs up (no rank waits in a lookup);
  one on one rank alone: a ValueError on every rank too;
- DistributedDataParallel and FSDP2 (`fully_shard`) on a patched model, the batch split over the ranks: outputs and
  gradients;
- torch.distributed.checkpoint: a sharded masked-LM model saved, then loaded into one of other weights: equal; saved by
  2 ranks, loaded into 3 ranks and into one process: equal;
- `from_pretrained(device_mesh=...)`: each rank's rows are torch's own split of the table, read while reading the
  whole word table raises.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from datetime import timedelta
from unittest import mock

import pytest
import torch

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")
transformers = pytest.importorskip("transformers", reason="the patched and plain models come from transformers "
                                   "(the dev extra)")

import bertembed  # noqa: E402
import bertembed.fast  # noqa: E402
from bertembed import BertEmbeddings, EmbeddingConfig  # noqa: E402
from bertembed.checkpoint import load_checkpoint  # noqa: E402

VOCAB, HIDDEN = 101, 24  # 101: uneven over 2 and 3 ranks
BATCH = 6  # split over 2 or 3 ranks under FSDP2
# the Triton kernel in its interpreter on the ranks' CPU tensors (TRITON_INTERPRET=1 set for them; on a GPU host the
# kernel is compiled, and the gloo ranks hold CPU tensors)
TRITON = importlib.util.find_spec("triton") is not None and not torch.cuda.is_available()
INTERPRETED = {"TRITON_INTERPRET": "1"} if TRITON else {}
TP_CASES = ("layer reference", "layer cpu", *("layer triton",) * TRITON, "patched model", "plain model")
SMOOTHING = 0.1


def layer(backend: str, seed: int = 0) -> BertEmbeddings:
    torch.manual_seed(seed)
    net = BertEmbeddings(EmbeddingConfig(vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=32,
                                         hidden_dropout_prob=0.0), backend=backend)
    with torch.no_grad():
        net.LayerNorm.weight.uniform_(0.5, 1.5)
        net.LayerNorm.bias.uniform_(-0.2, 0.2)
    return net.train()


def hf_model(patched: bool, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    model = transformers.BertModel(config, add_pooling_layer=False).train()
    return bertembed.patch(model, backend="cpu") if patched else model


def masked_lm(seed: int = 0):
    """A patched BertForMaskedLM, its decoder tied to the word table."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return bertembed.patch(transformers.BertForMaskedLM(config).train(), backend="cpu")


def labels() -> torch.Tensor:
    """Labels [BATCH, 10]: the last row among them, a third ignored (-100)."""
    found = torch.randint(0, VOCAB, (BATCH, 10), generator=torch.Generator().manual_seed(3))
    found[:, ::3], found[0, 1] = -100, VOCAB - 1
    return found


def allocations(prof) -> set[int]:
    """The sizes in bytes of the allocations torch's profiler (profile_memory=True) saw."""
    return {event.cpu_memory_usage for event in prof.events() if event.cpu_memory_usage > 0}


def profiled():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def make(case: str):
    return {"layer reference": lambda: layer("reference"), "layer cpu": lambda: layer("cpu"),
            "layer triton": lambda: layer("triton"), "patched model": lambda: hf_model(True),
            "plain model": lambda: hf_model(False)}[case]()


def batch():
    """ids [BATCH, 10] reaching the last row of the table, a word repeated in every row (its gradient sums over
    tokens, across shards' boundaries) and padding; the attention mask; an upstream gradient [BATCH, 10, H]."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, 10), generator=gen)
    ids[:, 0], ids[0, 1], ids[:, 5], ids[3, 7:] = 7, VOCAB - 1, 50, 0
    return ids, (ids != 0).long(), torch.randn(BATCH, 10, HIDDEN, generator=gen)


def step(net, ids, mask, upstream) -> torch.Tensor:
    """Forward, then backward of sum(output * upstream); returns the output [B, L, H]."""
    out = net(ids) if isinstance(net, BertEmbeddings) else net(input_ids=ids, attention_mask=mask).last_hidden_state
    (out * upstream).sum().backward()
    return out.detach()


def whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def grads(net) -> dict[str, torch.Tensor]:
    return {name: whole(p.grad) for name, p in net.named_parameters()}


# --- on each rank ---

def worker(rank: int, world: int, port: int, folder: str, earlier: str | None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # (a rank left waiting in a collective fails after this, not the 30 minutes of gloo's default: long enough for a
    # busy machine, where a rank may start minutes after another)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=5))
    try:
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (world,))
        # (Triton's interpreter on 2 ranks alone: its import and interpreted kernels cost each rank seconds)
        seen = {case: tensor_parallel(case, mesh) for case in TP_CASES if case != "layer triton" or world == 2}
        seen["lookup"] = lookup(mesh)
        seen |= {"bad id": bad_ids(mesh), "ddp": ddp(rank, world), "fsdp2": fsdp2(rank, world),
                 "masked lm": tied_head(mesh), "cross-entropy": cross_entropy(mesh),
                 "dcp": dcp_round_trip(mesh, folder, earlier), "loading": rank_local(mesh, folder)}
        torch.save(seen, os.path.join(folder, f"rank{rank}.pt"))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Done, and what each rank saw saved: leave without the interpreter's and C++'s teardown. That teardown now and
    # then aborts a rank after all its Python code has run ("terminate called without an active exception", no Python
    # frame), with a plain transformers model too: 2 of 70 runs with no bertembed in the process, 1 of 40 with it.
    os._exit(0)


def tensor_parallel(case: str, mesh) -> dict:
    from bertembed.parallel import shard_vocab

    bertembed.fast._told.clear()  # the reasons the reference ran instead of the kernel, from here on
    net = shard_vocab(make(case), mesh)
    word = net.word_embeddings if isinstance(net, BertEmbeddings) else net.embeddings.word_embeddings
    with profiled() as prof:
        out = step(net, *batch())
    return {"out": out, "grads": grads(net), "fell back": sorted(bertembed.fast._told),
            "rows": word.weight.to_local().shape[0], "grad rows": word.weight.grad.to_local().shape[0],
            "allocations": allocations(prof)}


def lookup(mesh) -> dict:
    """A sharded nn.Embedding (padding row 0) alone: its rows and gradient, and the sizes of what its forward and its
    backward allocated."""
    from bertembed.parallel import shard_vocab

    torch.manual_seed(0)
    table = shard_vocab(torch.nn.Embedding(VOCAB, HIDDEN, padding_idx=0), mesh)
    ids, _, upstream = batch()
    with profiled() as forward:
        rows = table(ids)
    with profiled() as backward:
        rows.backward(upstream)
    # (an op's own allocations, not its callees': each allocation counted once)
    sizes = ([e.self_cpu_memory_usage for e in p.events() if e.self_cpu_memory_usage > 0] for p in (forward, backward))
    return {"rows": rows.detach(), "grad": table.weight.grad.full_tensor(), "allocated": tuple(sizes)}


def tied_head(mesh) -> dict:
    from bertembed.parallel import shard_vocab, vocab_parallel_cross_entropy

    bertembed.fast._told.clear()
    net = shard_vocab(masked_lm(), mesh)
    ids, mask, _ = batch()
    with profiled() as prof:
        logits = net(input_ids=ids, attention_mask=mask).logits
        loss = vocab_parallel_cross_entropy(logits, labels(), label_smoothing=SMOOTHING)
        loss.backward()
    try:
        vocab_parallel_cross_entropy(logits, torch.full((BATCH, 10), VOCAB))
        bad = None
    except ValueError as err:
        bad = str(err)
    return {"loss": loss.detach(), "grads": grads(net), "local logits": tuple(logits.to_local().shape),
            "allocations": allocations(prof), "bad label": bad,
            "tied": net.cls.predictions.decoder.weight is net.bert.embeddings.word_embeddings.weight,
            "fell back": sorted(bertembed.fast._told)}


def cross_entropy(mesh) -> dict:
    """The loss alone on float64 logits [BATCH, 10, VOCAB] sharded by columns: {smoothing: (loss, whole gradient)}."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from bertembed.parallel import vocab_parallel_cross_entropy

    found = {}
    for smoothing in (0.0, SMOOTHING):
        logits = distribute_tensor(ce_logits(), mesh, [Shard(2)]).requires_grad_()
        loss = vocab_parallel_cross_entropy(logits, labels(), label_smoothing=smoothing)
        loss.backward()
        found[smoothing] = (loss.detach(), logits.grad.full_tensor())
    logits = distribute_tensor(few_logits(), mesh, [Shard(1)]).requires_grad_()  # (3 ranks: 2, 2 and no columns)
    loss = vocab_parallel_cross_entropy(logits, few_labels(), label_smoothing=SMOOTHING)
    loss.backward()
    found["4 classes"] = (loss.detach(), logits.grad.full_tensor())
    logits = distribute_tensor(masked_logits(), mesh, [Shard(2)]).requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, labels())
    loss.backward()
    found["masked"] = (loss.detach(), logits.grad.full_tensor())
    return found


def masked_logits() -> torch.Tensor:
    """`ce_logits` with -inf in the first and last columns no label names (masked classes, a [PAD] say)."""
    found, named = ce_logits(), set(labels().view(-1).tolist())
    unused = [c for c in range(VOCAB) if c not in named]
    found[..., unused[:2] + unused[-2:]] = -torch.inf
    return found


def few_logits() -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def few_labels() -> torch.Tensor:
    return torch.tensor([3, 0, -100, 2, 1, 3])


def ce_logits() -> torch.Tensor:
    return 4 * torch.randn(BATCH, 10, VOCAB, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


def bad_ids(mesh) -> dict:
    from bertembed.parallel import shard_vocab

    messages = []
    for net, bad in ((layer("cpu"), VOCAB), (layer("reference"), -1), (hf_model(True), VOCAB),
                     (hf_model(False), VOCAB + 5)):
        shard_vocab(net, mesh)
        ids = batch()[0]
        ids[2, 4] = bad
        try:
            net(ids)
            messages.append(None)
        except ValueError as err:
            messages.append(str(err))
    net, ids = shard_vocab(layer("cpu"), mesh), batch()[0]
    ids[1, 2] = VOCAB if torch.distributed.get_rank() == 0 else ids[1, 2]  # rank 0's ids alone
    try:
        net(ids)
        alone = None
    except ValueError as err:
        alone = str(err)
    count = torch.ones(1)
    torch.distributed.all_reduce(count)  # every rank gets here: none waits in a lookup's all-reduce
    options = []
    for table in (torch.nn.Embedding(VOCAB, HIDDEN, max_norm=1.0, scale_grad_by_freq=True),
                  torch.nn.Embedding(VOCAB, HIDDEN, sparse=True)):
        try:
            shard_vocab(table, mesh)
            options.append(None)
        except ValueError as err:
            options.append(str(err))
    return {"messages": messages, "ranks": count.item(), "rank 0 alone": alone, "options": options}


def ddp(rank: int, world: int) -> dict:
    bertembed.fast._told.clear()
    net = torch.nn.parallel.DistributedDataParallel(hf_model(True))
    ids, mask, upstream = batch()
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    out = step(net, ids[mine], mask[mine], upstream[mine] * world)  # DDP averages gradients over the ranks
    return {"out": out, "grads": grads(net.module), "fell back": sorted(bertembed.fast._told)}


def fsdp2(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    bertembed.fast._told.clear()
    net = hf_model(True)
    inside = []
    net.embeddings.register_forward_pre_hook(lambda m, args: inside.append(tuple(m.word_embeddings.weight.shape)))
    fully_shard(net.embeddings)
    fully_shard(net)
    at_rest = net.embeddings.word_embeddings.weight.to_local().shape[0]
    ids, mask, upstream = batch()
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    out = step(net, ids[mine], mask[mine], upstream[mine] * world)  # FSDP2 averages gradients over the ranks
    return {"out": out, "grads": grads(net), "rows at rest": at_rest, "inside forward": inside,
            "fell back": sorted(bertembed.fast._told)}


def dcp_round_trip(mesh, folder: str, earlier: str | None) -> dict:
    """A sharded masked-LM model saved, then loaded into one of other weights; the checkpoint that `earlier` ranks
    (another world size) saved loaded too."""
    import torch.distributed.checkpoint as dcp

    from bertembed.parallel import shard_vocab

    saved, loaded = shard_vocab(masked_lm(), mesh), shard_vocab(masked_lm(seed=1), mesh)
    before = max((whole(a) - whole(b)).abs().max().item()
                 for a, b in zip(saved.state_dict().values(), loaded.state_dict().values(), strict=True))
    dcp.save(saved.state_dict(), checkpoint_id=os.path.join(folder, "dcp"))
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(folder, "dcp"))  # (in place: the state dict's tensors are the model's)
    equal = all(torch.equal(whole(a), whole(b))
                for a, b in zip(saved.state_dict().values(), loaded.state_dict().values(), strict=True))
    found = {"differed before": before, "equal after": equal,
             "word sharded": type(loaded.bert.embeddings.word_embeddings.weight).__name__}
    if earlier is not None:
        other = shard_vocab(masked_lm(seed=1), mesh)
        state = other.state_dict()
        dcp.load(state, checkpoint_id=os.path.join(earlier, "dcp"))
        found["equal from earlier"] = all(torch.equal(whole(a), whole(b)) for a, b in
                                          zip(saved.state_dict().values(), other.state_dict().values(), strict=True))
    return found


def rank_local(mesh, folder: str) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.tensor import Shard, distribute_tensor

    from bertembed import tensor_files

    read = tensor_files._SafetensorsHandle.get_tensor

    def refuse_the_word_table(handle, key):
        if key.endswith("word_embeddings.weight"):
            raise AssertionError(f"the whole word table {key} was read")
        return read(handle, key)

    tensor_files._SafetensorsHandle.get_tensor = refuse_the_word_table
    try:
        net = BertEmbeddings.from_pretrained(os.path.join(folder, "layer"), device_mesh=mesh, backend="cpu")
    finally:
        tensor_files._SafetensorsHandle.get_tensor = read
    weight = net.word_embeddings.weight
    full = load_file(os.path.join(folder, "layer", "model.safetensors"))["embeddings.word_embeddings.weight"]
    ids, _, upstream = batch()
    out = net(ids)
    (out * upstream).sum().backward()  # (the gradient rests sharded too, on a table made by to_empty)
    net.save_pretrained(os.path.join(folder, "saved"))  # (every rank: the rows gathered, rank 0 writes)
    saved = sorted(os.listdir(os.path.join(folder, "saved")))  # (every rank returns once it is written)
    with open(os.path.join(folder, "blocked"), "w") as blocked:  # (a file where a folder should be)
        blocked.write("x")
    try:
        net.save_pretrained(os.path.join(folder, "blocked", "saved"))
        failure = None
    except (OSError, ValueError) as err:  # (every rank hears of rank 0's failure: none waits for it)
        failure = type(err).__name__
    return {"rows": weight.to_local(), "torch's split": distribute_tensor(full, mesh, [Shard(0)]).to_local(),
            "shape": tuple(weight.shape), "out": out.detach(), "grad rows": weight.grad.to_local().shape[0],
            "saved": saved, "failure": failure}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the tests, in the process that spawns the ranks ---

@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request, tmp_path_factory):
    """What each rank saw: [rank] -> {case: ...}. 3 ranks also load the checkpoint 2 ranks saved, where they ran."""
    world, folder = request.param, tmp_path_factory.getbasetemp() / f"world{request.param}"
    folder.mkdir()
    earlier = tmp_path_factory.getbasetemp() / "world2"
    earlier = str(earlier) if world == 3 and (earlier / "dcp").exists() else None
    layer("cpu").eval().save_pretrained(folder / "layer")
    with mock.patch.dict(os.environ, INTERPRETED if world == 2 else {}):  # (the ranks' environment)
        torch.multiprocessing.spawn(worker, args=(world, free_port(), str(folder), earlier), nprocs=world, join=True)
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]


def single(case: str) -> dict:
    with mock.patch.dict(os.environ, INTERPRETED):  # (conftest imported triton interpreted)
        net = make(case)
        return {"out": step(net, *batch()), "grads": grads(net)}


def assert_grads_close(got: dict, expected: dict) -> None:
    """Gradients within rtol 1e-5: the word table's sums the same tokens' rows in another order than the single
    process does (torch's dense backward over the gathered rows; FSDP2's sum over ranks). atol 1e-5 of the table's own
    largest entry for the embedding tables, of the model's largest gradient elsewhere: the attention key bias's is zero
    analytically (softmax ignores a shift shared by every key), rounding noise in each run."""
    assert got.keys() == expected.keys()
    largest = max(grad.abs().max().item() for grad in expected.values())
    for name, grad in expected.items():
        scale = grad.abs().max().item() if "embeddings" in name or "LayerNorm" in name else largest
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}")


def test_a_sharded_lookup_makes_one_tensor_of_rows(ranks):
    """Each rank's rows are summed by an all-reduce in place: the lookup's forward makes one [B, L, H] tensor (its
    output), its backward none (the gradient of the rank's ids is gathered, a part of [B, L, H]); the rows and the
    gradient equal one process's nn.Embedding's bit for bit (its backward adds the same rows in the same order)."""
    torch.manual_seed(0)
    table = torch.nn.Embedding(VOCAB, HIDDEN, padding_idx=0)
    ids, _, upstream = batch()
    rows = table(ids)
    rows.backward(upstream)
    size = rows.nbytes
    for seen in ranks:
        got = seen["lookup"]
        torch.testing.assert_close(got["rows"], rows.detach(), rtol=0, atol=0)
        torch.testing.assert_close(got["grad"], table.weight.grad, rtol=0, atol=0)
        forward, backward = got["allocated"]
        assert forward.count(size) == 1 and size not in backward


@pytest.mark.parametrize("case", TP_CASES)
def test_tensor_parallel_equals_one_process(ranks, case):
    """Outputs bit for bit (the sharded lookup adds each row to zeros), gradients to rounding; the fused kernel ran
    (nothing fell back to the reference); the table and its gradient rest sharded, in torch's split."""
    if case not in ranks[0]:
        pytest.skip("the Triton case runs on 2 ranks only: its interpreter costs each rank seconds, and 3 ranks "
                    "already run the same sharded path on the reference and CPU backends")
    expected, world = single(case), len(ranks)
    for rank, seen in enumerate(ranks):
        got = seen[case]
        torch.testing.assert_close(got["out"], expected["out"], rtol=0, atol=0)
        assert_grads_close(got["grads"], expected["grads"])
        assert got["fell back"] == []
        assert got["rows"] == got["grad rows"] == torch.arange(VOCAB).chunk(world)[rank].numel()
        # no whole [V, H] float32 table (torch's own sharded backward made one, the gradient; 101 * 24 * 4 bytes is the
        # size of nothing else in these models: 101 is prime)
        assert VOCAB * HIDDEN * 4 not in got["allocations"]


def test_a_tied_masked_lm_head_shards_with_its_table(ranks):
    """One process's loss (torch's cross_entropy, label smoothing, -100 ignored) and gradients, the word table's
    the sum of its lookup's and its head's; the logits rest sharded by columns and no allocation holds them whole."""
    net, world = masked_lm(), len(ranks)
    ids, mask, _ = batch()
    logits = net(input_ids=ids, attention_mask=mask).logits
    loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels().view(-1), label_smoothing=SMOOTHING)
    loss.backward()
    expected = grads(net)
    for rank, seen in enumerate(ranks):
        got = seen["masked lm"]
        assert got["tied"] and got["fell back"] == []
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-6, atol=0)
        assert_grads_close(got["grads"], expected)
        assert got["local logits"] == (BATCH, 10, torch.arange(VOCAB).chunk(world)[rank].numel())
        assert VOCAB * HIDDEN * 4 not in got["allocations"] and max(got["allocations"]) < BATCH * 10 * VOCAB * 4
        assert got["bad label"].startswith(f"labels hold {VOCAB}, outside the {VOCAB} classes")


def test_vocab_parallel_cross_entropy_equals_torchs(ranks):
    """float64 logits: torch's cross_entropy and its gradient (autograd), with ignore_index=-100, without and with
    label smoothing, to rounding."""
    for smoothing in (0.0, SMOOTHING):
        logits = ce_logits().requires_grad_()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels().view(-1), label_smoothing=smoothing)
        loss.backward()
        for seen in ranks:
            got, gradient = seen["cross-entropy"][smoothing]
            torch.testing.assert_close(got, loss.detach(), rtol=1e-12, atol=0)
            torch.testing.assert_close(gradient, logits.grad, rtol=1e-10, atol=1e-15)
    # 4 classes: torch's split leaves the third rank without columns; masked classes: -inf logits (no NaN)
    for case, logits, gold, smoothing in (("4 classes", few_logits(), few_labels(), SMOOTHING),
                                          ("masked", masked_logits(), labels(), 0.0)):
        logits.requires_grad_()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), gold.view(-1),
                                                 label_smoothing=smoothing)
        loss.backward()
        assert loss.isfinite()
        for seen in ranks:
            got, gradient = seen["cross-entropy"][case]
            torch.testing.assert_close(got, loss.detach(), rtol=1e-12, atol=0)
            torch.testing.assert_close(gradient, logits.grad, rtol=1e-10, atol=1e-15)


def test_cross_entropy_refuses_logits_not_sharded_by_columns():
    from bertembed.parallel import vocab_parallel_cross_entropy

    with pytest.raises(ValueError, match="DTensor sharded by its last dimension"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3, VOCAB), torch.zeros(2, 3, dtype=torch.long))


def test_a_bad_id_raises_on_every_rank(ranks):
    for seen in ranks:
        messages = seen["bad id"]["messages"]
        assert all(m is not None and "input_ids" in m for m in messages), messages
        assert str(VOCAB) in messages[0] and "-1" in messages[1] and str(VOCAB + 5) in messages[3]
        assert seen["bad id"]["ranks"] == len(ranks)
    assert len({tuple(seen["bad id"]["messages"]) for seen in ranks}) == 1  # the same words everywhere


def test_a_table_that_renormalises_or_scales_its_gradient_is_refused(ranks):
    """max_norm, scale_grad_by_freq and sparse change what torch's lookup computes or gives: refused, not silently
    dropped."""
    for seen in ranks:
        assert seen["bad id"]["options"] == [
            "the table has max_norm, scale_grad_by_freq set: the sharded lookup reads its rows as they are and writes "
            "dense, unscaled gradients; unset max_norm and scale_grad_by_freq first",
            "the table has sparse set: the sharded lookup reads its rows as they are and writes dense, unscaled "
            "gradients; unset sparse first"]


def test_a_bad_id_on_one_rank_raises_on_every_rank(ranks):
    """Rank 0's ids alone hold a bad one: rank 0's error names it, every other rank's says another rank has one, and
    a collective after it pairs up. The other ranks waited in the lookup's all-reduce (until gloo's timeout)."""
    assert ranks[0]["bad id"]["rank 0 alone"].startswith(f"input_ids holds {VOCAB} at index (1, 2)")
    for seen in ranks[1:]:
        assert seen["bad id"]["rank 0 alone"].startswith(f"input_ids of another rank hold an id outside the word "
                                                         f"table's {VOCAB} rows")


def _each_rank_did_its_part(ranks, engine: str):
    """Each rank's output is the single process's on its part of the batch, bit for bit, and its gradients the single
    process's on the whole batch; yields (rank, what the rank saw under `engine`)."""
    expected, world = single("patched model"), len(ranks)
    for rank, seen in enumerate(ranks):
        got = seen[engine]
        mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        torch.testing.assert_close(got["out"], expected["out"][mine], rtol=0, atol=0)
        assert_grads_close(got["grads"], expected["grads"])
        yield rank, got


def test_ddp_equals_one_process(ranks):
    """Training under DistributedDataParallel: each rank computes its part of the batch, and the gradients, averaged
    over the ranks, are the single process's on the whole batch; the fused kernel ran."""
    for _, got in _each_rank_did_its_part(ranks, "ddp"):
        assert got["fell back"] == []


def test_fsdp2_equals_one_process(ranks):
    """Each rank computes its part of the batch with the whole table, gathered for the forward (and the fused kernel
    reads it), and rests with its own rows."""
    world = len(ranks)
    for rank, got in _each_rank_did_its_part(ranks, "fsdp2"):
        assert got["rows at rest"] == torch.arange(VOCAB).chunk(world)[rank].numel()
        assert got["inside forward"] == [(VOCAB, HIDDEN)]
        assert got["fell back"] == []


def test_a_sharded_checkpoint_saves_and_loads_back_equal(ranks, tmp_path_factory):
    """Into the same ranks, into 3 from 2 (where 2 ran first), and into one process: the tables of the model saved."""
    import torch.distributed.checkpoint as dcp

    for seen in ranks:
        assert seen["dcp"]["differed before"] > 0.01
        assert seen["dcp"]["equal after"]
        assert seen["dcp"]["word sharded"] == "DTensor"
        assert seen["dcp"].get("equal from earlier", True)
    state = masked_lm(seed=1).state_dict()
    dcp.load(state, checkpoint_id=tmp_path_factory.getbasetemp() / f"world{len(ranks)}" / "dcp")
    expected = masked_lm().state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    if len(ranks) == 3 and "equal from earlier" not in ranks[0]["dcp"]:
        pytest.skip("no checkpoint of 2 ranks to load into 3 (run the 2 ranks' tests first)")


def test_loading_by_rank_reads_only_its_rows(ranks, tmp_path_factory):
    """The rows are torch's own split (`distribute_tensor`), read while `get_tensor` of the word table raises; the
    layer gives the single-process layer's outputs."""
    world = len(ranks)
    expected = layer("cpu").eval()(batch()[0]).detach()
    for rank, seen in enumerate(ranks):
        got = seen["loading"]
        assert torch.equal(got["rows"], got["torch's split"])
        assert got["rows"].shape[0] == got["grad rows"] == torch.arange(VOCAB).chunk(world)[rank].numel()
        assert got["shape"] == (VOCAB, HIDDEN)
        torch.testing.assert_close(got["out"], expected, rtol=0, atol=0)
    saved = tmp_path_factory.getbasetemp() / f"world{world}" / "saved"  # the sharded layer's save_pretrained
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "model.safetensors"]
    assert all(seen["loading"]["saved"] == ["config.json", "model.safetensors"] for seen in ranks)
    assert all(seen["loading"]["failure"] in ("NotADirectoryError", "OSError") for seen in ranks)
    whole = layer("cpu").state_dict()
    assert all(torch.equal(value, whole[key]) for key, value in BertEmbeddings.from_pretrained(saved).state_dict()
               .items())


def test_a_bin_checkpoint_cannot_be_read_by_rank(tmp_path):
    """A `.bin` file is read whole by torch.load: refused, naming the fix, rather than each rank holding the table."""
    net = layer("reference")
    torch.save({f"embeddings.{k}": v for k, v in net.state_dict().items()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="cannot be read in part.*safetensors"):
        load_checkpoint(tmp_path, word_reader=lambda sliced: sliced[:])
