"""Each analysis against an independent computation written here (torch or numpy), on the bundled checkpoint and on
a tiny random one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import conftest_explain as helpers
from bertembed.embeddings import BertEmbeddings, sinusoidal_table
from bertembed.explain import analyze_onehot, analyze_positions, analyze_segments, analyze_tokens, drift, explain_text
from bertembed.explain.positions import find_seams, peak_frequencies, spectrum, structure_correlation
from bertembed.numpy_layer import sinusoidal_table_np
from bertembed.tokenizer import Tokenizer
from conftest_explain import load_tables, make_tiny

bundled = helpers.bundled  # shared fixture
tiny = helpers.tiny  # shared fixture
tiny_b = helpers.tiny_b  # shared fixture


def cosine(t: torch.Tensor) -> torch.Tensor:
    """[N, H] -> [N, N] cosine similarity, through torch's own normalize (no broadcast of N x N x H)."""
    unit = F.normalize(t, dim=1)
    return unit @ unit.T


# --- decomposition ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["tiny", "bundled"])
def test_decomposition_parts_and_variance_shares(which, tiny):
    model = tiny if which == "tiny" else None
    text, text_b = ("the cat sat", "a dog") if which == "tiny" else ("The quick brown fox", "It jumps.")
    dec = explain_text(text, text_b, model)
    t = load_tables(tiny if which == "tiny" else Tokenizer.from_pretrained().source.folder)
    ids, types = torch.tensor(dec.ids), torch.tensor(dec.segments)
    assert dec.segments[-1] == 1 and dec.segments[0] == 0
    word, pos, seg = t["word_embeddings.weight"][ids], t["position_embeddings.weight"][:len(ids)], \
        t["token_type_embeddings.weight"][types]
    torch.testing.assert_close(torch.from_numpy(dec.word).double(), word, rtol=0, atol=1e-7)
    torch.testing.assert_close(torch.from_numpy(dec.segment).double(), seg, rtol=0, atol=1e-7)
    total = word + pos + seg
    ref = F.layer_norm(total, (total.shape[-1],), t["LayerNorm.weight"], t["LayerNorm.bias"], eps=1e-12)
    torch.testing.assert_close(torch.from_numpy(dec.output).double(), ref, rtol=1e-5, atol=1e-5)
    # shares: covariance of each part with the sum over its variance, written independently with torch.cov
    shares = dec.variance_shares()
    for i in range(len(ids)):
        var = total[i].var(unbiased=False)
        for name, part in (("word", word), ("position", pos), ("segment", seg)):
            cov = torch.cov(torch.stack([part[i], total[i]]), correction=0)[0, 1]
            assert shares[name][i] == pytest.approx(float(cov / var), abs=1e-5)
    assert np.allclose(sum(shares.values()), 1.0, atol=1e-9)
    assert sum(dec.overall_shares().values()) == pytest.approx(1.0)


# --- positions ------------------------------------------------------------------------------------------------

def test_sinusoid_helpers_match_the_torch_table_and_correlate_perfectly():
    table = sinusoidal_table_np(64, 22)
    formula = np.array([[np.sin(p / 10000 ** (i / 22)) if i % 2 == 0 else np.cos(p / 10000 ** ((i - 1) / 22))
                         for i in range(22)] for p in range(64)])
    assert np.allclose(table, formula, atol=1e-12)
    assert np.allclose(table, sinusoidal_table(64, 22).double().numpy(), atol=1e-6)
    sim = cosine(torch.from_numpy(table)).numpy()
    assert structure_correlation(sim, sim) == pytest.approx(1.0)
    assert structure_correlation(sim, -sim) == pytest.approx(-1.0)


def test_lowfreq_share_and_spectrum_on_known_signals():
    """Shares of variance by frequency (cycles over the positions), against signals built from known frequencies and
    Parseval's theorem computed by hand (numpy's FFT alone: the shares sum each column's variance)."""
    P = 100
    rng = np.random.default_rng(0)
    t = np.arange(P)[:, None]
    low = sum(np.cos(2 * np.pi * f * t / P + rng.uniform(0, 6, (1, 5))) * rng.normal(size=(1, 5)) for f in range(1, 9))
    assert spectrum(low + 3.0)[1:9].sum() == pytest.approx(1.0)  # frequencies 1..8 only, plus a constant
    high = sum(np.sin(2 * np.pi * f * t / P) * rng.normal(size=(1, 5)) for f in range(20, 40))
    assert spectrum(high)[1:9].sum() == pytest.approx(0.0, abs=1e-12)
    noise = rng.normal(size=(P, 400))
    assert spectrum(noise).sum() == pytest.approx(1.0)
    assert spectrum(noise)[1:9].sum() == pytest.approx(2 * 8 / (P - 1), rel=0.2)  # white noise: flat
    wave = np.cos(2 * np.pi * 5 * np.arange(P) / P)[:, None] * np.ones((1, 3))
    spec = spectrum(wave)
    assert spec.sum() == pytest.approx(1.0) and int(np.argmax(spec)) == 5 and spec[5] == pytest.approx(1.0)
    mixed = np.stack([np.sin(2 * np.pi * f * np.arange(P) / P) for f in (1, 7, 30)], axis=1)
    assert peak_frequencies(mixed).tolist() == [1, 7, 30]


def test_positions_bundled_against_torch(bundled):
    report = analyze_positions(bundled)
    table = torch.from_numpy(bundled.tensors["position_embeddings.weight"]).double()
    sim = cosine(table).numpy()
    assert np.allclose(report.similarity, sim, atol=1e-9)
    assert np.allclose(report.similarity, report.similarity.T) and np.allclose(np.diag(report.similarity), 1.0)
    assert np.allclose(report.norms, table.norm(dim=1).numpy())
    sin_sim = cosine(sinusoidal_table(512, 384).double()).numpy()
    upper = np.triu_indices(512, 1)
    assert report.structure_correlation == pytest.approx(np.corrcoef(sim[upper], sin_sim[upper])[0, 1], abs=1e-5)
    # the naive test first: the entries one by one (about -0.015), then structure and principal components
    sinus = sinusoidal_table(512, 384).double()
    assert report.entrywise_correlation == pytest.approx(float(torch.corrcoef(torch.stack(
        [table.ravel(), sinus.ravel()]))[0, 1]), abs=1e-9)
    assert abs(report.entrywise_correlation) < 0.05 and report.verdict.startswith("Entry by entry")
    variance = torch.linalg.svdvals(table - table.mean(0)) ** 2
    assert report.pca_share_2 == pytest.approx(float(variance[:2].sum() / variance.sum()))
    assert report.pca_share_10 == pytest.approx(float(variance[:10].sum() / variance.sum()))
    assert report.pca_share_10 > 0.5 and report.pca_coords.shape == (512, 4)
    # one seam, near 128, found from the table: a neighbour-cosine dip and a norm step far beyond the rest
    (seam,) = report.seams
    assert 126 <= seam["at"] <= 129 and "hypothesis" in report.verdict and "BERT pre-trained 90%" in report.verdict
    at = seam["at"]
    assert seam["neighbour_cosine"] == pytest.approx(float(F.cosine_similarity(table[at - 1], table[at], dim=0)))
    neighbours = F.cosine_similarity(table[:-1], table[1:])
    assert seam["neighbour_cosine"] < float(neighbours.median()) - 0.3
    # the norms' level either side: medians of 8 rows, the seam's own row (a one-row spike) left out
    norms = table.norm(dim=1)
    before, after = (float(torch.quantile(norms[rows], 0.5)) for rows in (slice(at - 8, at), slice(at + 1, at + 9)))
    assert (seam["norm_before"], seam["norm_after"]) == pytest.approx((before, after))
    assert norms[at] > max(before, after) + 0.1  # (the spike the level leaves out)
    assert f"goes from {before:.3f} to {after:.3f}" in report.verdict and report.model in report.verdict
    # the numbers and the figure's band describe the same frequencies, 1..k cycles over the table
    assert report.lowfreq_share == pytest.approx(float(report.spectrum[1:17].sum()))
    assert report.lowfreq_share_noise == pytest.approx(32 / 511) and report.kind == "learned"


def test_the_leading_components_are_a_sin_cos_pair_and_a_slow_cycle(bundled):
    """Principal components by torch's SVD, each one's strongest frequency by torch's FFT: on the bundled table the
    first two peak at one frequency, their angle turning 360 * cycles / P degrees per position, the third at one cycle
    over the table; the verdict, the pca caption and the summary say so."""
    report = analyze_positions(bundled)
    table = torch.from_numpy(bundled.tensors["position_embeddings.weight"]).double()
    u, s, _ = torch.linalg.svd(table - table.mean(0), full_matrices=False)
    coords = u[:, :4] * s[:4]
    power = torch.fft.rfft(coords, dim=0).abs()[1:] ** 2  # frequencies 1, 2, ... cycles over the 512 positions
    cycles = (power.argmax(0) + 1).tolist()
    assert np.allclose(np.abs(report.pca_coords), coords.abs().numpy(), atol=1e-8)  # (each up to its sign)
    assert [c["share"] for c in report.components] == pytest.approx((s[:4] ** 2 / (s ** 2).sum()).tolist())
    assert [c["cycles"] for c in report.components] == cycles and cycles[0] == cycles[1] and cycles[2] == 1
    width = max(1, cycles[0] // 10)
    near = float(power[cycles[0] - 1 - width:cycles[0] + width, 0].sum() / power[:, 0].sum())
    assert report.components[0]["near"] == pytest.approx(near) and near > 0.5
    z = torch.complex(coords[:, 0], coords[:, 1])
    turn = float(torch.angle(z[1:] * z[:-1].conj()).rad2deg().abs().median())  # degrees per position, measured
    assert turn == pytest.approx(360 * cycles[0] / 512, abs=3)
    radius = z.abs()  # (the rows past the seam lie further out: no circle)
    assert float((radius.quantile(0.9) - radius.quantile(0.1)) / radius.median()) > 0.3
    said = f"sin/cos pair at {cycles[0]} cycles over the table, a period of {512 / cycles[0]:.3g} positions"
    pca = next(f.caption for f in report.figures() if f.name == "position_pca")
    assert said in report.verdict and said in pca and f"turns a median {turn:.2g}° from the last" in pca
    assert f"at a radius of {float(radius.min()):.3g} to {float(radius.max()):.3g}" in pca
    assert "round a circle" not in pca
    assert f"within ±{cycles[0] // 10} cycles of it" in pca and "within 10%" not in pca
    assert "component 3 (10%) peaks at 1 cycle over the table" in pca
    assert "a few sinusoids in a rotated basis" in report.verdict and "one curve" not in pca + report.verdict
    summary = report.summary()
    assert summary["component_cycles"] == tuple(cycles)
    assert summary["component_periods"] == pytest.approx([512 / c for c in cycles], abs=0.01)


def _table_folder(folder, table: torch.Tensor):
    """A tiny checkpoint whose position table is `table` [P, H]."""
    from safetensors.torch import load_file, save_file

    make_tiny(folder, max_position_embeddings=table.shape[0], hidden_size=table.shape[1])
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["embeddings.position_embeddings.weight"] = table.float().contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("which", ["random", "sinusoidal", "bundled"])
def test_captions_and_verdict_follow_the_measurement(which, tmp_path):
    """A random table is not "like the sinusoids", a sin/cos table is not "not their formula", and the components
    are said as measured (torch's SVD and FFT): the sin/cos table's first two are a pair at one cycle over it."""
    table = {"random": torch.randn(512, 384, generator=torch.Generator().manual_seed(0)) * 0.02,
             "sinusoidal": sinusoidal_table(512, 384), "bundled": None}[which]
    report = analyze_positions(None if table is None else _table_folder(tmp_path, table))
    captions = {f.name: f.caption for f in report.figures()}
    similarity, pca = captions["position_similarity"], captions["position_pca"]
    assert "not their formula" not in similarity and "one curve" not in pca
    if which == "random":
        assert report.verdict.startswith("This table is no different from noise") and "pair" not in pca
        assert "no more alike than any two positions" in similarity and "near the diagonal, like" not in similarity
    if which == "sinusoidal":
        t = table.double()
        u, s, _ = torch.linalg.svd(t - t.mean(0), full_matrices=False)
        power = torch.fft.rfft(u[:, :2] * s[:2], dim=0).abs()[1:] ** 2
        assert (power.argmax(0) + 1).tolist() == [1, 1] and float((power[0] / power.sum(0)).min()) > 0.8
        assert report.verdict.startswith("Yes") and "the sinusoids' own structure" in similarity
        assert "components 1 and 2" in pca and "sin/cos pair at 1 cycle over the table" in pca
        # what the positions do on the pair, measured: 0.56° a step, 255° in all, at a radius that varies by half
        z = (u[:, 0] * s[0] + 1j * u[:, 1] * s[1]).numpy()
        angle, radius = np.degrees(np.angle(z[1:] * np.conj(z[:-1]))), np.abs(z)
        turn = float(np.median(np.abs(angle)))
        assert abs(turn - 360 / 512) > 0.1 and np.ptp(radius) / np.median(radius) > 0.4 and abs(angle.sum()) < 360
        assert f"turns a median {turn:.2g}° from the last ({abs(angle.sum()):.0f}° in all" in pca
        assert f"at a radius of {radius.min():.3g} to {radius.max():.3g}" in pca and "round a circle" not in pca
    if which == "bundled":
        assert "alike near the diagonal as the sinusoids are, in a pattern of its own" in similarity


def test_a_circle_is_said_only_of_a_steady_radius_turning_at_the_frequency(tmp_path):
    """A table whose two largest directions are an exact sin/cos pair at 10 cycles over 128 positions: the positions
    turn 28.125° a step on a circle of one radius, neighbours 2 sin(14.0625°) radii apart."""
    t = np.arange(128) * 2 * np.pi * 10 / 128
    rng = np.random.default_rng(0)
    table = np.column_stack([3 * np.sin(t), 3 * np.cos(t), *(np.sin(t * k / 10 + rng.uniform(0, 6)) for k in
                                                             (1, 2, 3, 5, 20, 30))])
    report = analyze_positions(_table_folder(tmp_path, torch.from_numpy(table)))
    pca = next(f.caption for f in report.figures() if f.name == "position_pca")
    assert f"turns {28.125:.2g}° round a circle from the last, neighbours {2 * np.sin(np.radians(14.0625)):.2f}" in pca


def test_a_seam_is_a_dip_that_stands_out_with_a_level_change():
    """A smooth table with noise has no seam; a step at row 200 (norms x1.15 from there, a spiked row 200) is one,
    its levels the medians either side without the spike; a lone outlier row at either end is none."""
    rng = np.random.default_rng(0)
    table = sinusoidal_table_np(512, 64) + rng.normal(size=(512, 64)) * 0.05
    table[0] *= 6  # (like a [CLS] row)
    table[-1] *= 6
    assert find_seams(table) == [] and find_seams(table, first=2) == []
    table[200:] *= 1.15
    table[200] += rng.normal(size=64)
    (seam,) = find_seams(table, first=2)
    norms = np.linalg.norm(table, axis=1)
    assert seam["at"] == 202 and seam["norm_before"] == pytest.approx(np.median(norms[192:200]))
    assert seam["norm_after"] == pytest.approx(np.median(norms[201:209]))


def test_a_random_table_is_called_noise_not_learned(tmp_path):
    """An untrained table: no seams, no smooth code, and a verdict that says so."""
    folder = make_tiny(tmp_path, max_position_embeddings=256)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    key = "embeddings.position_embeddings.weight"
    tensors[key] = torch.randn(tensors[key].shape, generator=torch.Generator().manual_seed(0)) * 0.02
    save_file(tensors, str(folder / "model.safetensors"))
    report = analyze_positions(folder)
    assert report.kind == "noise" and report.seams == []
    assert report.verdict.startswith("This table is no different from noise") and "learned" not in report.verdict


def test_positions_of_a_sinusoidal_table_say_yes(tmp_path):
    folder = make_tiny(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    key = "embeddings.position_embeddings.weight"
    tensors[key] = sinusoidal_table(*tensors[key].shape).contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    report = analyze_positions(folder)
    assert report.structure_correlation == pytest.approx(1.0)
    assert report.lowfreq_share == pytest.approx(report.lowfreq_share_sinusoid)
    assert report.seams == [] and report.verdict.startswith("Yes")


# --- segments -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["tiny", "bundled"])
def test_segments_against_the_torch_layer(which, tiny):
    """The segment rows, and the output's change from segment A to B measured on the pair (both texts), as torch's
    layer gives it."""
    model, text = (tiny, "the quick fox") if which == "tiny" else (None, "The quick brown fox")
    report = analyze_segments(text, "the cat", model)
    layer = BertEmbeddings.from_pretrained(model).double().eval()
    seg = layer.token_type_embeddings.weight.detach()
    assert report.difference_norm == pytest.approx(float((seg[1] - seg[0]).norm()))
    assert report.cosine == pytest.approx(float(F.cosine_similarity(seg[0], seg[1], dim=0)))
    assert report.zeros_and_ones is False
    ids = torch.tensor([Tokenizer.from_pretrained(model)(text, "the cat").input_ids])
    with torch.no_grad():
        out_a, out_b = layer(ids, torch.zeros_like(ids))[0], layer(ids, torch.ones_like(ids))[0]
    assert np.allclose(report.output_change, (out_b - out_a).norm(dim=1).numpy(), atol=1e-4)
    assert np.allclose(report.output_cosine, F.cosine_similarity(out_a, out_b).numpy(), atol=1e-5)
    assert report.pair_segments.count(1) == len(report.pair_tokens) - report.pair_segments.index(1)


def test_segments_that_are_zeros_and_ones_are_reported(tmp_path):
    folder = make_tiny(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["embeddings.token_type_embeddings.weight"] = torch.stack([torch.zeros(10), torch.ones(10)])
    save_file(tensors, str(folder / "model.safetensors"))
    report = analyze_segments("the cat", model=folder)
    assert report.zeros_and_ones is True and report.distance_from_zeros_and_ones == (0.0, 0.0)
    figure = next(f for f in report.figures() if f.name == "segments")  # (no "not 0 and 1" over rows that are)
    assert "they ARE zeros and ones" in figure.caption
    drawn = figure.draw()
    assert drawn.axes[0].get_title() == figure.plotly().layout.title.text == "Segment rows: zeros and ones (dashed)"
    drawn.clear()


def test_a_projection_before_the_norm_lets_zeros_and_ones_tell_segments_apart(member_checkpoint, tmp_path):
    """DeBERTa with E != H projects the sum before LayerNorm: 1 added at E becomes W·1, not a constant, so the caption
    may not say LayerNorm removes it (it did). The change is LayerNorm's of (x + 1) W^T against x W^T, in float64."""
    from conftest import write_member_tokenizer

    folder = shutil.copytree(member_checkpoint("deberta-v2-factorised")[0], tmp_path / "deberta")
    layer = BertEmbeddings.from_pretrained(folder)
    write_member_tokenizer(folder, layer.config)
    report = analyze_segments("the quick brown fox", model=folder)
    ids = torch.tensor([Tokenizer.from_pretrained(folder)("the quick brown fox").input_ids])
    with torch.no_grad():
        total = (layer.word_embeddings(ids) + layer.position_embeddings(torch.arange(ids.shape[1]))
                 + layer.token_type_embeddings(torch.zeros_like(ids))).double()[0]
        weight = layer.projection.weight.double()

        def normed(x):
            return F.layer_norm(x @ weight.T, (weight.shape[0],), eps=1e-12)
        expected = float((normed(total + 1) - normed(total)).abs().max())
    assert expected > 1e-2 and report.constant_shift_change == pytest.approx(expected, rel=1e-3, abs=1e-5)
    caption = next(f for f in report.figures() if f.name == "segments").caption
    assert "would tell A from B, through the projection E -> H" in caption and "could not tell" not in caption


def test_segments_show_their_values_and_why_zeros_and_ones_could_not_work():
    """The rows' real values, their distance from 0 and 1, and LayerNorm removing a constant added to every entry
    (to float32 rounding: a constant segment row could tell nothing apart). The pair appears only when asked for."""
    report = analyze_segments("The quick brown fox")
    layer = BertEmbeddings.from_pretrained()
    seg = layer.token_type_embeddings.weight.detach()
    assert report.first_values[1] == pytest.approx(seg[1, :6].tolist())
    assert report.distance_from_zeros_and_ones[1] == pytest.approx(float((seg[1] - 1).norm()), rel=1e-5)
    ids = torch.tensor([Tokenizer.from_pretrained()("The quick brown fox").input_ids])
    with torch.no_grad():  # torch's own LayerNorm (no affine), float32: the same measurement, independently
        total = layer.decompose(ids).sum
        shift = (F.layer_norm(total + 1, total.shape[-1:]) - F.layer_norm(total, total.shape[-1:])).abs().max()
    assert 0 < report.constant_shift_change < 1e-5 and float(shift) < 1e-5
    assert report.pair_tokens == [] and report.warning is None
    pair = analyze_segments("The quick brown fox", "It was not amused.")
    assert pair.pair_tokens[-1] == "[SEP]" and pair.pair_segments[-1] == 1
    literal = analyze_segments("The fox [SEP] It was not amused.")
    assert "literal [SEP]" in literal.warning and "segment A" in literal.warning


# --- tokens ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["tiny", "bundled"])
def test_token_neighbours_are_the_torch_top_k(which, tiny):
    model, token = (tiny, "king") if which == "tiny" else (None, "king")
    report = analyze_tokens(token, model, k=5)
    words = load_tables(tiny if which == "tiny" else Tokenizer.from_pretrained().source.folder)[
        "word_embeddings.weight"]
    row = Tokenizer.from_pretrained(model).token_to_id(token)
    cos = F.cosine_similarity(words, words[row][None], dim=1)
    cos[row] = -2
    top = cos.topk(5)
    assert [n["id"] for n in report.neighbours] == top.indices.tolist()
    assert np.allclose([n["cosine"] for n in report.neighbours], top.values.numpy())
    assert report.pad_is_zero is (which == "tiny")
    assert np.allclose(report.norms, words.norm(dim=1).numpy())
    assert {s["token"] for s in report.special} == {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}


def test_token_norm_rank_correlation_on_bundled(bundled):
    report = analyze_tokens("king", bundled)
    assert report.rank_start == 1996 and report.unused_median_norm is not None
    norms = report.norms[1996:]
    ranks = np.empty(len(norms))
    ranks[np.argsort(norms)] = np.arange(len(norms))
    expected = np.corrcoef(np.arange(len(norms)), ranks)[0, 1]
    assert report.rank_norm_correlation == pytest.approx(expected)


def test_a_word_that_splits_gives_its_pieces_and_their_neighbours():
    """A word that is not one entry is not refused: its pieces each get their neighbours (the torch top-k)."""
    report = analyze_tokens("embeddings", k=3)
    assert [p["token"] for p in report.pieces] == ["em", "##bed", "##ding", "##s"]
    assert "splits into" in report.note and report.token == "em"
    words = BertEmbeddings.from_pretrained().word_embeddings.weight.detach()
    piece = report.pieces[2]
    cos = F.cosine_similarity(words, words[piece["id"]][None], dim=1)
    cos[piece["id"]] = -2
    assert [n["id"] for n in piece["neighbours"]] == cos.topk(3).indices.tolist()


def test_the_word_tables_row_norms_are_computed_once_per_call(tiny, monkeypatch):
    """Not once per piece: each piece's neighbours reuse the [V] norms (they were all 30,522 again per piece)."""
    from bertembed.explain import tokens

    shapes = []
    monkeypatch.setattr(tokens, "row_norms", lambda m: shapes.append(m.shape) or np.linalg.norm(m, axis=-1))
    report = analyze_tokens("the cat sat", tiny, k=3)
    assert [p["token"] for p in report.pieces] == ["the", "cat", "sat"] and shapes == [(len(helpers.VOCAB), 10)]


def test_a_capitalised_word_is_found_where_the_model_lowercases():
    report = analyze_tokens("Paris", k=3)
    assert report.token == "paris" and report.asked == "Paris" and "normalises" in report.note and not report.pieces
    assert report.note.endswith("(lower-casing)")
    accented = analyze_tokens("Pâris", k=3)  # (BERT's uncased normaliser strips accents too)
    assert accented.token == "paris" and accented.note.endswith("(lower-casing, stripping accents and the like)")


def test_a_cased_tokenizer_that_strips_accents_is_not_said_to_lower_case(tmp_path, bundled_path):
    for name in ("vocab.txt", "config.json", "model.safetensors"):
        shutil.copy(bundled_path / name, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False, "strip_accents": True}))
    report = analyze_tokens("café", tmp_path, k=3)
    assert report.token == "cafe" and report.note.endswith("(stripping accents and the like)")


def test_a_word_the_tokenizer_makes_unknown_is_refused(tiny):
    """Its pieces hold the unknown token, whose neighbours say nothing of the word: ValueError (the CLI's exit 2)."""
    for word in ("\U0001f642", "cat\U0001f642"):
        with pytest.raises(ValueError, match=r"not in the vocabulary: the tokenizer gives \['\[UNK\]'\]"):
            analyze_tokens(word)
    with pytest.raises(ValueError, match=r"gives \['cat', '\[UNK\]'\]"):
        analyze_tokens("cat zebra", tiny)  # (one word of a few unknown)
    assert analyze_tokens("[UNK]", tiny).token == "[UNK]"  # (the entry itself is a row to ask about)


def test_the_special_rows_are_the_tokenizers_own(tiny, tmp_path):
    """RoBERTa-style specials where the tokenizer has them, even beside a BERT-style entry such as [PAD] that the
    vocabulary holds as a plain word (as MPNet's does)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    folder = shutil.copytree(tiny, tmp_path / "roberta_style")
    (folder / "vocab.txt").unlink()
    words = ["<s>", "<pad>", "</s>", "<unk>", *helpers.VOCAB[4:]]
    words[5] = "[PAD]"  # (a plain word, never special)
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>"])
    backend.save(str(folder / "tokenizer.json"))
    norms = load_tables(folder)["word_embeddings.weight"].norm(dim=1)
    report = analyze_tokens("cat", folder)
    assert [(s["token"], s["id"]) for s in report.special] == [("<s>", 0), ("<pad>", 1), ("</s>", 2), ("<unk>", 3)]
    assert np.allclose([s["norm"] for s in report.special], norms[:4].numpy())


# --- one-hot --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["tiny", "bundled"])
def test_onehot_equals_lookup(which, tiny):
    model, text = (tiny, "the cat sat on the mat") if which == "tiny" else (None, "I am Sinan")
    report = analyze_onehot(text, model, repeats=2)
    words = load_tables(tiny if which == "tiny" else Tokenizer.from_pretrained().source.folder)[
        "word_embeddings.weight"].float()
    ids = torch.tensor(report.ids)
    assert torch.equal(F.one_hot(ids, words.shape[0]).float() @ words, words[ids])
    assert report.equal and report.max_abs_diff == 0.0
    assert report.lookup_bytes == len(ids) * words.shape[1] * 4
    assert report.onehot_bytes == len(ids) * words.shape[0] * 4 + words.numel() * 4
    assert report.lookup_seconds > 0 and report.onehot_seconds > 0
    if which == "bundled":
        assert report.ids == [101, 1045, 2572, 8254, 2319, 102]  # the seed's ids for "I am Sinan"


def test_onehot_times_are_medians_of_the_repeats_with_their_spread(tiny, monkeypatch):
    """The time of one run swings with the machine's load: the report gives the median of the repeats, the fastest
    and the slowest, never one run as fact. A timer that reports known seconds per repeat stands in for the clock."""
    from bertembed.explain import onehot

    class Timer:  # one call takes 1 s (so each repeat is one call); the repeats take these seconds
        def __init__(self, fn):
            self.fn = fn

        def timeit(self, number):
            return 1.0

        def repeat(self, repeat, number):
            return [0.3, 0.1, 0.2, 0.9, 0.5][:repeat]

    monkeypatch.setattr(onehot.timeit, "Timer", Timer)
    report = analyze_onehot("the cat sat", tiny, repeats=5)
    assert report.repeats == 5 and report.onehot_seconds == report.lookup_seconds == 0.3
    assert report.onehot_range == report.lookup_range == (0.1, 0.9)
    summary = report.summary()
    assert summary["onehot_us"] == pytest.approx(3e5) and summary["onehot_us_range"] == pytest.approx([1e5, 9e5])
    assert "Medians of 5 repeats (fastest-slowest)" in report.figures()[0].caption
    assert "(1e+05-9e+05 µs" in report.figures()[0].caption


# --- drift ----------------------------------------------------------------------------------------------------

def test_drift_finds_exactly_the_changed_rows(tiny, tiny_b):
    folder_b, changes = tiny_b
    report = drift(tiny, folder_b, top=5)
    by_table = {t.table: t for t in report.tables}
    a, b = load_tables(tiny), load_tables(folder_b)
    for name, key in (("word", "word_embeddings.weight"), ("position", "position_embeddings.weight")):
        delta = b[key] - a[key]
        assert by_table[name].relative_change == pytest.approx(float(delta.norm() / a[key].norm()), rel=1e-5)
        changed = sorted(row for (k, row) in changes if k.endswith(key))
        assert sorted(r["row"] for r in by_table[name].top) == changed
        assert by_table[name].rows_changed == len(changed)
    assert [r["row"] for r in by_table["word"].top] == [7, 19]  # the bigger change first
    assert by_table["word"].top[0]["label"].startswith("cat")
    assert by_table["segment"].rows_changed == 0 and by_table["segment"].relative_change == 0.0
    for name, key in (("word", "word_embeddings.weight"), ("position", "position_embeddings.weight")):
        rows = sorted({row for (k, row) in changes if k.endswith(key)})
        own = ((b[key] - a[key])[rows].norm(dim=1) / a[key][rows].norm(dim=1)).double()
        assert by_table[name].median_row_change == pytest.approx(float(np.median(own.numpy())), rel=1e-5)


def test_drift_lists_the_top_rows_asked_for(tiny, tmp_path):
    """--top N lists N rows per table, in the table's rows and their JSON too (they stopped at 5)."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny, tmp_path / "b")
    tensors = load_file(str(folder / "model.safetensors"))
    key = "embeddings.word_embeddings.weight"
    tensors[key][5:13] += torch.arange(1, 9, dtype=torch.float32)[:, None]  # (8 rows, the last moved most)
    save_file(tensors, str(folder / "model.safetensors"))
    for top, listed in ((7, 7), (10, 8)):
        word = next(row for row in drift(tiny, folder, top=top).rows() if row["table"] == "word")
        assert word["most_changed"].count(" of its norm)") == listed
        assert word["most_changed"].startswith(helpers.VOCAB[12])


def test_drift_ranks_a_row_that_was_zero_apart_and_sees_the_projection(tiny, tmp_path, member_checkpoint):
    """A row that was all zeros has no relative change (it was divided by 1e-30: 5.5e+27 of its norm, ranked first);
    ALBERT's projection E -> H is compared like the tables (it was left out), and a different H is refused."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny, tmp_path / "b")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["embeddings.word_embeddings.weight"][0] += 1e-3  # (the tiny checkpoint's [PAD] row is zero)
    tensors["embeddings.word_embeddings.weight"][7] *= 2
    save_file(tensors, str(folder / "model.safetensors"))
    word = next(t for t in drift(tiny, folder).tables if t.table == "word")
    assert [r["row"] for r in word.top] == [0, 7] and word.top[0]["relative"] == np.inf
    assert word.median_row_change == pytest.approx(1.0) and word.rows_changed == 2
    albert = member_checkpoint("albert")[0]
    other = shutil.copytree(albert, tmp_path / "albert")
    tensors = load_file(str(other / "model.safetensors"))
    key = next(k for k in tensors if k.endswith("embedding_hidden_mapping_in.weight"))
    tensors[key] = tensors[key] * 2
    save_file(tensors, str(other / "model.safetensors"))
    moved = {t.table: t for t in drift(albert, other).tables}
    assert moved["projection.weight"].relative_change == pytest.approx(1.0) and moved["word"].rows_changed == 0
    wider = tmp_path / "wider"
    config = json.loads((albert / "config.json").read_text())
    transformers = pytest.importorskip(
        "transformers", reason="ALBERT of another width is written by transformers (the dev extra)")
    transformers.AlbertModel(transformers.AlbertConfig(**{**config, "hidden_size": 64})).save_pretrained(wider)
    with pytest.raises(ValueError, match=r"different shapes.*projection.weight"):
        drift(albert, wider)


def test_drift_does_not_rank_a_table_by_its_size(tmp_path):
    """The same change of one row in a big and a small table: the whole-tensor measure shrinks with the table's
    rows, the moved row's own change does not (the figure ranks by that)."""
    from safetensors.torch import load_file, save_file

    a = make_tiny(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    tensors = load_file(str(b / "model.safetensors"))
    for key in ("embeddings.word_embeddings.weight", "embeddings.token_type_embeddings.weight"):
        tensors[key][1] *= 1.5  # each table: one row, 50% longer
    save_file(tensors, str(b / "model.safetensors"))
    by_table = {t.table: t for t in drift(a, b).tables}
    word, segment = by_table["word"], by_table["segment"]
    assert word.median_row_change == pytest.approx(0.5) == pytest.approx(segment.median_row_change)
    assert word.relative_change < segment.relative_change  # (the whole-tensor measure depends on the size)


def test_drift_refuses_different_shapes(tiny, tmp_path):
    from bertembed.config import EmbeddingConfig

    layer = BertEmbeddings(EmbeddingConfig(vocab_size=29, hidden_size=12, max_position_embeddings=16))
    layer.save_pretrained(tmp_path / "wide")
    with pytest.raises(ValueError, match="different shapes.*word_embeddings.weight: \\(29, 10\\) vs \\(29, 12\\)"):
        drift(tiny, tmp_path / "wide")


# --- input that would give a silently wrong answer ----------------------------------------------------------------

@pytest.mark.parametrize("call, pattern", [
    (lambda m: explain_text("\x00\x01", None, m), r"TEXT has no tokens.*U\+0000, U\+0001"),
    (lambda m: explain_text("the cat", "\u200b\u200c\u2060", m), r"TEXT_B has no tokens.*U\+200B, U\+200C, U\+2060"),
    (lambda m: analyze_segments("\ufeff", model=m), r"the text has no tokens.*U\+FEFF"),
    (lambda m: analyze_segments("the cat", " \u200b \t\x00 ", m), r"text_b has no tokens.*U\+200B, U\+0000"),
    (lambda m: analyze_onehot("\u2060 \x00", m), r"the text has no tokens"),
])
def test_texts_without_tokens_are_refused(tiny, call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call(tiny)


def test_finetune_sentences_without_tokens_are_refused(tiny):
    from bertembed.explain import finetune_demo

    with pytest.raises(ValueError, match=r"sentence 1 has no tokens"):
        finetune_demo(tiny, steps=1, sentences=(("the cat", 1), ("\u200b", 0)))


@pytest.mark.parametrize("call, pattern", [
    (lambda m: analyze_positions(m, k=0), r"k=0: fit at least 1"),
    (lambda m: analyze_positions(m, k=-1), r"k=-1: fit at least 1"),
    (lambda m: analyze_tokens("king", m, k=0), r"k=0: ask for at least 1"),
    (lambda m: analyze_tokens("king", m, k=-1), r"k=-1: ask for at least 1"),
    (lambda m: drift(m, m, top=-1), r"top=-1: list 0 or more"),
    (lambda m: analyze_onehot("the cat", m, repeats=0), r"repeats=0"),
])
def test_counts_below_their_minimum_are_refused(tiny, call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call(tiny)


def test_finetune_counts_below_their_minimum_are_refused(tiny):
    from bertembed.explain import finetune_demo

    for kwargs, pattern in (({"steps": 0}, "steps=0"), ({"steps": -1}, "steps=-1"), ({"lr": 0.0}, "lr=0.0"),
                            ({"lr": -1e-3}, "lr=-0.001")):
        with pytest.raises(ValueError, match=pattern):
            finetune_demo(tiny, **kwargs)


def test_onehot_refuses_more_tokens_than_positions_before_building_the_matrix(bundled):
    # 602 tokens: the text the model could not take; the bound is the tokenizer's, and it names the excess
    text = "word " * 600
    assert len(Tokenizer.from_pretrained()(text, truncation=False).input_ids) == 602
    with pytest.raises(ValueError, match=r"602 tokens .* 512 positions: shorten it by 90 tokens"):
        analyze_onehot(text, bundled)


def test_onehot_refuses_a_matrix_over_the_byte_limit(tiny, monkeypatch):
    from bertembed.explain import onehot

    assert onehot.MAX_ONEHOT_BYTES >= 512 * 30522 * 4  # BERT's own longest text fits under the real limit
    tokens = len(Tokenizer.from_pretrained(tiny)("the cat sat").input_ids)
    vocab = load_tables(tiny)["word_embeddings.weight"].shape[0]
    size = tokens * vocab * 4  # [tokens, V] float32, computed here from the checkpoint's own table
    monkeypatch.setattr(onehot, "MAX_ONEHOT_BYTES", size)
    assert analyze_onehot("the cat sat", tiny, repeats=1).equal  # exactly at the limit: allowed
    monkeypatch.setattr(onehot, "MAX_ONEHOT_BYTES", size - 1)
    with pytest.raises(ValueError, match=rf"{tokens} tokens x {vocab} ids .* give at most {tokens - 1} tokens"):
        analyze_onehot("the cat sat", tiny, repeats=1)


def test_drift_names_non_finite_tensors_and_json_gets_null(tiny, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from bertembed.explain._common import to_jsonable

    folder = tmp_path / "b"
    shutil.copytree(tiny, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["embeddings.word_embeddings.weight"][7, 3] = float("nan")
    tensors["embeddings.word_embeddings.weight"][9] += 0.5
    tensors["embeddings.LayerNorm.bias"][2] = float("inf")
    save_file(tensors, str(folder / "model.safetensors"))
    report = drift(tiny, folder, top=5)
    by_table = {t.table: t for t in report.tables}
    b = load_tables(folder)
    # the independent reference: rows with a non-finite value, found by torch in the saved file
    nan_rows = torch.nonzero(~torch.isfinite(b["word_embeddings.weight"]).all(1)).flatten().tolist()
    assert nan_rows == [7] and by_table["word"].non_finite == {"B": [7]}
    assert by_table["LayerNorm.bias"].non_finite == {"B": [2]} and by_table["position"].non_finite == {}
    assert by_table["word"].rows_changed == 2 and [r["row"] for r in by_table["word"].top] == [9]
    assert [r["row"] for r in by_table["LayerNorm.bias"].top] == []  # an inf change is not ranked
    assert "word of B" in report.warning() and "row(s) 7 of 29" in report.warning()
    assert "LayerNorm.bias of B" in report.summary()["warning"] and drift(tiny, tiny).warning() == ""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    text = json.dumps(to_jsonable({"summary": report.summary(), "rows": report.rows()}), allow_nan=False)
    data = json.loads(text, parse_constant=refuse)
    assert data["summary"]["word_relative_change"] is None and data["summary"]["LayerNorm.bias_relative_change"] is None
    assert data["summary"]["position_relative_change"] == 0.0


def test_to_jsonable_turns_non_finite_numbers_into_null():
    from bertembed.explain._common import to_jsonable

    value = {"a": float("nan"), "b": [np.float32("inf"), 1.5], "c": np.array([[1.0, -np.inf], [np.nan, 2.0]]),
             "d": np.float64(3.0), "e": np.int64(4), "f": True}
    assert to_jsonable(value) == {"a": None, "b": [None, 1.5], "c": [[1.0, None], [None, 2.0]], "d": 3.0, "e": 4,
                                  "f": True}


# --- one checkpoint, read once --------------------------------------------------------------------------------------

def test_the_analyses_of_one_text_resolve_and_read_the_checkpoint_once(tiny, monkeypatch):
    """All analyses of one text, the fine-tune included: the name is resolved once, the tokenizer read once, the
    weights once as numpy arrays and once as torch tensors (the fine-tune trains the torch layer)."""
    from collections import Counter

    from bertembed import sources
    from bertembed.explain.report import run_analyses

    made, read, file = [], Counter(), sources.Source.file

    class Counted(sources.Source):
        def __init__(self, *args, **kwargs):
            made.append(args)
            super().__init__(*args, **kwargs)

        def file(self, name):
            read[name] += 1
            return file(self, name)

    monkeypatch.setattr(sources, "Source", Counted)
    results = run_analyses("the cat sat", "a dog", str(tiny), finetune=True, steps=1)
    assert len(results) == 6 and len(made) == 1
    assert read["vocab.txt"] == 1 and read["model.safetensors"] == 2


# --- the projector --------------------------------------------------------------------------------------------

def numpy_top_k(words: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Every row's k nearest rows by cosine in float64, itself excluded: (ids, cosines), nearest first."""
    words = words.astype(np.float64)
    unit = words / np.maximum(np.linalg.norm(words, axis=1, keepdims=True), 1e-30)
    cos = unit @ unit.T
    np.fill_diagonal(cos, -np.inf)
    ids = np.argsort(-cos, axis=1, kind="stable")[:, :k]
    return ids, np.take_along_axis(cos, ids, 1)


def test_every_rows_neighbours_are_the_numpy_top_k_and_are_cached(tmp_path, monkeypatch):
    """Over several blocks of rows (a zero row, like [PAD], among them): the ids numpy finds in float64, their cosines
    to float16; saved as int32 and float16 once, then read back without a product."""
    from bertembed.explain import projector

    monkeypatch.setenv("BERTEMBED_CACHE", str(tmp_path))
    words = np.random.default_rng(0).standard_normal((2500, 24)).astype(np.float32)
    words[3] = 0
    ids, scores, path = projector.nearest_rows(words, k=10)
    expected_ids, expected = numpy_top_k(words, 10)
    rows = np.arange(len(words)) != 3  # (the zero row is at cosine 0 from every row: any 10 are its nearest)
    assert np.array_equal(ids[rows], expected_ids[rows])
    np.testing.assert_allclose(scores.astype(np.float64), expected, atol=1e-3)
    assert ids.dtype == np.int32 and scores.dtype == np.float16 and path.parent == tmp_path
    with np.load(path) as saved:
        assert saved["ids"].nbytes + saved["scores"].nbytes == 2500 * 10 * (4 + 2)
    monkeypatch.setattr(np, "argpartition", lambda *a, **k: pytest.fail("the cached neighbours were found again"))
    again = projector.nearest_rows(words, k=10)
    assert np.array_equal(again[0], ids) and np.array_equal(again[1], scores)
    words[0, 0] += 1  # another table: another file
    monkeypatch.undo()
    monkeypatch.setenv("BERTEMBED_CACHE", str(tmp_path))
    assert projector.nearest_rows(words, k=10)[2] != path


def test_an_unwritable_cache_warns_and_the_map_is_made_all_the_same(tiny, tmp_path, monkeypatch, caplog):
    from bertembed.explain import word_map

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("BERTEMBED_CACHE", str(tmp_path / "file" / "cache"))
    result = word_map("the cat", model=tiny)
    assert "not cached" in caplog.text and result.neighbours.shape == (len(helpers.VOCAB), 10)


def test_the_word_map_is_the_tables_two_principal_components(tiny, tmp_path, monkeypatch):
    """The coordinates are the centred table on its two leading right singular vectors (up to sign), their shares of
    the variance the squared singular values'; the text's own tokens are the pair's."""
    from bertembed.explain import word_map

    monkeypatch.setenv("BERTEMBED_CACHE", str(tmp_path))
    result = word_map("the cat", "a dog", tiny)
    words = load_tables(tiny)["word_embeddings.weight"].numpy()
    centred = words - words.mean(0)
    _, singular, vt = np.linalg.svd(centred, full_matrices=False)
    expected = centred @ vt[:2].T
    signs = np.sign((result.xy * expected).sum(0))
    np.testing.assert_allclose(result.xy * signs, expected, atol=1e-5)
    assert result.shares == pytest.approx(singular[:2] ** 2 / (singular ** 2).sum())
    assert result.tokens == ["[CLS]", "the", "cat", "[SEP]", "a", "dog", "[SEP]"]
    assert result.vocabulary == helpers.VOCAB
    assert result.summary()["cache_bytes"] == len(helpers.VOCAB) * 10 * 6


def test_a_word_table_too_large_for_the_projector_is_refused(tiny, monkeypatch):
    from bertembed.explain import projector

    monkeypatch.setattr(projector, "MAX_ROWS", 20)
    with pytest.raises(ValueError, match=r"at most 20 rows \(MAX_ROWS\).* has 29"):
        projector.word_map("the cat", model=tiny)


# --- the report's sections ------------------------------------------------------------------------------------

def test_onehot_of_a_pair_embeds_both_texts(tiny):
    report = analyze_onehot("the cat", tiny, text_b="a dog", repeats=1)
    assert report.ids == Tokenizer.from_pretrained(tiny)("the cat", "a dog").input_ids
    assert report.tokens == ["[CLS]", "the", "cat", "[SEP]", "a", "dog", "[SEP]"]


def test_the_report_uses_the_second_text_and_the_token_asked_for(tiny):
    from bertembed.explain.report import run_analyses

    pair = Tokenizer.from_pretrained(tiny)("the cat", "a dog").input_ids
    dec, _, segments, tokens, onehot = run_analyses("the cat", "a dog", tiny)
    assert dec.ids == onehot.ids == pair and segments.tokens == segments.pair_tokens == dec.tokens
    assert tokens.token == "the"  # by default the text's first word
    assert run_analyses("the cat", model=tiny, token="king")[3].token == "king"


def test_only_claims_true_of_every_bert_checkpoint_are_tagged_structural(tiny, tiny_b):
    """The answers tagged STRUCTURAL are the same sentence on two different checkpoints (they follow from the layer's
    structure); those tagged as measured are the positions, the word table and the drift, whose claims are numbers
    of one checkpoint; a member without the table claims nothing."""
    from bertembed.explain._common import MEASURED, STRUCTURAL, NotMeasured
    from bertembed.explain.report import run_analyses

    one = run_analyses("the cat", "a dog", tiny, finetune=True, steps=1)
    other = run_analyses("a cat sat", None, tiny_b[0], finetune=True, steps=1)
    tags = {type(r).__name__: r.tag for r in one}
    assert tags == {"TextDecomposition": STRUCTURAL, "PositionReport": MEASURED, "SegmentReport": STRUCTURAL,
                    "TokenReport": MEASURED, "OneHotReport": STRUCTURAL, "FinetuneReport": STRUCTURAL}
    for a, b in zip(one, other, strict=True):
        if a.tag == STRUCTURAL:
            assert a.answer and a.answer == b.answer
    assert drift(tiny, tiny_b[0]).tag == MEASURED and NotMeasured("Segments", "no table").tag == ""


def test_the_guides_distance_share_is_a_least_squares_toeplitz_fit(bundled):
    """scripts/make_guide.py's share of the off-diagonal similarity explained by distance alone, against lstsq on
    one indicator column per diagonal; a matrix of distance alone gives 1."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_guide", Path(__file__).parents[1] / "scripts/make_guide.py")
    guide = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guide)
    sim = analyze_positions(bundled).similarity[:64, :64]
    i, j = np.triu_indices(64, k=1)
    design = np.eye(64)[j - i][:, 1:]  # (offsets 1..63)
    fit = design @ np.linalg.lstsq(design, sim[i, j], rcond=None)[0]
    share = 1 - ((sim[i, j] - fit) ** 2).sum() / ((sim[i, j] - sim[i, j].mean()) ** 2).sum()
    assert guide.distance_share(sim) == pytest.approx(share) and 0.2 < share < 0.95
    assert guide.distance_share(np.cos(np.subtract.outer(np.arange(64), np.arange(64)) / 5.0)) == pytest.approx(1)
