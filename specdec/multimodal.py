"""Vision-language models: prefill-only inputs, their layout, mRoPE positions, and prefixes.

A vision-language call carries *prefill-only inputs*: tensors that describe the prompt (pixel
values, image grid sizes, per-token type ids, ...) and that each model must see in its first
forward and never again. This module decides, per model, what that first forward receives and
which position ids every forward uses; :class:`~specdec.state.ModelState` only asks.

How the inputs flow through one ``generate()`` call::

    generate(input_ids [B, L] left-padded, pixel_values=..., image_grid_thw=..., token_type_ids=...)
      |  check_call(): text-only target? placeholders without images? images without placeholders?
      v
    PrefillSpec: the prompt rows [B, P] (left-aligned) + the inputs that describe them,
      |          per-token inputs moved to that row layout (zero past each row's end)
      |-- for_model(target)     -> PrefillInputs(everything)  + Positions (mRoPE if it has one)
      |-- for_model(VLM draft)  -> PrefillInputs(the subset its forward declares) + Positions
      '-- for_model(text draft) -> PrefillInputs({})           + TokenPositions
    ModelState.forward(), every forward:  position_ids = positions(token index)  [B, W] | [3, B, W]
                          first forward:  kwargs |= prefill_inputs.for_chunk(index, real)

Invariants:

* Prefill-only inputs reach a model in its first forward only (``ModelState.is_first_iteration``);
  a per-token input is laid out like the ``input_ids`` chunk of that forward (drafts and padding
  are text, 0). Every first forward that carries them starts at cache slot 0, so the chunk is
  also "from the start of the sequence", which Gemma 3's bidirectional image mask needs.
* A position id is a pure function of (row, token index in the row): re-feeding, shifting rows
  inside the cache, or dropping finished rows never changes it. Text models use the index
  itself. mRoPE models (Qwen2-VL and kin) use the 3-D positions of the prompt, computed once by
  the model's own ``get_rope_index`` from the prompt and its image grids, and for every later
  token the last prompt position + 1, + 2, ... on each axis (as ``generate()`` extends them).
* Nothing here mutates the user's model. Qwen2-VL's forward caches ``rope_deltas`` on
  ``model.model`` whenever it computes positions itself; we always pass ``position_ids``, and
  ``get_rope_index`` is a pure function, so that attribute is never touched.
* A forward that carries image features must not receive a draft equal to an image placeholder
  id: the model would count it as an image slot. :meth:`PrefillInputs.admissible` cuts such a
  block before the placeholder (offering fewer drafts is always lossless).
* A :class:`Prefix` is immutable: it holds the target's cache after a prefill together with what
  that prefill derived (the mRoPE positions), and each continuation works on a copy of its cache.
  Continuing from it is a first iteration that is not a prefill from position 0: the target gets
  no prefill-only input and recomputes nothing; assistants, which own no prefix cache, prefill
  the whole prompt once with the prefix's inputs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation.utils import MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL

#: inputs shaped like ``input_ids [B, L]`` (the list transformers' prepare_inputs_for_generation slices)
PER_TOKEN_INPUTS = ("token_type_ids", "mm_token_type_ids", "moe_mm_token_type_ids")
#: inputs that carry image, video or audio content: the model encodes them in its first forward
MEDIA_INPUTS = frozenset(MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL) | {"pixel_values_videos", "image_embeds"}
#: grid sizes that make an mRoPE model lay images out in 3-D
GRID_INPUTS = ("image_grid_thw", "video_grid_thw")
#: inputs that only make sense with media (an error for a text-only target)
VISION_ONLY_INPUTS = MEDIA_INPUTS | set(GRID_INPUTS) | {"second_per_grid_ts", "mm_token_type_ids"}
#: config attributes naming the placeholder token ids that image/video/audio features replace
PLACEHOLDER_ATTRIBUTES = ("image_token_id", "image_token_index", "video_token_id", "video_token_index",
                          "audio_token_id", "audio_token_index")


def declared_inputs(model) -> set[str]:
    """Names ``model.forward`` declares (``**kwargs`` does not count)."""
    params = inspect.signature(model.forward).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def is_multimodal(model) -> bool:
    """Whether ``model.forward`` takes image, video or audio content."""
    return bool(declared_inputs(model) & MEDIA_INPUTS)


def placeholder_ids(model) -> tuple[int, ...]:
    """Token ids whose embeddings the model replaces with media features (empty for text models)."""
    config = model.config
    ids = {getattr(config, name, None) for name in PLACEHOLDER_ATTRIBUTES}
    return tuple(sorted(int(i) for i in ids if isinstance(i, int)))


def present_inputs(inputs: dict[str, Any]) -> set[str]:
    """The inputs given: not None, and not an empty container (``generate()`` passes its
    pre-encoded ``mm_encoder_outputs`` as ``{}`` for a prompt without media)."""
    return {k for k, v in inputs.items() if v is not None and not (isinstance(v, (dict, list, tuple)) and not v)}


# -- validation: every check runs before any forward ----------------------------------------------
def check_call(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict[str, Any]) -> None:
    """Refuse image inputs a target cannot use and prompts whose placeholders and media disagree.

    ``input_ids [B, L]`` and ``attention_mask [B, L]`` are the prompt to prefill (left-padded).
    """
    given = present_inputs(model_inputs)
    name = type(target).__name__
    vision = sorted(given & VISION_ONLY_INPUTS)
    if vision and not is_multimodal(target):
        raise ValueError(f"{name} is a text-only model: it cannot take image inputs {vision}. "
                         "Use a vision-language target (e.g. LlavaForConditionalGeneration) or drop them.")
    placeholders = placeholder_ids(target)
    if not placeholders:
        return
    in_prompt = torch.isin(input_ids, torch.tensor(placeholders, device=input_ids.device)) & attention_mask.bool()
    media = sorted(given & MEDIA_INPUTS)
    if bool(in_prompt.any()) and not media:
        found = sorted(set(input_ids[in_prompt].tolist()))
        raise ValueError(f"the prompt holds {int(in_prompt.sum())} image placeholder tokens (ids {found}) but no "
                         f"image inputs were given; pass what the processor returned (e.g. pixel_values) with them")
    if media and not bool(in_prompt.any()):
        raise ValueError(f"image inputs {media} were given but the prompt holds no image placeholder token "
                         f"(ids {list(placeholders)}); build the prompt with the model's processor, which expands them")
    if media and not given & set(GRID_INPUTS) and rope_index_function(target) is not None:
        # generate() encodes the images itself before a custom_generate loop, and drops the grids with the pixels
        raise ValueError(f"{name} lays images out with 3-D (mRoPE) positions, which need image_grid_thw / "
                         f"video_grid_thw, and only {media} were given (model.generate(custom_generate=...) "
                         "encodes the images first and drops the grids): call SpecDecoder(...).generate with what "
                         "the processor returned")
    if given & set(GRID_INPUTS) and rope_index_function(target) is not None:
        if "mm_token_type_ids" in _rope_index_params(target) and "mm_token_type_ids" not in given:
            raise ValueError(f"{name} lays images out with 3-D (mRoPE) positions, which need mm_token_type_ids "
                             "(returned by the processor alongside input_ids)")
    for key in given & set(PER_TOKEN_INPUTS):
        if tuple(model_inputs[key].shape) != tuple(input_ids.shape):
            raise ValueError(f"{key} {tuple(model_inputs[key].shape)} must be shaped like input_ids {tuple(input_ids.shape)}")


def check_assistant(target, assistant) -> None:
    """A vision-language assistant needs a vision-language target (it would draft blind otherwise)."""
    if is_multimodal(assistant) and not is_multimodal(target):
        raise ValueError(f"the draft {type(assistant).__name__} is a vision-language model but the target "
                         f"{type(target).__name__} is text-only; use a text-only draft (or a vision-language target)")


# -- positions ------------------------------------------------------------------------------------
class TokenPositions:
    """Position = the token's index in its row (left padding excluded): every text model's rule."""

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        return index.clamp_min(0)  # [B, W]

    def select_rows(self, rows: torch.Tensor) -> "TokenPositions":
        return self

    def continued(self) -> "TokenPositions":
        return self


class MRopePositions:
    """3-D (temporal, height, width) positions for models with multimodal RoPE.

    ``prompt [3, B, P]``: the positions of each row's prompt tokens (row-layout, from the model's
    ``get_rope_index``); ``lengths [B]``: prompt tokens per row. Token ``i >= lengths[b]`` sits at
    ``prompt[:, b, lengths[b] - 1] + 1 + (i - lengths[b])`` on every axis, i.e. ``i + deltas[:, b]``.
    When the prompt ends with text (as chat templates do) all three deltas equal the model's
    ``rope_deltas``. A prefix (:meth:`continued`) is continued by more of a prompt instead, whose
    text the model's ``get_rope_index`` places after the highest position so far on every axis
    (which differs where the prefix ends in an image).
    """

    def __init__(self, prompt: torch.Tensor, lengths: torch.Tensor, after_highest: bool = False):
        self.prompt, self.lengths, self.after_highest = prompt, lengths.long(), after_highest
        if after_highest:
            valid = torch.arange(prompt.shape[2], device=prompt.device)[None, :] < self.lengths[:, None]  # [B, P]
            last = prompt.masked_fill(~valid[None], torch.iinfo(prompt.dtype).min).amax(dim=(0, 2)).expand(3, -1)
        else:
            last = prompt.gather(2, (self.lengths - 1)[None, :, None].expand(3, -1, 1))[..., 0]  # [3, B]
        self.deltas = last + 1 - self.lengths[None, :]  # [3, B]

    def continued(self) -> "MRopePositions":
        """The positions where this prompt is a prefix that more of a prompt continues."""
        return MRopePositions(self.prompt, self.lengths, after_highest=True)

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        i = index.clamp_min(0)  # [B, W]
        inside = self.prompt.gather(2, i.clamp(max=self.prompt.shape[2] - 1)[None].expand(3, -1, -1))  # [3, B, W]
        after = i[None] + self.deltas[:, :, None]  # [3, B, W]
        return torch.where((i < self.lengths[:, None])[None], inside, after)

    def select_rows(self, rows: torch.Tensor) -> "MRopePositions":
        return MRopePositions(self.prompt[:, rows], self.lengths[rows], self.after_highest)


def rope_index_function(model):
    """The model's own ``get_rope_index`` (on the model or its inner ``model``), or None."""
    for owner in (model, getattr(model, "model", None)):
        function = getattr(owner, "get_rope_index", None)
        if callable(function):
            return function
    return None


def _rope_index_params(model) -> set[str]:
    return set(inspect.signature(rope_index_function(model)).parameters)


def positions_for(model, tokens: torch.Tensor, lengths: torch.Tensor, inputs: dict[str, Any]):
    """The position rule for ``model`` given the prompt rows ``tokens [B, P]`` (left-aligned,
    ``lengths [B]`` valid) and their prefill-only inputs in row layout."""
    function = rope_index_function(model)
    if function is None or not any(inputs.get(k) is not None for k in GRID_INPUTS):
        return TokenPositions()
    params = _rope_index_params(model)
    kwargs = {k: v for k, v in inputs.items() if k in params and k not in ("input_ids", "attention_mask")}
    mask = (torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]).long()  # [B, P]
    prompt, _ = function(tokens, attention_mask=mask, **kwargs)  # [3, B, P]; pure: stores nothing
    return MRopePositions(prompt.to(tokens.device).long(), lengths.to(tokens.device))


# -- prefill-only inputs --------------------------------------------------------------------------
def to_row_layout(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Left-padded ``values [B, L]`` -> left-aligned rows ``[B, L]``, zero past each row's end."""
    width = values.shape[1]
    cols = (width - lengths)[:, None] + torch.arange(width, device=values.device)[None, :]  # [B, L]
    rows = values.gather(1, cols.clamp(max=width - 1))
    return rows.masked_fill(cols >= width, 0)


@dataclass
class PrefillInputs:
    """What one model's first forward adds to its usual arguments."""

    inputs: dict[str, Any] = field(default_factory=dict)  # passed as given
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)  # [B, P] row layout, zero past each row
    placeholders: tuple[int, ...] = ()  # ids the media features replace (only when inputs carry media)

    def for_chunk(self, index: torch.Tensor, real: torch.Tensor) -> dict[str, Any]:
        """Inputs for a forward feeding token ``index [B, W]`` of each row (``real [B, W]`` marks
        slots that hold a token): per-token inputs laid out like that chunk, 0 elsewhere."""
        out = dict(self.inputs)
        for name, rows in self.per_token.items():
            inside = real & (index < rows.shape[1])
            out[name] = rows.gather(1, index.clamp(0, rows.shape[1] - 1)).masked_fill(~inside, 0)  # [B, W]
        return out

    def admissible(self, draft_ids: torch.Tensor, offered: torch.Tensor) -> torch.Tensor:
        """``offered [B]`` cut before the first draft in ``draft_ids [B, K]`` that is a placeholder."""
        if not self.placeholders or draft_ids.shape[1] == 0:
            return offered
        k = draft_ids.shape[1]
        columns = torch.arange(k, device=draft_ids.device)[None, :]
        bad = torch.isin(draft_ids, torch.tensor(self.placeholders, device=draft_ids.device)) & (columns < offered[:, None])
        first_bad = torch.where(bad.any(dim=1), bad.long().argmax(dim=1), torch.full_like(offered, k))
        return torch.minimum(offered, first_bad)

    def placed(self, tokens: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> bool:
        """Whether a placeholder id sits in a row of ``tokens [B, T]`` from ``start[b]`` to ``end[b]``."""
        if not self.placeholders or not bool((end > start).any()):
            return False
        cols = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        inside = (cols >= start[:, None]) & (cols < end[:, None])
        return bool((torch.isin(tokens, torch.tensor(self.placeholders, device=tokens.device)) & inside).any())

    def __bool__(self) -> bool:
        return bool(self.inputs or self.per_token)


@dataclass(frozen=True)
class PrefillSpec:
    """The prompt that prefill-only inputs describe, and those inputs, ready for any model."""

    tokens: torch.Tensor  # [B, P] left-aligned rows
    lengths: torch.Tensor  # [B]
    inputs: dict[str, Any]  # per-token inputs in row layout [B, P]; the rest as the user gave them
    user_inputs: dict[str, Any]  # as the user gave them (what generators see in DecodeContext)

    @classmethod
    def from_call(cls, tokens: torch.Tensor, lengths: torch.Tensor, model_inputs: dict[str, Any]) -> "PrefillSpec":
        """``tokens [B, L]`` rows of the left-padded prompt whose row lengths are ``lengths [B]``."""
        inputs = {k: to_row_layout(v.to(tokens.device), lengths) if k in PER_TOKEN_INPUTS and v is not None else v
                  for k, v in model_inputs.items()}
        return cls(tokens, lengths, inputs, dict(model_inputs))

    def for_model(self, model) -> tuple[PrefillInputs, TokenPositions | MRopePositions]:
        """What ``model``'s first forward receives (the inputs its forward declares) and its positions."""
        accepted = declared_inputs(model)
        mine = {k: v for k, v in self.inputs.items() if k in accepted and v is not None}
        per_token = {k: v for k, v in mine.items() if k in PER_TOKEN_INPUTS}
        plain = {k: v for k, v in mine.items() if k not in PER_TOKEN_INPUTS}
        placeholders = placeholder_ids(model) if set(plain) & MEDIA_INPUTS else ()
        return PrefillInputs(plain, per_token, placeholders), positions_for(model, self.tokens, self.lengths, mine)

    def plain_inputs(self, model) -> dict[str, Any]:
        """The inputs for a model in another token space: nothing laid out on the target's tokens."""
        accepted = declared_inputs(model)
        return {k: v for k, v in self.user_inputs.items() if k in accepted and k not in PER_TOKEN_INPUTS}


# -- prefixes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prefix:
    """A prompt prefix already in the target's cache (e.g. a system prompt with its image).

    Made by :meth:`SpecDecoder.prefill`; passed to ``generate(..., prefix=...)`` any number of
    times. ``generate`` copies the cache, so the prefix itself never changes.
    """

    target: Any  # the model whose cache this is
    spec: PrefillSpec  # the prefix rows and their prefill-only inputs (assistants prefill from these)
    offsets: torch.Tensor  # [B] cache slot of each row's first token
    cached_slots: int  # cache slots in use (every row ends here)
    cache: Any  # the target's cache after the prefill
    positions: TokenPositions | MRopePositions  # derived by the prefill; never recomputed

    def check_continuation(self, target, tokens: torch.Tensor, lengths: torch.Tensor, model_inputs: dict[str, Any]) -> None:
        """``tokens [B, L]`` left-aligned prompt rows must extend the prefix rows by >= 1 token."""
        if target is not self.target:
            raise ValueError("this prefix was computed with another target model")
        if model_inputs:
            raise ValueError(f"inputs {sorted(model_inputs)} cannot be given with a prefix: prefill-only inputs "
                             "belong to the prefix (SpecDecoder.prefill(prefix_ids, pixel_values=...))")
        if tokens.shape[0] != self.spec.tokens.shape[0]:
            raise ValueError(f"the prefix has {self.spec.tokens.shape[0]} rows, the prompt {tokens.shape[0]}")
        if bool((lengths <= self.spec.lengths.to(lengths.device)).any()):
            raise ValueError("every prompt row must extend its prefix row by at least one token")
        width = int(self.spec.lengths.max())
        head = tokens[:, :width].to(self.spec.tokens.device)  # [B, width]
        inside = torch.arange(width, device=head.device)[None, :] < self.spec.lengths[:, None]
        if not bool(((head == self.spec.tokens[:, :width]) | ~inside).all()):
            raise ValueError("the prompt does not start with the prefix tokens")
        placeholders = placeholder_ids(target)
        if placeholders:
            tail = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
            new = (tail >= self.spec.lengths.to(tokens.device)[:, None]) & (tail < lengths[:, None])
            if bool((torch.isin(tokens, torch.tensor(placeholders, device=tokens.device)) & new).any()):
                raise ValueError("the text after the prefix holds image placeholder tokens; images belong to the prefix")
