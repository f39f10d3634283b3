"""The fused layer reads its submodules' tables and calls none of them, so it may stand in for them only while they are
plain. Hooks (captum's layer attributions, activation capture, a global module hook), a subclass with its own forward,
a wrapper (a LoRA adapter), a parametrized weight and `max_norm` make it run the reference layer, which calls them
(`bertembed.fast.can_fuse` says why); on the word table alone, they make the word module look its rows up itself and
the kernel do the rest (`bertembed.fast.gathered_rows`); a LayerNorm eps or a dropout flag changed is read at the
next call. Every case is first checked to change the output, so that agreeing with the reference means something."""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")

from bertembed.fast import can_fuse  # noqa: E402
from kernel_helpers import assert_grads_match, assert_output_close, awkward_ids, twins  # noqa: E402

VOCAB = 1000


class Doubled(nn.Embedding):
    """A subclass with its own forward."""

    def forward(self, ids):
        return super().forward(ids) * 2


class Adapter(nn.Module):
    """A LoRA-style wrapper, as peft's: the table it wraps plus a low-rank update; `weight` reads the table's."""

    def __init__(self, base: nn.Embedding) -> None:
        super().__init__()
        self.base_layer = base
        gen = torch.Generator().manual_seed(3)
        self.a = nn.Parameter(torch.randn(base.num_embeddings, 2, generator=gen))
        self.b = nn.Parameter(torch.randn(2, base.embedding_dim, generator=gen) * 0.05)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, ids):
        return self.base_layer(ids) + F.embedding(ids, self.a) @ self.b


class ShiftedNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) + 0.5


class AlwaysDropout(nn.Module):
    """Monte Carlo dropout: on in eval mode too."""

    def forward(self, x):
        return F.dropout(x, 0.5, training=True)


def _subclass(layer):
    table = Doubled(VOCAB, layer.config.hidden_size)
    table.weight = layer.word_embeddings.weight  # the same parameter: the same storage, only the type differs
    layer.word_embeddings = table


CHANGES = {
    "word forward hook": lambda layer: layer.word_embeddings.register_forward_hook(lambda m, args, out: out * 2),
    "segment pre-hook": lambda layer: layer.token_type_embeddings.register_forward_pre_hook(
        lambda m, args: (1 - args[0],)),
    "position forward hook": lambda layer: layer.position_embeddings.register_forward_hook(
        lambda m, args, out: out.flip(-2)),
    "LayerNorm forward hook": lambda layer: layer.LayerNorm.register_forward_hook(lambda m, args, out: out + 0.5),
    "dropout forward hook": lambda layer: layer.dropout.register_forward_hook(lambda m, args, out: out * 3),
    "subclass with its own forward": _subclass,
    "LoRA-style wrapper": lambda layer: setattr(layer, "word_embeddings", Adapter(layer.word_embeddings)),
    "LayerNorm subclass": lambda layer: setattr(layer, "LayerNorm", _copied(ShiftedNorm, layer.LayerNorm)),
    "always-on dropout": lambda layer: setattr(layer, "dropout", AlwaysDropout()),
    "forward set on the instance": lambda layer: setattr(layer.LayerNorm, "forward", _shifted(layer.LayerNorm)),
}


def _shifted(norm: nn.LayerNorm):
    """A forward set on the module itself, as accelerate's `add_hook_to_module` sets one."""
    own = norm.forward
    return lambda x: own(x) - 0.5


def _copied(kind, norm: nn.LayerNorm) -> nn.LayerNorm:
    new = kind(norm.normalized_shape, eps=norm.eps)
    new.load_state_dict(norm.state_dict())
    return new


def _outputs(layers, ids, grad: bool):
    """Each layer's output for `ids` from the same random state (dropout draws the same mask), and with `grad` the
    backward of one random upstream gradient."""
    outs = []
    for layer in layers:
        torch.manual_seed(5)
        with torch.set_grad_enabled(grad):
            out = layer(ids, token_type_ids=torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(4)))
        if grad:
            (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(6))).sum().backward()
        outs.append(out.detach())
    return outs


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_submodule_runs_itself(change, grad):
    """Inference (the forward kernel alone) and autograd (the custom op) both honour a changed submodule."""
    ref, fused = twins(24, "cpu", vocab=VOCAB)
    plain = copy.deepcopy(ref)
    for layer in (ref, fused):
        CHANGES[change](layer)
    ids = awkward_ids(2, 7, VOCAB)
    out_plain, out_ref, out = _outputs((plain, ref, fused), ids, grad)
    assert (out_ref - out_plain).abs().max() > 1e-2  # the change changes the output
    assert_output_close(out, out_ref)
    if grad:
        assert_grads_match(ref, fused)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # (the ids need no gradient: as meant)
def test_a_backward_hook_on_a_table_runs():
    """A full backward hook on the word table (how activation-gradient tools record) is called, with the
    reference's gradient."""
    ref, fused = twins(24, "cpu", vocab=VOCAB)
    seen = {}
    for name, layer in (("ref", ref), ("fused", fused)):
        layer.word_embeddings.register_full_backward_hook(lambda m, g_in, g_out, name=name: seen.update({name: g_out}))
    _outputs((ref, fused), awkward_ids(2, 7, VOCAB), grad=True)
    torch.testing.assert_close(seen["fused"][0], seen["ref"][0])


def test_a_global_module_hook_runs():
    """`register_module_forward_hook` applies to every module's call, the tables' included."""
    ref, fused = twins(24, "cpu", vocab=VOCAB)
    ids = awkward_ids(2, 7, VOCAB)
    with torch.no_grad():
        out_plain = fused(ids)  # a call with plain submodules first
    doubled = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: out * 2 if isinstance(m, nn.Embedding) and m.num_embeddings == VOCAB else None)
    try:
        with torch.no_grad():
            out_ref, out = ref(ids), fused(ids)
    finally:
        doubled.remove()
    assert (out_ref - out_plain).abs().max() > 1e-2
    assert_output_close(out, out_ref)


def test_changes_after_the_first_call_are_seen_and_undone():
    """The submodules are looked at on every call: a hook added, a table replaced by one that shares its storage,
    `max_norm` or the LayerNorm's eps set after a call are all seen, and the fused kernel comes back once the
    submodules are plain again."""
    ref, fused = twins(24, "cpu", vocab=VOCAB)
    ids = awkward_ids(2, 7, VOCAB)
    with torch.no_grad():
        assert_output_close(fused(ids), ref(ids))
        assert can_fuse(fused) is None
        hooks = [layer.word_embeddings.register_forward_hook(lambda m, args, out: out * 2) for layer in (ref, fused)]
        assert_output_close(fused(ids), ref(ids))
        assert can_fuse(fused) is not None
        for hook in hooks:
            hook.remove()
        assert can_fuse(fused) is None
        plain = fused(ids)
        for layer in (ref, fused):
            _subclass(layer)
        assert_output_close(fused(ids), ref(ids))
        assert (fused(ids) - plain).abs().max() > 1e-2
        for layer in (ref, fused):
            layer.word_embeddings = nn.Embedding.from_pretrained(layer.word_embeddings.weight, freeze=False)
        assert can_fuse(fused) is None
        for layer in (ref, fused):
            layer.dropout.forward = lambda x: x * 2  # set on the instance: no hook is registered
        assert_output_close(fused(ids), ref(ids))
        assert (fused(ids) - plain).abs().max() > 1e-2
        for layer in (ref, fused):
            del layer.dropout.forward
        assert can_fuse(fused) is None
        for layer in (ref, fused):
            layer.LayerNorm.eps = 1e-3  # the rows' variance is about 1e-3: the eps changes the output
        assert_output_close(fused(ids), ref(ids))
        assert (fused(ids) - plain).abs().max() > 1e-2
    out_ref, out = _outputs((ref, fused), ids, grad=True)  # the training path reads the eps too
    assert_output_close(out, out_ref)
    assert_grads_match(ref, fused)
    with torch.no_grad():
        for layer in (ref, fused):
            layer.word_embeddings.max_norm = 0.05  # renormalises the rows it reads, in place
        assert_output_close(fused(ids), ref(ids))
        torch.testing.assert_close(fused.word_embeddings.weight, ref.word_embeddings.weight)


def test_the_fallback_says_why(caplog, monkeypatch):
    monkeypatch.setattr("bertembed.fast._told", set())  # (each reason is logged once a process)
    _, fused = twins(24, "cpu", vocab=VOCAB)
    fused.LayerNorm.register_forward_hook(lambda m, args, out: out)
    with caplog.at_level(logging.INFO, logger="bertembed.fast"), torch.no_grad():
        fused(awkward_ids(1, 5, VOCAB))
    assert "LayerNorm has hooks" in caplog.text


def test_copies_and_pickles_run_the_kernel_on_their_own_submodules():
    _, fused = twins(24, "cpu", vocab=VOCAB)
    ids = awkward_ids(2, 7, VOCAB)
    with torch.no_grad():
        expected = fused(ids)
        for twin in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
            torch.testing.assert_close(twin(ids), expected, rtol=0, atol=0)
            assert can_fuse(twin) is None


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_dropout_follows_its_own_flag(grad):
    """The dropout module's own training flag decides, as in the reference: Monte Carlo dropout (layer in eval, its
    dropout in train) drops, and a layer in training mode with its dropout switched to eval does not."""
    p = 0.25
    ref, fused = twins(256, "cpu", vocab=VOCAB, hidden_dropout_prob=p)
    ids = awkward_ids(8, 64, VOCAB)
    clean = ref(ids).detach()  # eval: no dropout
    fused.dropout.train()  # Monte Carlo dropout
    with torch.set_grad_enabled(grad):
        out = fused(ids).detach()
    kept = out != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.01
    assert_output_close(out[kept], clean[kept] / (1 - p))
    for layer in (ref, fused):
        layer.train()
        layer.dropout.eval()  # training without dropout
    out_ref, out = _outputs((ref, fused), ids, grad)
    assert_output_close(out, out_ref)  # (the reference's dropout is off: nothing dropped)
    if grad:
        assert_grads_match(ref, fused)


class _Scaled(nn.Module):
    def forward(self, weight):
        return weight * 1.5


@pytest.mark.parametrize("name", ["word_embeddings", "position_embeddings", "LayerNorm"])
def test_a_parametrization_added_after_the_first_call(name):
    """`torch.nn.utils.parametrize` moves a weight out of the module's parameters and changes its class, neither of
    which a hook registration would show: the next call computes with the parametrized weight (it used to raise a
    KeyError), in inference and under autograd, whose gradients reach the original weight."""
    from torch.nn.utils import parametrize

    ref, fused = twins(24, "cpu", vocab=VOCAB)
    ids = awkward_ids(2, 7, VOCAB)
    with torch.no_grad():
        plain = fused(ids)
        for layer in (ref, fused):
            parametrize.register_parametrization(getattr(layer, name), "weight", _Scaled())
        out_ref, out = ref(ids), fused(ids)
    assert (out_ref - plain).abs().max() > 1e-2
    assert_output_close(out, out_ref)
    out_ref, out = _outputs((ref, fused), ids, grad=True)
    assert_output_close(out, out_ref)
    originals = [getattr(layer, name).parametrizations.weight.original.grad for layer in (ref, fused)]
    torch.testing.assert_close(originals[1], originals[0], rtol=1e-5, atol=1e-5 * originals[0].abs().max().item())


def test_a_smaller_segment_table_at_the_same_address_is_seen():
    """A segment table replaced by a view of its first row (same address, fewer rows) after a call: segment id 1 is
    then out of range, in the fused layer as in the reference, instead of reading the old row."""
    ref, fused = twins(24, "cpu", vocab=VOCAB)
    ids = awkward_ids(1, 5, VOCAB)
    with torch.no_grad():
        fused(ids, token_type_ids=torch.ones_like(ids))
        for layer in (ref, fused):
            layer.token_type_embeddings.weight.data = layer.token_type_embeddings.weight.data[:1]
        for layer in (ref, fused):
            with pytest.raises(ValueError, match="token_type_ids holds 1"):
                layer(ids, token_type_ids=torch.ones_like(ids))


def test_reset_parameters_refills_the_default_ids():
    """A layer built on the meta device and materialised by `to_empty()` (deferred initialisation, as FSDP does) holds
    uninitialised buffers; `reset_parameters()` fills them as the constructor does."""
    from bertembed import BertEmbeddings, EmbeddingConfig

    config = EmbeddingConfig(vocab_size=VOCAB, hidden_size=24, max_position_embeddings=64)
    with torch.device("meta"):
        layer = BertEmbeddings(config, backend="cpu")
    layer.to_empty(device="cpu").reset_parameters()
    fresh = BertEmbeddings(config)
    assert torch.equal(layer.position_ids, fresh.position_ids)
    assert torch.equal(layer.token_type_ids, fresh.token_type_ids)
    assert layer.word_embeddings.padding_idx is not None and not layer.word_embeddings.weight[
        layer.word_embeddings.padding_idx].any()
