"""The word table as a dictionary of vectors: a token's nearest neighbours, the [PAD] row and the special tokens,
and how a row's norm depends on how common the token is (BERT's WordPiece vocabulary lists whole words roughly by
frequency after its special, unused and single-character entries, so the id is a rough frequency rank there).

Dimension letters: V vocabulary, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bertembed.explain._common import ModelArg, load_layer, repr_html, row_norms, table

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
RANK_START_TOKEN = "the"  # in BERT's vocabulary the frequency-ordered whole words start here (id 1996)


@dataclass
class TokenReport:
    """A token's row and neighbours, the special rows, and norms against vocabulary order."""

    model: str
    token: str
    token_id: int
    token_norm: float
    neighbours: list[dict]  # {"token", "id", "cosine"}, most similar first, the token itself excluded
    special: list[dict]  # {"token", "id", "norm"} for the special tokens present
    pad_is_zero: bool
    median_norm: float
    unused_median_norm: float | None  # the never-seen [unusedN] rows, if the vocabulary has them
    rank_start: int | None  # first id of the frequency-ordered region, None when the order is unknown
    rank_norm_correlation: float | None  # Spearman correlation of id (rank) and norm in that region
    norms: np.ndarray = field(repr=False)  # [V]

    def summary(self) -> dict:
        return {"model": self.model, "token": self.token, "token_id": self.token_id, "token_norm": self.token_norm,
                "nearest": ", ".join(f"{n['token']} ({n['cosine']:.2f})" for n in self.neighbours[:5]),
                "pad_is_zero": self.pad_is_zero, "median_norm": self.median_norm,
                "unused_median_norm": self.unused_median_norm, "rank_start": self.rank_start,
                "rank_norm_correlation": self.rank_norm_correlation}

    def _repr_html_(self) -> str:
        return repr_html(self)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (no ties handling needed for continuous norms and distinct ids)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def nearest(words: np.ndarray, row: int, k: int) -> list[tuple[int, float]]:
    """The k rows of `words` [V, H] with the highest cosine to row `row`, excluding itself: [(id, cosine)]."""
    norms = np.maximum(row_norms(words), 1e-30)
    cos = (words @ words[row]) / (norms * norms[row])
    cos[row] = -np.inf
    top = np.argpartition(-cos, k)[:k]
    top = top[np.argsort(-cos[top], kind="stable")]
    return [(int(i), float(cos[i])) for i in top]


def _token_id(tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        pieces = tokenizer(token, truncation=False, padding=False).tokens[1:-1]
        raise ValueError(f"{token!r} is not an entry of the vocabulary (it tokenizes as {pieces}); "
                         f"pick one entry, e.g. {pieces[0]!r}" if pieces else f"{token!r} is not in the vocabulary")
    return token_id


def analyze_tokens(token: str = "king", model: ModelArg = None, *, k: int = 10) -> TokenReport:
    """Nearest neighbours of `token` (one vocabulary entry, e.g. "king" or "##ing") and the word table's norms."""
    from bertembed.tokenizer import Tokenizer

    if not token.strip():
        raise ValueError('the token is empty; give one vocabulary entry, e.g. "king"')
    if k < 1:
        raise ValueError(f"k={k}: ask for at least 1 neighbour")
    layer = load_layer(model)
    tokenizer = Tokenizer.from_pretrained(layer.source)
    words = table(layer, "word")
    token_id = _token_id(tokenizer, token)
    norms = row_norms(words)
    special = [{"token": t, "id": i, "norm": float(norms[i])} for t in SPECIAL_TOKENS
               if (i := tokenizer.token_to_id(t)) is not None]
    unused = [i for i in range(min(len(norms), 1000)) if tokenizer.backend.id_to_token(i).startswith("[unused")]
    start = tokenizer.token_to_id(RANK_START_TOKEN)
    region = np.arange(start, len(norms)) if start is not None and start < len(norms) - 2 else None
    pad = layer.config.pad_token_id
    return TokenReport(
        model=layer.source.name, token=token, token_id=token_id, token_norm=float(norms[token_id]),
        neighbours=[{"token": tokenizer.backend.id_to_token(i), "id": i, "cosine": c}
                    for i, c in nearest(words, token_id, min(k, len(norms) - 1))],
        special=special, pad_is_zero=bool(np.all(words[pad] == 0)), median_norm=float(np.median(norms)),
        unused_median_norm=float(np.median(norms[unused])) if unused else None,
        rank_start=None if region is None else int(start),
        rank_norm_correlation=None if region is None else spearman(region, norms[region]), norms=norms)
