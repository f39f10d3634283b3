"""BERT's input embedding layer: the reference computation.

    output = Dropout(LayerNorm(word[input_ids] + segment[token_type_ids] + position[position_ids]))

Everything else in bertembed (the fast kernels, the explanations, the torch-free path of the command line) is tested
against this file. Attribute names are Hugging Face's, so `state_dict()`s move between the two untouched.

Dimension letters: B batch, L length, H hidden, V vocabulary, P positions, T token types (segments).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bertembed.config import EmbeddingConfig
from bertembed.validation import (
    check_id_ranges,
    check_inputs,
    check_norm_dtypes,
    check_table_shapes,
    offset,
    offset_given,
    summed_dtype,
    table_rows,
)


def sinusoidal_table(positions: int, hidden: int) -> torch.Tensor:
    """The fixed table of "Attention Is All You Need": [P, H] float32, sin on even columns, cos on odd ones."""
    from bertembed.numpy_layer import sinusoidal_table_np  # one formula, shared with the torch-free paths

    return torch.from_numpy(sinusoidal_table_np(positions, hidden)).float()


class SinusoidalPositions(nn.Module):
    """A position table that is computed, not learned: `weight` is a buffer, so no optimizer ever sees it."""

    def __init__(self, positions: int, hidden: int) -> None:
        super().__init__()
        self.register_buffer("weight", sinusoidal_table(positions, hidden), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(position_ids, self.weight)


@dataclass
class Decomposition:
    """The named parts of one forward pass (no dropout). Shapes: [B, L, H] for vectors, [B, L] for statistics."""

    word: torch.Tensor
    position: torch.Tensor  # zeros when the config has position_embedding_type="none"
    segment: torch.Tensor
    sum: torch.Tensor  # (word + segment) + position, in the order the layer adds them
    mean: torch.Tensor  # LayerNorm's mean over H, per token
    std: torch.Tensor  # sqrt(biased variance + eps), per token: what LayerNorm divides by
    output: torch.Tensor  # LayerNorm(sum): the layer's output in eval mode


def checked_backend(backend: str) -> str:
    """Who computes forward: "reference" (this file), or the fused kernels of `bertembed.fast`: "cpu" (numba),
    "triton", "auto" (the kernel for the device; this file when it cannot run, with a logged reason). Raises
    ValueError for any other name."""
    if backend == "reference":
        return backend
    from bertembed.fast import check_backend  # (the reference layer needs neither numba nor triton)

    return check_backend(backend)


def _summed(word: torch.Tensor, segment: torch.Tensor, position: torch.Tensor | None) -> torch.Tensor:
    """(word + segment) + position: the same operations in the same order as transformers, so float32 results match
    bit for bit."""
    total = word + segment
    return total if position is None else total + position


class BertEmbeddings(nn.Module):
    """Word, position and segment tables, summed and layer-normalised: transformers' `BertEmbeddings`, exactly."""

    def __init__(self, config: EmbeddingConfig | None = None, backend: str = "reference") -> None:
        super().__init__()
        self.config = config = config or EmbeddingConfig()
        self.backend = checked_backend(backend)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings: nn.Module | None = {
            "absolute": lambda: nn.Embedding(config.max_position_embeddings, config.hidden_size),
            "sinusoidal": lambda: SinusoidalPositions(config.max_position_embeddings, config.hidden_size),
            "none": lambda: None,
        }[config.position_embedding_type]()
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        # "LayerNorm", not "layer_norm": the name comes from the TensorFlow checkpoints and every state dict keeps it.
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        # Default ids live in buffers, sliced per call instead of allocated; non-persistent, so never saved.
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings)[None], persistent=False)
        self.register_buffer("token_type_ids", torch.zeros_like(self.position_ids), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """BERT's initialisation: tables ~ N(0, initializer_range), the [PAD] row zero, LayerNorm the identity; and the
        default-id buffers refilled (0, 1, 2, ... and zeros), which a layer materialised from the meta device by
        `to_empty()` holds as uninitialised memory."""
        for table in (self.word_embeddings, self.position_embeddings, self.token_type_embeddings):
            if isinstance(table, nn.Embedding):
                nn.init.normal_(table.weight, std=self.config.initializer_range)
        with torch.no_grad():
            self.word_embeddings.weight[self.config.pad_token_id].zero_()
            self.position_ids.copy_(torch.arange(self.position_ids.shape[-1])[None])
            self.token_type_ids.zero_()
        self.LayerNorm.reset_parameters()

    def _tables(self) -> tuple[torch.Tensor | None, ...]:
        """(word [V, H], segment [T, H], position [P, H] or None, LayerNorm weight [H], bias [H]) as they are now."""
        positions, norm = self.position_embeddings, self.LayerNorm
        return (self.word_embeddings.weight, self.token_type_embeddings.weight,
                None if positions is None else positions.weight, norm.weight, norm.bias)

    def _checked_ids(self, input_ids, token_type_ids, position_ids, inputs_embeds, past_key_values_length):
        """Check the inputs' shapes and dtypes against the tables as they are now (ValueErrors that name the bad value
        and the fix) and return (token_type_ids, position_ids), the missing ones sliced from the default-id buffers.
        The ids' values are checked where the tables are read (`_rows`; the fused kernels report any they skip)."""
        tables = self._tables()
        check_table_shapes(tables)
        _, length = check_inputs(self.config, input_ids, token_type_ids, position_ids, inputs_embeds,
                                 past_key_values_length, check_ranges=False, rows=table_rows(tables))
        check_norm_dtypes(summed_dtype(tables[0] if inputs_embeds is None else inputs_embeds, *tables[1:3]),
                          tables[3], tables[4])
        if position_ids is None:
            position_ids = self._default_ids("position_ids", offset(past_key_values_length), length)
        if token_type_ids is None:
            token_type_ids = self._default_ids("token_type_ids", 0, length)
        return token_type_ids, position_ids

    def _rows(self, input_ids, token_type_ids, position_ids, inputs_embeds):
        """The word, segment and position rows [B, L, H] of checked, explicit ids (position None: no position table),
        after a ValueError for any id outside its table."""
        check_id_ranges(input_ids, token_type_ids, position_ids, table_rows(self._tables()))
        word = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        segment = self.token_type_embeddings(token_type_ids.expand(word.shape[:2]))  # (any shape that broadcasts)
        position = None if self.position_embeddings is None else self.position_embeddings(position_ids)
        return word, segment, position

    def _default_ids(self, name: str, start: int, length: int) -> torch.Tensor:
        """[1, length] of the default-id buffer `name` from `start`, as transformers slices it; computed where the
        buffer is too short (a position table extended past `max_position_embeddings`, whose buffers were not)."""
        buffer = getattr(self, name)
        if start + length <= buffer.shape[-1]:
            return buffer[:, start:start + length]
        ids = torch.arange(start, start + length, device=buffer.device)[None]
        return ids if name == "position_ids" else torch.zeros_like(ids)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values_length: int | None = None,
        cache_length: int | None = None,
    ) -> torch.Tensor:
        """Embed a batch of token ids.

        Args:
            input_ids: [B, L] integer ids into the word table; or pass `inputs_embeds` [B, L, H] instead.
            token_type_ids: [B, L] segment ids (0 for A, 1 for B), or any shape that broadcasts to it ([1, L]: shared by
                the batch); zeros when omitted.
            position_ids: [B, L], or any shape that broadcasts to it ([1, L], [L]); `arange(L) +
                past_key_values_length` when omitted, up to the position table's rows.
            past_key_values_length, cache_length: offset of the first position, for decoding after a cache; one
                number under transformers 4's name and 5's (both given and different: ValueError). 0 by default.
        Returns:
            [B, L, H]: LayerNorm of the summed rows, with dropout while the dropout module is in training mode.
        """
        token_type_ids, position_ids = self._checked_ids(input_ids, token_type_ids, position_ids, inputs_embeds,
                                                         offset_given(past_key_values_length, cache_length))
        if self.backend != "reference":  # the fused kernel, tested against the lines below; None: not for these inputs
            import bertembed.fast  # (the reference layer needs neither numba nor triton)

            fused = bertembed.fast.run(self, input_ids, token_type_ids, position_ids, inputs_embeds)
            if fused is not None:
                return fused
        word, segment, position = self._rows(input_ids, token_type_ids, position_ids, inputs_embeds)
        return self.dropout(self.LayerNorm(_summed(word, segment, position)))

    def decompose(
        self,
        input_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values_length: int | None = None,
        cache_length: int | None = None,
    ) -> Decomposition:
        """The named parts of `forward` for the same arguments (dropout is never applied).

        `output` equals `forward(...)` in eval mode exactly, and `(sum - mean) / std * LayerNorm.weight +
        LayerNorm.bias` recomputes it by hand to float32 rounding.
        """
        token_type_ids, position_ids = self._checked_ids(input_ids, token_type_ids, position_ids, inputs_embeds,
                                                         offset_given(past_key_values_length, cache_length))
        word, segment, position = self._rows(input_ids, token_type_ids, position_ids, inputs_embeds)
        total = _summed(word, segment, position)
        var, mean = torch.var_mean(total, dim=-1, unbiased=False)
        return Decomposition(
            word=word, position=torch.zeros_like(word) if position is None else position.expand_as(word),
            segment=segment, sum=total, mean=mean, std=torch.sqrt(var + self.config.layer_norm_eps),
            output=self.LayerNorm(total),
        )

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | Path | None = None, *, revision: str | None = None, local_files_only: bool = False,
        backend: str = "reference",
    ) -> BertEmbeddings:
        """Load the embedding tables of a BERT checkpoint.

        `name_or_path`: a hub id ("bert-base-uncased"), a local folder, a single weights file, or None for the
        bundled default (`bertembed.DEFAULT_MODEL`). Only the five embedding tensors are read.
        `backend`: which kernels run forward, as in `BertEmbeddings(config, backend=...)`.
        The layer comes back in eval mode (no dropout), as transformers' `from_pretrained` models do; call `.train()`
        to fine-tune it.
        """
        from bertembed.checkpoint import load_checkpoint

        checkpoint = load_checkpoint(name_or_path, revision=revision, local_files_only=local_files_only)
        layer = cls(checkpoint.config, backend=backend)
        layer.load_state_dict(checkpoint.tensors)
        layer.source = checkpoint.source
        return layer.eval()

    def load_pretrained_weights(self, name_or_path: str | Path | None = None, **kwargs) -> None:
        """Replace this layer's weights with a checkpoint's; on any error the layer is left as it was."""
        from bertembed.checkpoint import load_checkpoint

        checkpoint = load_checkpoint(name_or_path, **kwargs)
        if checkpoint.config != self.config:
            raise ValueError(f"checkpoint {checkpoint.source.name} has config {checkpoint.config}, this layer has "
                             f"{self.config}; build a new layer with BertEmbeddings.from_pretrained instead")
        self.load_state_dict(checkpoint.tensors)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As `nn.Module.load_state_dict`, but every key, kind and shape is checked before anything is copied: torch
        copies key by key, so a tensor it cannot copy (sparse, quantized, on the meta device, not floating point)
        after others would leave the layer half loaded."""
        from bertembed.tensor_files import tensor_problem

        def kind_problem(value) -> str | None:  # (meta tensors are fine to assign, but copy no values)
            if not isinstance(value, torch.Tensor):
                return f"a {type(value).__name__}, not a torch.Tensor"
            return tensor_problem(value, meta_ok=assign)

        own = self.state_dict()
        kinds = {k: kind_problem(v) for k, v in state_dict.items() if k in own}
        problems = [f"{k} is {problem}" for k, problem in kinds.items() if problem is not None]
        problems += [f"{k}: expected {tuple(own[k].shape)}, got {tuple(v.shape)}" for k, v in state_dict.items()
                     if kinds.get(k) is None and k in own and tuple(v.shape) != tuple(own[k].shape)]
        if strict:
            problems += [f"missing {k}" for k in own if k not in state_dict]
            problems += [f"unexpected {k}" for k in state_dict if k not in own]
        if problems:
            raise ValueError("state dict does not fit this layer (nothing was loaded): " + "; ".join(problems))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write config.json and an embedding-only model.safetensors that both bertembed and transformers read.

        The folder is replaced as a whole, its other files kept (`bertembed.atomic`); a layer that disagrees with its
        config (a table of another size or dtype) raises ValueError before anything is written."""
        from bertembed.checkpoint import save_checkpoint

        return save_checkpoint(self, folder)
