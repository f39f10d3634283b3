"""One paragraph per figure, stating the measured numbers (shared by the report, --plots, notebooks and the guide)."""

from __future__ import annotations

import numpy as np


def seam_hypothesis(at: int) -> str:
    """What may have left a seam at position `at`: said as a hypothesis, with its confounds."""
    if abs(at - 128) <= 2:
        return ("A hypothesis, not a proof: BERT pre-trained 90% of its steps on 128-token sequences; a fine-tune cut "
                "at 128 tokens could leave it too (all-MiniLM-L6-v2's own fine-tune was).")
    return (f"A hypothesis: training on sequences of about {at} tokens (pre-training or a fine-tune) leaves rows past "
            f"them trained less; the model's training recipe would tell.")


def caption_decomposition_norms(dec) -> str:
    n = dec.norms()
    b = sum(dec.segments)
    return (f"{len(dec.tokens)} tokens ({b} in segment B, shaded). Mean norms: word {n['word'].mean():.3f}, position "
            f"{n['position'].mean():.3f}, segment {n['segment'].mean():.3f}; their sum {n['sum'].mean():.3f}. "
            f"After LayerNorm the output norm is {n['output'].mean():.2f} on average: LayerNorm rescales every "
            f"token to unit variance, then applies its learned gain and bias.")


def caption_variance_shares(dec) -> str:
    s = dec.overall_shares()
    return (f"Share of the variance over the hidden dimensions of word + position + segment that comes from each part "
            f"(Cov(part, sum) / Var(sum); the three add up to 1 per token). Pooled over the tokens: word "
            f"{s['word']:.0%}, position {s['position']:.0%}, segment {s['segment']:.0%}. "
            f"LayerNorm(sum) recomputed by hand equals the layer's output to {dec.max_abs_diff:.1e}.")


def caption_position_similarity(r) -> str:
    return (f"Cosine similarity between every pair of the {len(r.norms)} learned position vectors (left) and of a "
            f"sinusoidal table of the same size (right). The two patterns correlate r = {r.structure_correlation:.2f} "
            f"(off-diagonal entries). Neighbouring learned positions have cosine "
            f"{float(np.diag(r.similarity, 1).mean()):.2f} on average: similar near the diagonal, like the sinusoids, "
            f"but the learned table is not their formula.")


def caption_position_norms(r) -> str:
    text = (f"Norm of each position vector: {r.norms.min():.3f} to {r.norms.max():.3f} (position "
            f"{int(np.argmax(r.norms)) + r.first} is the largest), and the cosine of each with the next.")
    for s in r.seams:
        text += (f" At position {s['at']} the cosine with the neighbour dips to {s['neighbour_cosine']:.2f} (typically "
                 f"{s['typical_neighbour_cosine']:.2f}) and the mean norm steps from {s['norm_before']:.3f} to "
                 f"{s['norm_after']:.3f}: a seam, found from the table. {seam_hypothesis(s['at'])}")
    return text if r.seams else text + " No seam: no boundary stands out from the rest of the table."


def caption_position_spectrum(r) -> str:
    return (f"How each hidden dimension varies along the positions, as a spectrum. Frequencies 1-{r.k} (the shaded "
            f"band) hold {r.lowfreq_share:.0%} of the learned table's variance over positions "
            f"({r.lowfreq_share_sinusoid:.0%} for the sinusoidal table, {r.lowfreq_share_noise:.0%} for white noise). "
            f"Per hidden dimension, the strongest frequency has median {np.median(r.peaks):.0f} cycles over the table "
            f"(sinusoidal: {np.median(r.sinusoid_peaks):.0f}).")


def caption_position_pca(r) -> str:
    return (f"Each position on the table's first two principal components (each hidden dimension centred over "
            f"positions): they hold {r.pca_share_2:.0%} of the variance, the first ten {r.pca_share_10:.0%}. "
            f"Neighbouring positions lie next to each other on one curve: order is encoded smoothly, in a few "
            f"directions of the hidden space, whatever their rotation.")


def caption_segments(r) -> str:
    verdict = "they ARE zeros and ones" if r.zeros_and_ones else "not zeros and ones"
    return (f"The segment table has {len(r.norms)} learned rows: |A| = {r.norms[0]:.3f}, |B| = {r.norms[1]:.3f}, "
            f"cosine(A, B) = {r.cosine:.2f}, |B - A| = {r.difference_norm:.3f}; {verdict}. For scale: the median word "
            f"vector has norm {r.median_word_norm:.3f}, the median position vector {r.median_position_norm:.3f}.")


def caption_segment_effect(r) -> str:
    return (f"The same text ({len(r.tokens)} tokens) embedded with every token in segment A, then in segment B: the "
            f"output moves by {r.output_change.mean():.2f} on average (mean output norm {r.output_norm:.2f}), output "
            f"cosine {r.output_cosine.mean():.3f}. In a pair, [CLS] A [SEP] take segment A and B [SEP] take "
            f"segment B: one sequence, processed in parallel, told apart only by this added vector.")


def caption_token_norms(r) -> str:
    text = (f"Norm of each of the {len(r.norms)} word-table rows against its id: median {r.median_norm:.3f}; "
            f"[PAD] row {'is all zeros' if r.pad_is_zero else 'is not zero'}.")
    if r.unused_median_norm is not None:
        text += f" The never-used [unusedN] rows have median norm {r.unused_median_norm:.3f}."
    if r.rank_norm_correlation is not None:
        text += (f" From id {r.rank_start} ('the') on, ids follow frequency roughly; Spearman correlation of id and "
                 f"norm there: {r.rank_norm_correlation:+.2f}.")
    return text


def caption_neighbours(r) -> str:
    near = ", ".join(f"{n['token']} ({n['cosine']:.2f})" for n in r.neighbours[:5])
    return (f"{r.token!r} is row {r.token_id} (norm {r.token_norm:.3f}). Its nearest rows by cosine: {near}. The "
            f"table is a dictionary of learned vectors; neighbours share meaning before any context is added.")


def caption_onehot(r) -> str:
    s = r.summary()
    return (f"one_hot(ids) @ W and W[ids] on {len(r.ids)} tokens: {'identical' if r.equal else 'different'} "
            f"(max |diff| {r.max_abs_diff:.1e}). The lookup took {s['lookup_us']:.2g} µs and touched "
            f"{r.lookup_bytes / 1e3:.3g} kB; the product took {s['onehot_us']:.3g} µs ({s['slowdown']:.0f}x) and "
            f"touched {r.onehot_bytes / 1e6:.3g} MB, because it reads all {r.vocab_size} rows of the table.")


def caption_finetune_rows(r) -> str:
    parts = []
    for run in r.runs:
        moved = ", ".join(f"{t.table} {t.moved}/{t.rows}" for t in run.tables)
        parts.append(f"{run.spec.name}: {moved} (loss {run.loss_first:.3f} -> {run.loss_last:.3f})")
    return (f"{r.steps} steps on {len(r.sentences)} sentences, lr {r.lr:g}. Rows moved per table: " + "; ".join(parts)
            + f". The sentences use {len(r.occurred['word'])} distinct tokens, {len(r.occurred['position'])} "
              f"positions and {len(r.occurred['segment'])} segment(s); every row that moved is one of them unless "
              f"weight decay is on. All {len(r.trainable)} embedding parameters are trainable by default.")


def caption_finetune_positions(r) -> str:
    last = max(r.occurred["position"])
    return (f"Change of each of the first position rows. With Adam and no weight decay, positions 0-{last} (the "
            f"longest sentence) move and every later row stays exactly equal (change 0); AdamW's decay nudges every "
            f"row; freezing the word table does not stop the position table from training.")


def caption_drift(r) -> str:
    parts = [f"{t.table}: {t.rows_changed} of {t.shape[0]} rows moved, a moved row by {t.median_row_change:.2g} of "
             f"its norm (median), the whole tensor by {t.relative_change:.2g}" for t in r.tables]
    word = next((t for t in r.tables if t.table == "word" and t.top), None)
    top = f" Most-changed tokens (relative to their norm): {', '.join(x['label'] for x in word.top[:5])}." \
        if word else ""
    head = f"From {r.model_a} to {r.model_b}, per tensor: "
    return head + "; ".join(parts) + "." + top
