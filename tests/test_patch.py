"""bertembed.patch on transformers models: the whole model's outputs and gradients agree with the unpatched model
within 1e-5 (float32; gradients relative to their largest entry); unpatch restores transformers' layer."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

pytest.importorskip("numba", reason="the fused CPU kernels need numba (the fast and dev extras)")
transformers = pytest.importorskip("transformers", reason="the references are transformers models (the dev extra)")

import bertembed  # noqa: E402
from bertembed.embeddings import BertEmbeddings  # noqa: E402
from conftest import hf_offset_name  # noqa: E402


def tiny_config(**overrides):
    return transformers.BertConfig(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0, **overrides)


def model_of(kind, seed=0):
    torch.manual_seed(seed)
    model = kind(tiny_config())
    emb = model.bert.embeddings if hasattr(model, "bert") else model.embeddings
    with torch.no_grad():
        emb.LayerNorm.weight.uniform_(0.5, 1.5)
        emb.LayerNorm.bias.uniform_(-0.2, 0.2)
    return model


def batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 300, (3, 12), generator=gen)
    ids[:, :2] = 5  # repeated ids
    ids[1, 9:] = 0  # padding
    mask = (ids != 0).long()
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.randint(0, 2, (3, 12), generator=gen))


def first_output(output):
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


def forward_backward(model, inputs, weights=None):
    """The first output, and every parameter's gradient of a weighted sum of it (`weights`: a linear ramp)."""
    model.zero_grad(set_to_none=True)
    out = first_output(model(**inputs))
    weights = torch.linspace(-1, 1, out.numel()).view(out.shape) if weights is None else weights
    (out * weights).sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(grads, grads_ref):
    """Each of `grads_ref` within 1e-5 relative to its largest entry: table gradients sum many tokens, in another
    order than autograd's."""
    for name, expected in grads_ref.items():
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(grads[name], expected, rtol=1e-5, atol=1e-5 * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kind", ["BertModel", "BertForSequenceClassification", "BertForMaskedLM"])
def test_patched_model_matches_original(kind):
    original = model_of(getattr(transformers, kind)).train()  # train mode, dropout 0: the training path
    patched = bertembed.patch(copy.deepcopy(original), backend="cpu")
    assert isinstance(patched.base_model.embeddings, BertEmbeddings)
    inputs = batch()
    out_ref, grads_ref = forward_backward(original, inputs)
    out, grads = forward_backward(patched, inputs)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-5)
    assert grads.keys() == grads_ref.keys()
    assert_grads_close(grads, grads_ref)


def test_a_patched_model_compiles_as_one_graph_and_exports():
    """`torch.compile(fullgraph=True)` of a patched model works where the unpatched one does: the embedding layer
    adds no graph break (training mode, dropout 0, forward and backward); `torch.export` takes it too. (Of the other
    members, RoBERTa's positions counted from the padding: test_family.py.)"""
    original = model_of(transformers.BertModel).train()
    patched = bertembed.patch(copy.deepcopy(original), backend="cpu")
    inputs = batch()
    out_ref, grads_ref = forward_backward(original, inputs)
    torch._dynamo.reset()
    out, grads = forward_backward(torch.compile(patched, fullgraph=True), inputs)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-5)
    grads = {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()}
    assert grads.keys() >= grads_ref.keys()  # compiled autograd gives the unused pooler zero gradients, eager none
    assert not any(grads[name].any() for name in grads.keys() - grads_ref.keys())
    assert_grads_close(grads, grads_ref)
    exported = torch.export.export(patched.eval(), (), inputs)
    with torch.no_grad():
        torch.testing.assert_close(first_output(exported.module()(**inputs)), first_output(original.eval()(**inputs)),
                                   rtol=0, atol=1e-5)


def test_patch_keeps_weights_keys_and_ties():
    model = model_of(transformers.BertForMaskedLM)
    keys = set(model.state_dict())
    word = model.bert.embeddings.word_embeddings.weight
    bertembed.patch(model, backend="cpu")
    assert set(model.state_dict()) == keys
    assert model.bert.embeddings.word_embeddings.weight is word
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # the MLM tie survives


def test_unpatch_restores_transformers_layer():
    model = model_of(transformers.BertModel).eval()
    original_layer = model.embeddings
    inputs = batch()
    expected = first_output(model(**inputs))
    bertembed.patch(model)
    assert model.embeddings is not original_layer
    assert bertembed.unpatch(model).embeddings is original_layer
    assert torch.equal(first_output(model(**inputs)), expected)


def test_patch_finds_bert_inside_a_wrapper():
    """sentence-transformers keeps the BertModel as `auto_model` inside its own modules: found by type, any path."""
    wrapper = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    wrapper[1].auto_model = model_of(transformers.BertModel)
    bertembed.patch(wrapper, backend="cpu")
    assert isinstance(wrapper[1].auto_model.embeddings, BertEmbeddings)


def test_patching_twice_keeps_the_fused_layer_and_switches_its_backend():
    model = model_of(transformers.BertModel).eval()
    ids = batch()["input_ids"]
    expected = model(input_ids=ids).last_hidden_state
    fused = bertembed.patch(model, backend="cpu").embeddings
    assert bertembed.patch(model, backend="reference").embeddings is fused and fused.backend == "reference"
    torch.testing.assert_close(model(input_ids=ids).last_hidden_state, expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="backend"):
        bertembed.patch(model, backend="cuda-please")
    assert type(bertembed.unpatch(model).embeddings) is transformers.models.bert.modeling_bert.BertEmbeddings


def test_patch_refuses_a_model_without_bert_embeddings():
    with pytest.raises(ValueError, match="no embeddings layer of BERT.s family"):
        bertembed.patch(torch.nn.Linear(2, 2))


def test_patch_leaves_layers_with_relative_positions(caplog):
    """transformers 4's BERT with position_embedding_type="relative_key" keeps the position table but adds none of its
    rows in the embedding layer (the attention uses the positions); an attribute on the layer says so, which
    transformers 5 dropped. The fused layer always adds the rows, so such a layer stays transformers' own, with a
    warning, and a model with only such layers is refused."""
    model = model_of(transformers.BertModel)
    model.embeddings.position_embedding_type = "relative_key"  # as transformers 4 sets it
    with pytest.raises(ValueError, match="only layers it cannot replace: embeddings .*relative_key"):
        bertembed.patch(model)
    wrapper = torch.nn.ModuleDict({"relative": model, "absolute": model_of(transformers.BertModel, seed=1)})
    with caplog.at_level("WARNING", logger="bertembed.dropin"):
        bertembed.patch(wrapper)
    assert "relative.embeddings (position_embedding_type='relative_key')" in caplog.text
    assert type(wrapper["relative"].embeddings).__module__.startswith("transformers.")
    assert isinstance(wrapper["absolute"].embeddings, BertEmbeddings)


def test_patched_layer_matches_hf_embeddings_directly():
    hf = model_of(transformers.BertModel).embeddings.train()
    fused = bertembed.dropin.fused_from(copy.deepcopy(hf), backend="cpu")
    ids = batch()["input_ids"]
    offset = {hf_offset_name(): 3}  # the installed transformers' name: the patched layer takes the same
    torch.testing.assert_close(fused(input_ids=ids, **offset), hf(input_ids=ids, **offset), rtol=0, atol=5e-7 * 5)


def test_patched_layer_takes_exactly_the_installed_transformers_arguments():
    """The cache offset's name follows the installed release (transformers 5.24 renamed it); the other name is
    refused with the TypeError transformers' own layer raises, positional arguments bind as there."""
    hf = model_of(transformers.BertModel).embeddings.eval()
    fused = bertembed.dropin.fused_from(copy.deepcopy(hf), backend="cpu")
    ids = batch()["input_ids"][:, :6]
    other = "past_key_values_length" if hf_offset_name() == "cache_length" else "cache_length"
    for layer in (hf, fused):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{other}'"):
            layer(input_ids=ids, **{other: 2})
        with pytest.raises(TypeError, match="multiple values"):
            layer(ids, input_ids=ids)
    with torch.no_grad():
        positional = (ids, None, None, None, 4)  # the offset is the fifth parameter in every release
        torch.testing.assert_close(fused(*positional), hf(*positional), rtol=0, atol=5e-7 * 5)


def test_an_offset_that_mpnets_layer_swallows_is_ignored_as_there():
    """MPNet's forward takes **kwargs and ignores a cache offset in them (its positions never use one): so does the
    patched layer (it shifted every position)."""
    config = transformers.MPNetConfig(vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, max_position_embeddings=64)
    hf = transformers.MPNetModel(config).embeddings.eval()
    fused = bertembed.dropin.fused_from(copy.deepcopy(hf), backend="reference")
    ids = torch.randint(3, 120, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fused(ids, **{hf_offset_name(): 3}), hf(ids, **{hf_offset_name(): 3}))


class _FutureEmbeddings(transformers.models.bert.modeling_bert.BertEmbeddings):
    """A transformers layer of a release that renames the offset again and adds an argument bertembed cannot know."""

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, start=0,
                scale=1.0):
        offset = {hf_offset_name(): start}
        return super().forward(input_ids, token_type_ids, position_ids, inputs_embeds, **offset) * scale


def test_an_unknown_argument_runs_transformers_own_forward(caplog):
    """Never a TypeError or a guess: arguments the fused layer does not know run transformers' code on its tables."""
    hf = _FutureEmbeddings(tiny_config()).eval()
    fused = bertembed.dropin.fused_from(copy.deepcopy(hf), backend="cpu")
    ids = batch()["input_ids"][:, :6]
    with torch.no_grad(), caplog.at_level("WARNING", logger="bertembed.dropin"):
        torch.testing.assert_close(fused(ids), hf(ids), rtol=0, atol=5e-7 * 5)  # defaults: the fused kernel
        assert not caplog.text
        for kwargs in ({"start": 3}, {"scale": 2.0}, {"start": 1, "scale": -1.0}):
            assert torch.equal(fused(ids, **kwargs), hf(ids, **kwargs))  # transformers' own code, bit for bit
    assert "start are unknown to bertembed" in caplog.text and "scale are unknown" in caplog.text


def test_patch_sentence_transformers_model(tmp_path):
    """A real sentence-transformers model (Transformer + Pooling modules) over a tiny local BERT: same embeddings."""
    st = pytest.importorskip("sentence_transformers")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "a", "dog"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    torch.manual_seed(0)
    transformers.BertModel(tiny_config()).save_pretrained(tmp_path)
    model = st.SentenceTransformer(str(tmp_path), device="cpu")  # a plain BERT folder: Transformer + mean pooling
    sentences = ["the cat sat on the mat", "a dog"]
    expected = model.encode(sentences, convert_to_tensor=True)
    bertembed.patch(model, backend="cpu")
    assert sum(isinstance(m, BertEmbeddings) for m in model.modules()) == 1
    torch.testing.assert_close(model.encode(sentences, convert_to_tensor=True), expected, rtol=0, atol=1e-5)


def test_patched_bundled_model_matches_on_a_real_checkpoint(bundled_path):
    """all-MiniLM-L6-v2, six layers deep. At the tokens the model attends to, the last hidden state and every
    gradient agree within the 1e-5 above. At padding positions (outputs the model masks out) six layers amplify the
    embeddings' last-bit differences to about 1e-4, as they amplify a +-1 ulp nudge of transformers' own embeddings
    (benchmarks/patched_model.py --drift), so there the test asks what float32 allows: the patched model's distance
    from a float64 run of transformers' model is within a small multiple of transformers' own float32 model's
    (0.7x on this batch, up to 2x over random batches). Gradients deep in the model meet the same drift (one entry of
    a second-layer LayerNorm's gradient, 7.6e-5 off at scale 6.5, with 2 threads and transformers 4.40): each is
    within 1e-5 of its scale, or no further from a float64 run than 3x transformers' own float32 gradient."""
    original = transformers.BertModel.from_pretrained(bundled_path).eval()
    patched = bertembed.patch(copy.deepcopy(original), backend="cpu")
    double = copy.deepcopy(original).double()
    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_path)
    texts = ["The quick brown fox jumps over the lazy dog", "Embeddings are sums of three rows",
             "a b c", "Where does the position vector go when the sentence is padded to the longest one?"]
    inputs = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    attended = inputs["attention_mask"].bool()
    shape = (*attended.shape, original.config.hidden_size)
    weights = torch.linspace(-1, 1, attended.numel() * shape[-1]).view(shape) * attended[..., None]
    out_ref, grads_ref = forward_backward(original, inputs, weights)
    out, grads = forward_backward(patched, inputs, weights)
    exact, grads_exact = forward_backward(double, inputs, weights.double())
    torch.testing.assert_close(out[attended], out_ref[attended], rtol=0, atol=1e-5)
    assert (out.double() - exact).abs().max() <= 3 * (out_ref.double() - exact).abs().max()
    for name, expected in grads_ref.items():  # within 1e-5 of its scale, or as close to float64 as transformers'
        error, own = (grads[name].double() - grads_exact[name]).abs().max(), (expected - grads_exact[name]).abs().max()
        scale = max(1.0, float(expected.abs().max()))
        assert float((grads[name] - expected).abs().max()) <= 1e-5 * scale or error <= 3 * own, (name, error, own)


def test_patched_sentence_transformers_all_minilm_matches_with_gradients(bundled_path):
    """The bundled all-MiniLM-L6-v2 as sentence-transformers loads it (Transformer, mean pooling, normalize):
    patched, its sentence embeddings stay within 1e-5 of the unpatched model's, and so does every gradient of a
    weighted sum of them. Run on both transformers lines by CI."""
    import sentence_transformers as st  # (the bundled model's package requires it: a skip would hide a broken install)
    original = st.SentenceTransformer(str(bundled_path), device="cpu").eval()
    patched = bertembed.patch(copy.deepcopy(original), backend="cpu")
    assert sum(isinstance(m, BertEmbeddings) for m in patched.modules()) == 1
    texts = ["The quick brown fox jumps over the lazy dog", "a b c", "Why are the learned positions not sin/cos?"]
    features = original.tokenize(texts)
    results = []
    for model in (original, patched):
        model.zero_grad(set_to_none=True)
        embedding = model(dict(features))["sentence_embedding"]
        (embedding * torch.linspace(-1, 1, embedding.numel()).view(embedding.shape)).sum().backward()
        results.append((embedding.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                             if p.grad is not None}))
    (out_ref, grads_ref), (out, grads) = results
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-5)
    assert grads.keys() == grads_ref.keys() and len(grads) > 90
    assert_grads_close(grads, grads_ref)
    torch.testing.assert_close(patched.encode(texts, convert_to_tensor=True),
                               original.encode(texts, convert_to_tensor=True), rtol=0, atol=1e-5)


@pytest.mark.parametrize("adapter", ["lora", "trainable tokens"])
def test_a_lora_adapter_on_the_word_table_runs_in_a_patched_model(adapter):
    """peft's LoRA on `word_embeddings` wraps the table in its own module, whose forward adds the low-rank update
    (trainable tokens: a wrapper whose weight is built when read, which patching once failed on): the fused layer
    runs that forward (the reference path) whether the model was patched before or after the adapter went in, so
    outputs and gradients, the adapter's included, are the unpatched adapted model's."""
    peft = pytest.importorskip("peft", reason="peft (the dev extra) provides the LoRA adapter this test puts in")
    model = model_of(transformers.BertModel).train()
    if adapter == "lora":  # a random update
        config = peft.LoraConfig(r=4, target_modules=["word_embeddings"], init_lora_weights=False)
    else:
        if "trainable_token_indices" not in inspect.signature(peft.LoraConfig).parameters:
            pytest.skip(f"peft {peft.__version__} has no trainable tokens (peft 0.15 and later, which need a newer "
                        f"transformers than the oldest supported)")
        config = peft.LoraConfig(r=4, target_modules=["query", "value"], init_lora_weights=False,
                                 trainable_token_indices={"word_embeddings": [5, 6, 7]})
    adapted = peft.get_peft_model(copy.deepcopy(model), config)
    patched_after = bertembed.patch(copy.deepcopy(adapted), backend="cpu")
    patched_before = peft.get_peft_model(bertembed.patch(copy.deepcopy(model), backend="cpu"), config)
    patched_before.load_state_dict(adapted.state_dict())
    inputs = batch()
    out_ref, grads_ref = forward_backward(adapted, inputs)
    assert (out_ref - forward_backward(model, inputs)[0]).abs().max() > 1e-2  # the adapter changes the output
    assert any("lora" in name for name in grads_ref)
    for patched in (patched_after, patched_before):
        assert sum(isinstance(m, BertEmbeddings) for m in patched.modules()) == 1
        out, grads = forward_backward(patched, inputs)
        torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-5)
        assert grads.keys() == grads_ref.keys()
        assert_grads_close(grads, grads_ref)


def test_a_hook_on_a_table_of_a_patched_model_runs():
    """Layer attributions (captum's LayerIntegratedGradients) hook `embeddings.word_embeddings` and replace its output:
    the patched model gives the unpatched model's outputs under such a hook."""
    model = model_of(transformers.BertModel).eval()
    patched = bertembed.patch(copy.deepcopy(model), backend="cpu")
    inputs = batch()
    with torch.no_grad():
        plain = first_output(patched(**inputs))
        outputs = []
        for m in (model, patched):
            hook = m.embeddings.word_embeddings.register_forward_hook(lambda mod, args, out: out * 0.25)
            outputs.append(first_output(m(**inputs)))
            hook.remove()
        assert (outputs[0] - plain).abs().max() > 1e-2
        torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(first_output(patched(**inputs)), plain, rtol=0, atol=0)  # fused again, same bits


def test_enable_input_require_grads_reaches_a_frozen_patched_model():
    """transformers' `enable_input_require_grads` (which peft's k-bit preparation calls, for adapters trained with
    gradient checkpointing) hooks the word table to make its output require grad. On a frozen patched model that
    hook must run, or the checkpointed layers above see inputs without grad and the adapters get none."""
    for model in (model_of(transformers.BertModel), bertembed.patch(model_of(transformers.BertModel), backend="cpu")):
        model.requires_grad_(False)
        model.enable_input_require_grads()
        assert model.embeddings(input_ids=batch()["input_ids"]).requires_grad


def test_hooks_on_the_embedding_layer_move_with_patch_and_unpatch():
    """A hook on `model.embeddings` itself (an intervention, captum's layer attributions) registered before `patch`
    runs on the fused layer, one registered while patched runs after `unpatch`, and their handles remove them."""
    model = model_of(transformers.BertModel).eval()
    reference = copy.deepcopy(model)
    inputs = batch()
    calls = []
    zeroed = model.embeddings.register_forward_hook(lambda m, args, out: calls.append("before") or out * 0)
    reference.embeddings.register_forward_hook(lambda m, args, out: out * 0)
    expected = first_output(reference(**inputs))
    bertembed.patch(model, backend="cpu")
    torch.testing.assert_close(first_output(model(**inputs)), expected, rtol=0, atol=1e-5)
    assert calls == ["before"]
    later = model.embeddings.register_forward_pre_hook(lambda m, args: calls.append("while patched"))
    bertembed.unpatch(model)
    model(**inputs)
    assert calls == ["before", "while patched", "before"]  # (the pre-hook runs first)
    zeroed.remove(), later.remove()
    model(**inputs)
    assert len(calls) == 3


def test_monte_carlo_dropout_in_a_patched_model():
    """The dropout modules' own flags decide, as in transformers: a model in eval mode with its dropouts switched on
    (Monte Carlo dropout) draws a new mask each call, also after `patch` (which keeps the dropouts' flags), and a
    model in training mode with its dropouts off matches the unpatched one."""
    torch.manual_seed(0)
    config = tiny_config()
    config.hidden_dropout_prob = 0.3
    model = transformers.BertModel(config).eval()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.train()
    bertembed.patch(model, backend="cpu")
    assert model.embeddings.dropout.training and not model.embeddings.training
    ids = batch()["input_ids"]
    with torch.no_grad():
        out = model.embeddings(ids)
        assert abs((out == 0).float().mean().item() - 0.3) < 0.03
        assert not torch.equal(model.embeddings(ids), out)
    bertembed.unpatch(model)
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.eval()
    reference = copy.deepcopy(model)
    bertembed.patch(model, backend="cpu")
    inputs = batch()
    out_ref, grads_ref = forward_backward(reference, inputs)
    out, grads = forward_backward(model, inputs)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-5)
    assert_grads_close(grads, grads_ref)


def test_a_patched_model_with_its_position_table_extended():
    """Extending a patched model's positions for longer inputs (a longer table, buffers and config, as one extends
    transformers' model) works in training as in transformers', where the fused layer used to keep the length it
    was patched with."""
    model = model_of(transformers.BertForSequenceClassification).train()
    reference = copy.deepcopy(model)
    bertembed.patch(model, backend="cpu")
    longer = torch.randn(100, 48, generator=torch.Generator().manual_seed(4))
    for net in (reference, model):
        embeddings = net.bert.embeddings
        embeddings.position_embeddings = torch.nn.Embedding.from_pretrained(longer.clone(), freeze=False)
        embeddings.position_ids = torch.arange(100)[None]
        embeddings.token_type_ids = torch.zeros(1, 100, dtype=torch.long)
        net.config.max_position_embeddings = 100
    ids = torch.randint(1, 300, (2, 70), generator=torch.Generator().manual_seed(5))
    out_ref, grads_ref = forward_backward(reference, dict(input_ids=ids))
    out, grads = forward_backward(model, dict(input_ids=ids))
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-5)
    assert_grads_close(grads, grads_ref)
