"""Which model family a checkpoint is: bertembed reads BERT's, and refuses every other (for now).

RoBERTa, XLM-RoBERTa, CamemBERT, DistilBERT, ALBERT, ELECTRA, DeBERTa and MPNet store their embedding tensors under
BERT's very names, so a name match alone would load them and then compute something else: RoBERTa counts positions
from its padding id (row 0 and its padding row 1 are never used), DistilBERT and MPNet add no segment vector, ALBERT
and ELECTRA project the sum afterwards. The family is told from config.json (`model_type`, `architectures`) and from
the tensors themselves (names only other families use, a padding row in the position table), so that a checkpoint
whose config.json was edited, or that has none, is refused too. Nothing here imports torch.

What counts as BERT: config.json's `model_type` is "bert" or absent, its `architectures` (if listed) are all BERT
classes; no tensor name belongs to another family's layout; the five tensors sit under BERT's names with the config's
shapes, a token type table included; and the position table has no padding row. A checkpoint without config.json is
judged on its tensors alone. (An ELECTRA whose embedding and hidden sizes are equal, stripped of its config, passes:
its embedding layer computes exactly BERT's.)
"""

from __future__ import annotations

from collections.abc import Iterable

from bertembed.config import SUPPORTED

# parts of tensor names that only other families use, and the family each one means
FOREIGN_NAME_PARTS = {
    "roberta": "RoBERTa", "xlm_roberta": "XLM-RoBERTa", "camembert": "CamemBERT", "distilbert": "DistilBERT",
    "q_lin": "DistilBERT", "albert": "ALBERT", "embedding_hidden_mapping_in": "ALBERT", "electra": "ELECTRA",
    "embeddings_project": "ELECTRA", "deberta": "DeBERTa", "rel_embeddings": "DeBERTa", "mpnet": "MPNet",
    "relative_attention_bias": "MPNet", "tok_embeddings": "ModernBERT", "emb_ln": "NomicBERT",
}


def check_key_family(keys: Iterable[str], where: str) -> None:
    """ValueError if any tensor name belongs to another family's layout (`FOREIGN_NAME_PARTS`)."""
    for key in keys:
        for part in key.split("."):
            if part in FOREIGN_NAME_PARTS:
                raise ValueError(f"{where} holds {key!r}, a tensor of {FOREIGN_NAME_PARTS[part]} checkpoints: "
                                 f"{SUPPORTED}")


def padding_row(positions) -> int | None:
    """The index of an all-zero row of a [P, H] position table (numpy or torch) that has nonzero rows after it.

    BERT's position table has no padding row: every position is a learned vector. RoBERTa-style tables keep the row
    at the padding id zero (nn.Embedding's padding_idx) and count positions from the row after it, so a zero row
    in front of used ones means that layout. Zero rows only at the end (a table extended with zeros) or throughout
    mark no layout, and are left alone.
    """
    zero = positions == 0
    rows = (zero.all(1) if hasattr(zero, "numpy") else zero.all(axis=1)).tolist()
    first = rows.index(True) if True in rows else None
    return first if first is not None and not all(rows[first:]) else None
