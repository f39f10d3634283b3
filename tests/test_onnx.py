"""ONNX export: the layer's plain and fused graphs, and whole transformers models, run in ONNX Runtime against torch.

References are independent of the export: bertembed's torch layer (tested against transformers elsewhere) for the
layer, transformers' own model for the whole one. Hidden size 30 (not a power of two) in the small members.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

ort = pytest.importorskip("onnxruntime", reason="ONNX export tests run graphs in onnxruntime: pip install "
                          "'bertembed[dev]'")
onnx = pytest.importorskip("onnx", reason="ONNX export needs onnx: pip install 'bertembed[dev]'")
pytest.importorskip("onnxscript", reason="torch's dynamo ONNX exporter needs onnxscript: pip install 'bertembed[dev]'")

from bertembed import BertEmbeddings, EmbeddingConfig, export_onnx  # noqa: E402
from bertembed.cli.app import app  # noqa: E402
from bertembed.onnx_export import export_model, export_whole, fuse_embeddings, input_names, load_model  # noqa: E402

LAYER_TOLERANCE, WHOLE_TOLERANCE = 1e-5, 1e-4


def session(model) -> ort.InferenceSession:
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def op_counts(model) -> Counter:
    model = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    return Counter((node.domain or "ai.onnx", node.op_type) for node in model.graph.node)


def batches(config: EmbeddingConfig, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Feeds [B, L]: one token; a batch whose rows end in padding; the longest length the position table allows."""
    gen = torch.Generator().manual_seed(seed)
    longest = config.max_position_embeddings - config.first_position
    feeds = []
    for batch, length in ((1, 1), (3, 9), (2, longest)):
        ids = torch.randint(3, config.vocab_size, (batch, length), generator=gen)
        ids[ids == config.pad_token_id] = config.pad_token_id + 1
        if batch == 3:
            ids[1, 5:], ids[2, 2:] = config.pad_token_id, config.pad_token_id
        feed = {"input_ids": ids, "attention_mask": (ids != config.pad_token_id).long(),
                "token_type_ids": torch.randint(0, max(config.type_vocab_size, 1), (batch, length), generator=gen)}
        feeds.append({name: feed[name] for name in input_names(config)})
    return feeds


def layer_reference(layer: BertEmbeddings, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return layer(input_ids=feed["input_ids"], token_type_ids=feed.get("token_type_ids"),
                     attention_mask=feed["attention_mask"] if layer.config.mask_output else None)


def assert_runs_like(path_or_model, reference, feeds, tolerance: float) -> None:
    runner = session(path_or_model)
    for feed in feeds:
        out = runner.run(None, {k: v.numpy() for k, v in feed.items()})[0]
        torch.testing.assert_close(torch.from_numpy(out), reference(feed), atol=tolerance, rtol=0)


def member_layer(member_checkpoint, name: str) -> BertEmbeddings:
    return BertEmbeddings.from_pretrained(member_checkpoint(name)[0])


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("name", ["bert", "roberta"])
def test_layer_graph_matches_the_torch_layer(member_checkpoint, tmp_path, name, fused):
    layer = member_layer(member_checkpoint, name)
    path = export_onnx(layer, tmp_path / "layer.onnx", fused=fused)
    model = onnx.load(str(path))
    expected = ["input_ids", "attention_mask", "token_type_ids"] if name == "bert" else ["input_ids", "attention_mask"]
    assert [i.name for i in model.graph.input] == expected
    for value in (*model.graph.input, *model.graph.output):
        assert [d.dim_param for d in value.type.tensor_type.shape.dim][:2] == ["batch_size", "sequence_length"]
    ops = op_counts(model)
    if fused:
        assert ops[("com.microsoft", "EmbedLayerNormalization")] == 1
        assert not ops[("ai.onnx", "Gather")] and not ops[("ai.onnx", "LayerNormalization")]
        node = next(n for n in model.graph.node if n.op_type == "EmbedLayerNormalization")
        assert onnx.helper.get_attribute_value(node.attribute[0]) == pytest.approx(layer.config.layer_norm_eps)
    else:
        assert {"Gather", "Add", "LayerNormalization"} <= {op for _, op in ops}
        assert all(domain == "ai.onnx" for domain, _ in ops)
    assert_runs_like(path, lambda feed: layer_reference(layer, feed), batches(layer.config), LAYER_TOLERANCE)
    if fused:  # the op rejects an id outside its table
        feed = {k: v.numpy() for k, v in batches(layer.config)[0].items()}
        feed["input_ids"][0, 0] = layer.config.vocab_size
        with pytest.raises(Exception, match="INVALID_ARGUMENT"):
            session(path).run(None, feed)


@pytest.mark.parametrize("name", ["distilbert-sinusoidal", "albert", "mpnet", "deberta", "modernbert"])
def test_other_members_export_and_fuse(member_checkpoint, tmp_path, name):
    """Plain graphs of every kind of member; fused (the same rewrite as `fused=True`) where the op computes them:
    sinusoidal tables, ALBERT's E-wide output (its projection comes after the layer), MPNet's padding positions."""
    layer = member_layer(member_checkpoint, name)
    plain = onnx.load(str(export_onnx(layer, tmp_path / "layer.onnx")))
    graphs = [plain] if name in ("deberta", "modernbert") else [plain, fuse_embeddings(plain, layer.config)]
    for graph in graphs:
        assert_runs_like(graph, lambda feed: layer_reference(layer, feed), batches(layer.config)[1:2], LAYER_TOLERANCE)


def test_a_layer_in_training_mode_is_exported_without_dropout(tmp_path):
    layer = BertEmbeddings(EmbeddingConfig(vocab_size=50, hidden_size=12, max_position_embeddings=16)).train()
    path = export_onnx(layer, tmp_path / "layer.onnx")
    assert layer.training
    assert_runs_like(path, lambda feed: layer_reference(layer.eval(), feed), batches(layer.config)[:2],
                     LAYER_TOLERANCE)


@pytest.mark.parametrize(("config", "reason"), [
    (EmbeddingConfig.for_member("modernbert", vocab_size=50, hidden_size=16, pad_token_id=0), "no position table"),
    (EmbeddingConfig.for_member("deberta-v2", vocab_size=50, hidden_size=16, embedding_size=8,
                                position_biased_input=True), "projects E=8 -> H=16 before its LayerNorm"),
    (EmbeddingConfig.for_member("deberta", vocab_size=50, hidden_size=16, position_biased_input=True),
     "multiplies its output by the attention mask"),
])
def test_fused_refuses_what_the_op_cannot_compute(tmp_path, config, reason):
    target = tmp_path / "layer.onnx"
    target.write_bytes(b"old")
    with pytest.raises(ValueError, match=reason) as caught:
        export_onnx(BertEmbeddings(config), target, fused=True)
    assert "fused=False" in str(caught.value)
    # (--whole --optimize takes DeBERTa with its embeddings unfused; ModernBERT it refuses)
    assert ("--whole --optimize leaves these embeddings unfused" in str(caught.value)) == config.norm_bias
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["layer.onnx"]


def test_fused_refuses_bfloat16_tables(tmp_path):
    layer = BertEmbeddings(EmbeddingConfig(vocab_size=50, hidden_size=16)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"torch.bfloat16.*\.float\(\)"):
        export_onnx(layer, tmp_path / "layer.onnx", fused=True)
    assert not list(tmp_path.iterdir())


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    layer = BertEmbeddings(EmbeddingConfig(vocab_size=50, hidden_size=16))
    with pytest.raises(ValueError, match="is a folder; give the name of a file in it"):
        export_onnx(layer, tmp_path)
    with pytest.raises(ValueError, match="does not exist; create it first"):
        export_onnx(layer, tmp_path / "missing" / "layer.onnx")
    with pytest.raises(ValueError, match=r"opset=12 must be an integer in \[17, "):
        export_onnx(layer, tmp_path / "layer.onnx", opset=12)
    with pytest.raises(TypeError, match="takes a bertembed.BertEmbeddings"):
        export_onnx(torch.nn.Embedding(3, 4), tmp_path / "layer.onnx")
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def whole_graphs(member_checkpoint, bundled_path):
    """Factory: name -> (transformers model, its config, plain graph, fused graph), exported once."""
    cache = {}

    def get(name: str):
        if name not in cache:
            folder = bundled_path if name == "all-MiniLM-L6-v2" else member_checkpoint(name)[0]
            hf, config = load_model(folder)
            plain = export_model(hf, config)
            cache[name] = hf, config, plain, fuse_embeddings(plain, config)
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["bert", "roberta", "all-MiniLM-L6-v2"])
def test_whole_model_plain_and_fused_match_transformers(whole_graphs, name):
    hf, config, plain, fused = whole_graphs(name)
    before, after = op_counts(plain), op_counts(fused)
    assert not before[("com.microsoft", "EmbedLayerNormalization")]
    assert after[("com.microsoft", "EmbedLayerNormalization")] == 1
    assert after[("ai.onnx", "LayerNormalization")] == before[("ai.onnx", "LayerNormalization")] - 1
    assert after[("ai.onnx", "Gather")] == before[("ai.onnx", "Gather")] - 3
    assert [i.name for i in fused.graph.input] == list(input_names(config))

    def reference(feed):
        with torch.no_grad():
            return hf(**feed).last_hidden_state

    feeds = batches(config)[:2]
    for graph in (plain, fused):
        assert_runs_like(graph, reference, feeds, WHOLE_TOLERANCE)


def test_whole_fused_finds_the_embedding_norm_when_every_norm_is_equal(tmp_path):
    """A freshly initialised model: every LayerNorm weight is ones and every bias zeros, and the exporter merges equal
    initializers, so the embedding norm's weight has the name of five norms'; the norm is found by its place."""
    import transformers

    torch.manual_seed(0)
    mlm = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=120, hidden_size=30, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=40)).eval()
    mlm.save_pretrained(tmp_path / "fresh")
    path = export_whole(tmp_path / "fresh", tmp_path / "model.onnx", fused=True)
    counts = op_counts(path)
    assert counts[("com.microsoft", "EmbedLayerNormalization")] == 1 and counts[("ai.onnx", "LayerNormalization")] == 4

    def reference(feed):
        with torch.no_grad():
            return mlm.bert(**feed).last_hidden_state

    assert_runs_like(path, reference, batches(EmbeddingConfig.from_hf_config(tmp_path / "fresh"))[:2],
                     WHOLE_TOLERANCE)


def test_whole_fused_refuses_a_member_without_position_table(member_checkpoint, tmp_path):
    folder, _ = member_checkpoint("modernbert")
    with pytest.raises(ValueError, match="modernbert layer has no position table"):
        export_whole(folder, tmp_path / "model.onnx", fused=True)
    with pytest.raises(ValueError, match="optimizer cannot take the modernbert model.*without --optimize"):
        export_whole(folder, tmp_path / "model.onnx", optimize=True)
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """Factory: member name -> (folder saved by transformers' save_pretrained, the model): FAMILY's member (random
    LayerNorms) with two encoder layers, so that counts per layer are counts of more than one."""
    from conftest import _saved, member_or_skip

    return _saved(tmp_path_factory, lambda name: member_or_skip(name, num_hidden_layers=2))


def padded_feeds(config: EmbeddingConfig) -> list[dict[str, torch.Tensor]]:
    """`batches`' padded batch with a row padded on both sides: the optimized graph's attention reads the 2D mask,
    not a count of its ones."""
    feed = {name: value.clone() for name, value in batches(config)[1].items()}
    feed["attention_mask"][1, :2] = 0
    feed["input_ids"][1, :2] = config.pad_token_id
    return [feed, batches(config)[0]]


@pytest.mark.parametrize("name", ["bert", "roberta"])
def test_whole_optimized_fuses_every_layer_and_matches_transformers(two_layers, tmp_path, name):
    folder, hf = two_layers(name)
    path = export_whole(folder, tmp_path / "model.onnx", optimize=True)
    ops = Counter(op for (_, op), n in op_counts(path).items() for _ in range(n))
    layers = hf.config.num_hidden_layers
    assert ops["Attention"] + ops["MultiHeadAttention"] == layers
    assert ops["SkipLayerNormalization"] == 2 * layers
    assert ops["FastGelu"] + ops["BiasGelu"] + ops["Gelu"] == layers
    assert ops["EmbedLayerNormalization"] == 1
    assert not ops["Softmax"] and not ops["LayerNormalization"] and not ops["Erf"]
    config = EmbeddingConfig.from_hf_config(folder)
    assert [i.name for i in onnx.load(str(path)).graph.input] == list(input_names(config))

    def reference(feed):
        with torch.no_grad():
            return hf(**feed).last_hidden_state

    assert_runs_like(path, reference, padded_feeds(config), WHOLE_TOLERANCE)


def test_whole_optimized_deberta_keeps_its_embeddings_and_fuses_the_rest(two_layers, tmp_path, caplog):
    """The op cannot compute this DeBERTa's layer (E != H: it projects before its norm): its embeddings stay operators,
    said in a warning, and ONNX Runtime's optimizer fuses each layer's two SkipLayerNormalizations and its Gelu (not
    the attention: relative positions); transformers' outputs within 1e-4, padded on either side."""
    folder, hf = two_layers("deberta-v2-factorised")  # (DeBERTa v2 and v3's module; E != H: a projection too)
    path = export_whole(folder, tmp_path / "model.onnx", optimize=True)
    ops = Counter(op for (_, op), n in op_counts(path).items() for _ in range(n))
    layers = hf.config.num_hidden_layers
    assert ops["SkipLayerNormalization"] == 2 * layers and ops["FastGelu"] + ops["BiasGelu"] + ops["Gelu"] == layers
    assert not ops["EmbedLayerNormalization"] and ops["LayerNormalization"] >= 1 and ops["Softmax"] == layers
    assert "no fused embeddings: this deberta-v2 layer projects" in caplog.text
    config = EmbeddingConfig.from_hf_config(folder)

    def reference(feed):
        with torch.no_grad():
            return hf(**feed).last_hidden_state

    assert_runs_like(path, reference, padded_feeds(config), WHOLE_TOLERANCE)


@pytest.mark.parametrize("name", ["bert", "roberta", "mpnet"])
def test_whole_int8_has_int8_weights_and_stays_close(two_layers, tmp_path, name):
    """Dynamic quantization: int8 weight initializers, and every token's vector still pointing the same way as
    transformers' (the bundled model's cosine over real texts is in BENCHMARKS.md). RoBERTa's and MPNet's fused
    embeddings stay float32: ONNX Runtime's int8 form of the node has no position ids and would count from 0."""
    folder, hf = two_layers(name)
    path = export_whole(folder, tmp_path / "model.onnx", optimize=True, quantize="int8")
    model = onnx.load(str(path))
    assert any(t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 2 for t in model.graph.initializer)
    ops = {node.op_type for node in model.graph.node}
    assert ("QEmbedLayerNormalization" if name == "bert" else "EmbedLayerNormalization") in ops
    config = EmbeddingConfig.from_hf_config(folder)
    for feed in padded_feeds(config):
        feed = {k: v for k, v in feed.items() if k in input_names(config)}
        out = torch.from_numpy(session(path).run(None, {k: v.numpy() for k, v in feed.items()})[0])
        with torch.no_grad():
            expected = hf(**feed).last_hidden_state
        kept = feed["attention_mask"].bool()
        assert torch.nn.functional.cosine_similarity(out[kept], expected[kept]).min() > 0.99
    with pytest.raises(ValueError, match="quantize='fp16'.*'int8'"):
        export_whole(folder, tmp_path / "other.onnx", quantize="fp16")


def test_cli_exports_the_fused_layer_and_the_fused_and_optimized_whole_model(member_checkpoint, tmp_path):
    folder, hf = member_checkpoint("roberta")
    layer = BertEmbeddings.from_pretrained(folder)
    runner = CliRunner()
    for args, reference, tolerance in (
        ([], lambda feed: layer_reference(layer, feed), LAYER_TOLERANCE),
        (["--whole"], lambda feed: hf(**feed).last_hidden_state.detach(), WHOLE_TOLERANCE),
        (["--whole", "--optimize"], lambda feed: hf(**feed).last_hidden_state.detach(), WHOLE_TOLERANCE),
    ):
        out = tmp_path / f"model{len(args)}.onnx"
        done = runner.invoke(app, ["export", "onnx", str(out), "--model", str(folder), "--fused", *args])
        assert done.exit_code == 0, done.output
        assert f"wrote {out}" in " ".join(done.output.split())
        assert op_counts(out)[("com.microsoft", "EmbedLayerNormalization")] == 1
        assert op_counts(out)[("com.microsoft", "Attention")] == ("--optimize" in args)
        assert_runs_like(out, reference, batches(layer.config)[1:2], tolerance)


def test_cli_bad_output_exits_2_without_traceback(tmp_path):
    for args, message in ((["export", "onnx", str(tmp_path)], "is a folder"),
                          (["export", "onnx", str(tmp_path / "m.onnx"), "--optimize"], "add --whole"),
                          (["export", "onnx", str(tmp_path / "m.onnx"), "--quantize", "int8"], "add --whole"),
                          (["export", "onnx", str(tmp_path / "no" / "m.onnx")], "does not exist"),
                          (["export", "onnx", str(tmp_path / "m.onnx"), "--opset", "9"], "opset=9")):
        done = CliRunner().invoke(app, args)
        assert done.exit_code == 2 and isinstance(done.exception, SystemExit), (args, done.output)
        assert message in done.output and "Traceback" not in done.output
    assert not list(tmp_path.iterdir())


def test_whole_export_of_an_embedding_only_or_broken_folder_is_refused(tmp_path, bundled_path):
    """An embedding-only folder (save_pretrained, finetune-demo --save) became a model with a random encoder, and a
    broken weights file a traceback."""
    from bertembed import BertEmbeddings

    BertEmbeddings.from_pretrained(bundled_path).save_pretrained(tmp_path / "layer")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((bundled_path / "config.json").read_bytes())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    for folder, message in ((tmp_path / "layer", "it is not a whole model"), (broken, "transformers cannot load")):
        done = CliRunner().invoke(app, ["export", "onnx", str(tmp_path / "m.onnx"), "--whole", "-m", str(folder)])
        assert done.exit_code == 2 and isinstance(done.exception, SystemExit), done.output
        assert message in " ".join(done.output.split()) and "Traceback" not in done.output
    assert not (tmp_path / "m.onnx").exists()
