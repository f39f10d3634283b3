"""The input embedding layer of BERT and its family: the reference computation.

    output = Dropout(LayerNorm(word[input_ids] + segment[token_type_ids] + position[position_ids]))

The family's members differ in a few facts the config holds (`EmbeddingConfig`, docs/family.md). Everything else in
bertembed is tested against this file, and this file against each member's transformers module. Attribute names are
Hugging Face's BERT names.

Dimension letters: B batch, L length, H hidden, E table width (H unless factorised), V vocabulary, P positions,
T token types (segments).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bertembed.checkpoint import Pretrained
from bertembed.config import EmbeddingConfig
from bertembed.functional import default_positions
from bertembed.validation import (
    ID_CHECKS,
    check_dropout,
    check_id_ranges,
    check_inputs,
    check_norm_dtypes,
    check_option,
    check_padding_idx,
    check_table_shapes,
    offset,
    offset_given,
    summed_dtype,
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


class Float32LayerNorm(nn.Module):
    """DeBERTa v1's LayerNorm: normalised in float32 whatever the input's dtype, cast back, then scaled and shifted."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width)), eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - mean) / torch.sqrt(variance + self.eps)).to(dtype) + self.bias


@dataclass
class Decomposition:
    """The named parts of one forward pass (no dropout). Shapes: [B, L, W] for vectors (W: `config.output_width`; where
    DeBERTa projects E -> H before its norm, each part is shown projected), [B, L] for statistics."""

    word: torch.Tensor
    position: torch.Tensor  # zeros where the layer has no position table
    segment: torch.Tensor  # zeros where it has no segment table
    sum: torch.Tensor  # in the order the layer adds them (projected to H first where DeBERTa projects)
    mean: torch.Tensor  # LayerNorm's mean over H, per token
    std: torch.Tensor  # sqrt(biased variance + eps), per token: what LayerNorm divides by
    output: torch.Tensor  # LayerNorm(sum): the layer's output in eval mode


def checked_backend(backend: str) -> str:
    """Who computes forward: "reference" (this file), or `bertembed.fast`'s kernels ("cpu", "triton", "auto");
    ValueError for any other name."""
    if backend == "reference":
        return backend
    from bertembed.fast import check_backend  # (the reference layer imports no kernel code until asked)

    return check_backend(backend)


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """DeBERTa's multiplication by the attention mask ([B, L], or [B, 1, 1, L] as its encoder passes it)."""
    if mask.dim() != x.dim():
        mask = (mask.squeeze(1).squeeze(1) if mask.dim() == 4 else mask).unsqueeze(2)
    return x * mask.to(x.dtype)


SUBMODULES = ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm", "dropout", "projection")


class BertEmbeddings(Pretrained, nn.Module):
    """Word, position and segment tables, summed and layer-normalised: the embeddings module of BERT or of the family
    member `config.model_type` names, exactly as transformers computes it. `from_pretrained` and `save_pretrained`
    come from `bertembed.checkpoint.Pretrained`."""

    def __init__(self, config: EmbeddingConfig | None = None, backend: str = "reference", *, id_checks: str = "host",
                 deterministic: bool = False) -> None:
        super().__init__()
        self.config = c = config or EmbeddingConfig()
        self.backend, self.id_checks, self.deterministic = backend, id_checks, deterministic
        width = c.table_width
        self.word_embeddings = nn.Embedding(c.vocab_size, width, padding_idx=c.pad_token_id)
        self.position_embeddings: nn.Module | None = {
            "absolute": lambda: nn.Embedding(c.max_position_embeddings, width,
                                             padding_idx=c.pad_token_id if c.positions_from_padding else None),
            "sinusoidal": lambda: SinusoidalPositions(c.max_position_embeddings, width),
            "none": lambda: None,
        }[c.position_embedding_type]()
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, width) if c.type_vocab_size else None
        # E -> H: applied before the norm (DeBERTa), or kept for `project` (ALBERT and ELECTRA apply it after)
        self.projection = None if c.projection == "none" else nn.Linear(width, c.hidden_size,
                                                                        bias=c.projection == "output")
        # "LayerNorm", not "layer_norm": the name comes from the TensorFlow checkpoints and every state dict keeps it.
        self.LayerNorm = Float32LayerNorm(c.output_width, c.layer_norm_eps) if c.norm_in_float32 else \
            nn.LayerNorm(c.output_width, eps=c.layer_norm_eps, bias=c.norm_bias)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)
        # Default ids live in buffers, sliced per call instead of allocated; non-persistent, so never saved.
        self.register_buffer("position_ids", torch.arange(c.max_position_embeddings)[None], persistent=False)
        self.register_buffer("token_type_ids", torch.zeros_like(self.position_ids), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """BERT's initialisation: tables ~ N(0, initializer_range), padding rows zero, LayerNorm the identity; and the
        default-id buffers refilled (0, 1, 2, ... and zeros), which a layer materialised from the meta device by
        `to_empty()` holds as uninitialised memory."""
        for module in (self.word_embeddings, self.position_embeddings, self.token_type_embeddings, self.projection):
            if isinstance(module, (nn.Embedding, nn.Linear)):
                nn.init.normal_(module.weight, std=self.config.initializer_range)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
                if getattr(module, "padding_idx", None) is not None:
                    nn.init.zeros_(module.weight[module.padding_idx])
        self.reset_buffers()
        self.LayerNorm.reset_parameters()

    def reset_buffers(self) -> None:
        """The buffers no state dict holds, refilled: the default ids and a computed position table."""
        with torch.no_grad():
            for name, buffer in self._buffers.items():  # (a patched layer has the buffers its member has, or none)
                if name == "position_ids":
                    buffer.copy_(torch.arange(buffer.shape[-1])[None])
                elif name == "token_type_ids":
                    buffer.zero_()
            if isinstance(self.position_embeddings, SinusoidalPositions):
                table = self.position_embeddings.weight
                table.copy_(sinusoidal_table(*table.shape))

    @property
    def backend(self) -> str:
        """Who computes forward (`checked_backend`); checked when set, so a bad name fails there, on every backend."""
        return self.__dict__["backend"]

    @backend.setter
    def backend(self, name: str) -> None:
        self.__dict__["backend"] = checked_backend(name)

    @property
    def id_checks(self) -> str:
        """Where the Triton kernels' ids are checked: "host" (before any kernel, one wait for the device) or "device"
        (no wait; a bad id gives a NaN row). The CPU kernel checks each id as it reads it. Checked when set."""
        return self.__dict__.get("id_checks", "host")

    @id_checks.setter
    def id_checks(self, value: str) -> None:
        self.__dict__["id_checks"] = check_option("id_checks", value, ID_CHECKS)

    @property
    def deterministic(self) -> bool:
        """Bitwise-repeatable gradients from the Triton backward (a fixed summation order, not atomics); the CPU
        backward always is. Checked when set."""
        return self.__dict__.get("deterministic", False)

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        self.__dict__["deterministic"] = check_option("deterministic", value, (False, True))

    _stored_as: dict[str, str] = {}  # BERT's name -> the one a submodule is stored under, where they differ

    def submodules(self) -> dict[str, nn.Module | None]:
        """The submodules under BERT's names (`SUBMODULES`; None: the member has none), as they are now: one dict
        read, where each attribute access of an nn.Module costs a `__getattr__` (a patched ModernBERT keeps its own
        names, `_stored_as`)."""
        modules, stored = self._modules, self._stored_as
        return {name: modules.get(stored.get(name, name)) for name in SUBMODULES}

    def tables(self, modules=None) -> tuple[torch.Tensor | None, ...]:
        """(word [V, E], segment [T, E] or None, position [P, E] or None, LayerNorm weight, bias or None) as they are
        now."""
        m = modules or self.submodules()
        segments, positions, norm = m["token_type_embeddings"], m["position_embeddings"], m["LayerNorm"]
        return (m["word_embeddings"].weight, None if segments is None else segments.weight,
                None if positions is None else positions.weight, norm.weight, norm.bias)

    def _checked_ids(self, modules, tables, input_ids, token_type_ids, position_ids, inputs_embeds,
                     past_key_values_length, cache_length, mask, attention_mask, cu_seqlens):
        """`forward`'s arguments checked against `modules` and `tables` (ids' values: where the tables are read) as
        (input_ids, inputs_embeds, token_type_ids, position_ids, mask, padding: the word and position padding rows,
        rows: the tables' rows, `table_rows`)."""
        c = self.config
        if mask is not None and attention_mask is not None:
            raise ValueError("mask and attention_mask name the same mask (DeBERTa's layer takes mask=); pass one")
        mask = attention_mask if mask is None else mask
        if mask is not None and not c.mask_output:
            raise ValueError(f"a mask was given, but the {c.model_type} layer does not use one (only "
                             f"DeBERTa's multiplies its output by the mask); leave it out")
        past = offset_given(past_key_values_length, cache_length)
        rows = check_table_shapes(tables, c.output_width)
        word, segments, positions = tables[:3]
        # (a padding_idx set after construction: F.embedding only asserts, the kernels would read it)
        padding = (check_padding_idx(getattr(modules["word_embeddings"], "padding_idx", None), rows[0]),
                   None if positions is None else
                   check_padding_idx(getattr(modules["position_embeddings"], "padding_idx", None), rows[2]))
        if cu_seqlens is not None:
            input_ids, inputs_embeds, position_ids = self._packed(input_ids, inputs_embeds, position_ids, cu_seqlens,
                                                                  past)
        _, length, past = check_inputs(input_ids, token_type_ids, position_ids, inputs_embeds, past, rows,
                                       c.table_width, c.first_position, c.positions_from_padding, check_ranges=False)
        if modules["projection"] is None:
            check_norm_dtypes(summed_dtype(word if inputs_embeds is None else inputs_embeds, segments, positions),
                              tables[3], tables[4])
        if position_ids is None and positions is not None:
            position_ids = self._default_positions(input_ids, inputs_embeds, past, length)
        if token_type_ids is None and segments is not None:
            token_type_ids = self._default_ids("token_type_ids", 0, length)
        return input_ids, inputs_embeds, token_type_ids, position_ids, mask, padding, rows

    def _packed(self, input_ids, inputs_embeds, position_ids, cu_seqlens, past):
        """Flattened documents: ids [1, N] or [N], `cu_seqlens` [D + 1] their boundaries; positions restart per one."""
        if position_ids is not None or offset(past):
            raise ValueError("cu_seqlens makes the position ids: pass neither position_ids nor a cache offset with it")
        if self.position_embeddings is None:
            raise ValueError(f"cu_seqlens gives positions, but this {self.config.model_type} layer has no position "
                             f"table (its positions enter in attention); leave cu_seqlens out")
        if input_ids is not None and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
            input_ids = input_ids[None]
        given = input_ids if input_ids is not None else inputs_embeds
        tokens = given.shape[-1 if input_ids is not None else -2] if isinstance(given, torch.Tensor) else 0
        bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        integral = all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in bounds)  # (numpy's too)
        if not isinstance(given, torch.Tensor) or given.shape[0] != 1 or not integral or not bounds or \
                bounds[0] != 0 or bounds[-1] != tokens or bounds != sorted(bounds):
            raise ValueError(f"cu_seqlens={bounds[:8]} must be integers rising from 0 to the number of packed tokens "
                             f"({tokens}), with the documents flattened into one row: input_ids [1, N] or [N]")
        lengths = torch.diff(torch.tensor(bounds))
        starts = torch.repeat_interleave(torch.tensor(bounds[:-1]), lengths)
        positions = (torch.arange(tokens) - starts + self.config.first_position)[None].to(given.device)
        return input_ids, inputs_embeds, positions

    def _rows(self, rows, input_ids, token_type_ids, position_ids, inputs_embeds):
        """The word [B, L, E], segment and position rows (None: no such table), after checking the ids' values against
        the tables' `rows` (`table_rows`)."""
        check_id_ranges(input_ids, token_type_ids, position_ids, rows)
        word = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        segments, positions = self.token_type_embeddings, self.position_embeddings
        segment = None if segments is None else segments(token_type_ids.expand(word.shape[:2]))  # (broadcasts)
        position = None if positions is None else positions(position_ids)
        return word, segment, position

    def _default_positions(self, input_ids, inputs_embeds, past: int, length: int) -> torch.Tensor:
        """The member's default position ids (`functional.default_positions`), from the buffer where they count from 0
        (BERT)."""
        if not self.config.positions_from_padding:
            return self._default_ids("position_ids", past, length)
        device = (inputs_embeds if input_ids is None else input_ids).device
        return default_positions(length, past, input_ids, self.config.pad_token_id, device)

    def _default_ids(self, name: str, start: int, length: int) -> torch.Tensor:
        """[1, length] of the default-id buffer `name` from `start`, as transformers slices it; computed where the
        buffer is too short (an extended position table) or missing (a patched layer has only its member's)."""
        buffer = self._buffers.get(name)
        if buffer is not None and start + length <= buffer.shape[-1]:
            return buffer.narrow(1, start, length)
        ids = default_positions(length, start, device=self.tables()[0].device)
        return ids if name == "position_ids" else torch.zeros_like(ids)

    def _normalised(self, word, segment, position) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sum in the member's order, projected to H where it projects first; LayerNorm of it)."""
        first, second = (position, segment) if self.config.sum_order == "position_first" else (segment, position)
        # the member's own operations in its order (a None skipped), so float32 results match bit for bit
        total = word if first is None else word + first
        total = total if second is None else total + second
        if self.config.projection == "before_norm":
            total = self.projection(total)
        return total, self.LayerNorm(total)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values_length: int | None = None,
        cache_length: int | None = None,
        mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embed a batch of token ids.

        Args:
            input_ids: [B, L] integer ids into the word table; or pass `inputs_embeds` [B, L, E] instead.
            token_type_ids: [B, L] segment ids (0 for A, 1 for B), or any shape that broadcasts to it ([1, L]: shared by
                the batch); zeros when omitted. Ignored where the member has no segment table, as DeBERTa's layer
                ignores them.
            position_ids: [B, L], or any shape that broadcasts to it; when omitted, the member's own: `arange(L) +
                offset` (BERT), or counted from the padding id (RoBERTa, MPNet), up to the position table's rows.
            past_key_values_length, cache_length: offset of the first position, for decoding after a cache; one
                number under transformers 4's name and 5's (both given and different: ValueError). 0 by default.
            mask, attention_mask: [B, L] (one name or the other): DeBERTa multiplies its output by it.
            cu_seqlens: [D + 1] boundaries of D documents packed into one row (input_ids [1, N] or [N], as
                transformers' DataCollatorWithFlattening gives them): positions restart per document.
        Returns:
            [B, L, W]: LayerNorm of the summed rows, with dropout while the dropout module is in training mode; W is
            E, or H where the member projects before its norm (`config.output_width`).
        """
        modules = self.submodules()
        tables = self.tables(modules)
        input_ids, inputs_embeds, token_type_ids, position_ids, mask, padding, rows = self._checked_ids(
            modules, tables, input_ids, token_type_ids, position_ids, inputs_embeds, past_key_values_length,
            cache_length, mask, attention_mask, cu_seqlens)
        check_dropout(getattr(modules["dropout"], "p", 0.0), "layer.dropout.p")  # (every backend, as nn.Dropout runs)
        out = None
        if self.backend != "reference":  # the fused kernel, tested against the lines below; None: not for these inputs
            import bertembed.fast  # (no `from` import: that costs a call into importlib every time)

            out = bertembed.fast.run(self, modules, tables, padding, input_ids, token_type_ids, position_ids,
                                     inputs_embeds)
        if out is None:
            _, out = self._normalised(*self._rows(rows, input_ids, token_type_ids, position_ids, inputs_embeds))
            out = self.dropout(out if mask is None else _masked(out, mask))
        elif mask is not None:  # (after the kernel's dropout: the same, for a mask of zeros and ones)
            out = _masked(out, mask)
        return out

    def extend_positions(self, n: int, method: str = "copy") -> BertEmbeddings:
        """Take `n` positions, the table grown by `method` in place (`bertembed.surgery`); returns the layer."""
        from bertembed import surgery

        return surgery.extend_positions(self, n, method)

    def resize_vocab(self, n: int, *, pad_to_multiple_of: int | None = None, init: str = "mean") -> BertEmbeddings:
        """`n` word rows, as transformers' `resize_token_embeddings` gives them (`bertembed.surgery`), in place."""
        from bertembed import surgery

        return surgery.resize_vocab(self, n, pad_to_multiple_of=pad_to_multiple_of, init=init)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """ALBERT's and ELECTRA's Linear E -> H, which their encoder applies to this layer's output (after dropout):
        `layer.project(layer(ids))` is what their first attention layer takes."""
        if self.config.projection != "output":
            raise ValueError(f"this {self.config.model_type} layer has no projection after it (only ALBERT's and "
                             f"ELECTRA's with E != H); its output is already the encoder's input")
        if self.projection is None:
            raise ValueError("this layer was patched into a model, whose encoder holds the projection (ALBERT's "
                             "encoder.embedding_hidden_mapping_in): the model applies it")
        return self.projection(x)

    def decompose(
        self,
        input_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values_length: int | None = None,
        cache_length: int | None = None,
        mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> Decomposition:
        """The named parts of `forward` for the same arguments (dropout is never applied).

        `output` equals `forward(...)` in eval mode exactly, and `(sum - mean) / std * LayerNorm.weight +
        LayerNorm.bias` recomputes it by hand to float32 rounding.
        """
        modules = self.submodules()
        input_ids, inputs_embeds, token_type_ids, position_ids, mask, _, rows = self._checked_ids(
            modules, self.tables(modules), input_ids, token_type_ids, position_ids, inputs_embeds,
            past_key_values_length, cache_length, mask, attention_mask, cu_seqlens)
        word, segment, position = self._rows(rows, input_ids, token_type_ids, position_ids, inputs_embeds)
        total, output = self._normalised(word, segment, position)
        var, mean = torch.var_mean(total, dim=-1, unbiased=False)
        zeros = torch.zeros_like(word)
        parts = [word, zeros if position is None else position.expand_as(word), zeros if segment is None else segment]
        if self.config.projection == "before_norm":  # the parts as they enter the norm (the projection is linear)
            parts = [self.projection(part) for part in parts]
        return Decomposition(
            word=parts[0], position=parts[1], segment=parts[2], sum=total, mean=mean,
            std=torch.sqrt(var + self.config.layer_norm_eps),
            output=output if mask is None else _masked(output, mask),
        )

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

Embeddings = BertEmbeddings  # the same layer, under a name that fits every member of the family
