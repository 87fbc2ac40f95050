"""``self_draft``: the target's own weights at lower precision draft for it.

Decoding a small model on a CPU is bound by reading its weights, so a copy of the target with
fewer bytes per weight drafts faster than the target decodes, and agrees with it almost always
(same weights, rounded). The copy is built from the target once per decoder (the user's model is
never modified) and attached as a draft model; with ``lookup=True`` a row drafts from prompt
lookup where an n-gram matches and the policy expects the match to pay at least as well as the
copy (``ctx.draft_rate``), from the copy elsewhere.

``weights``:

* ``"auto"`` (default): ``"w8a8"`` for a target on a CPU (the fastest copy measured there, no
  extra package), ``"bfloat16"`` elsewhere (no extra package);
* ``"bfloat16"`` / ``"float16"``: a cast copy (no extra package);
* ``"int8"``: int8 weight-only linear layers with bfloat16 activations, by ``torchao``
  (``pip install "specdec[quant]"``);
* ``"w8a8"``: int8 weights and activations quantized per token on the fly, everything else in
  the target's dtype: int8 matrix products, the fastest draft on a CPU with VNNI/AMX int8
  instructions (on a CPU ``int8.Int8Linear``, no extra package; elsewhere ``torchao``;
  docs/self_draft.md has the measurements);
* ``"int4"``: int4 weight-only (``torchao``; needs a backend with int4 kernels).

Its draft steps run on a static cache with compiled one-token forwards (``compile_draft``, default on:
torchao's int8 layers are slower than fp32 ones until compiled), whatever cache the target uses.
The copy never runs over the prompt or a committed token: its cache mirrors the target's (the
keys and values of the target's prefill, then of each verified block), so it only computes its
drafts' own.
Greedy output stays the target's and sampling stays lossless: the copy only proposes.
"""

from __future__ import annotations

import copy
import threading
import weakref

import torch

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec.generators import DecodeContext, Feedback, Proposal
from specdec.modelinfo import tensor_bytes
from specdec.registry import register_candidate_generator

from .draft_model import DraftModelGenerator
from .int8 import quantize_linears
from .prompt_lookup import PromptLookupGenerator
from .rotation import rotatable, rotate_residual

WEIGHTS = ("auto", "bfloat16", "float16", "int8", "w8a8", "int4")
QUANTIZED = ("int8", "w8a8", "int4")


def resolve_weights(target, weights: str) -> str:
    """``weights``, with ``"auto"`` made concrete for ``target``'s device."""
    if weights not in WEIGHTS:
        raise ValueError(f"self_draft: weights must be one of {WEIGHTS}, got {weights!r}")
    if weights != "auto":
        return weights
    return "w8a8" if next(target.parameters()).device.type == "cpu" else "bfloat16"


def build_copy(target, weights: str):
    """A draft copy of ``target`` with ``weights`` precision; the target is only read."""
    weights = resolve_weights(target, weights)
    if getattr(target.config, "vision_config", None) is not None or hasattr(target, "get_rope_index"):
        raise ValueError(f"self_draft drafts for text-only models; {type(target).__name__} is a vision-language "
                         "model (pass a text draft model instead)")
    on_cpu = next(target.parameters()).device.type == "cpu"
    if weights in QUANTIZED and not (weights == "w8a8" and on_cpu):
        quantize, config = _torchao(weights)
    draft = _plain_copy(target)
    if weights == "w8a8" and on_cpu:  # int8 x uint8 products, the target's dtype elsewhere (int8.py)
        # a rotated residual stream is easier to quantize (rotation.py), where the layout allows
        if rotatable(draft) is None and not rotate_residual(draft, reference=target):
            draft = _plain_copy(target)  # the rotated copy failed its check: it is spoilt
        return quantize_linears(draft).eval()
    if weights != "w8a8":
        draft.to(torch.float16 if weights == "float16" else torch.bfloat16)
    if weights in QUANTIZED:
        quantize(draft, config)
    return draft.eval()


def _plain_copy(target):
    draft = copy.deepcopy(target)
    if getattr(draft.config, "_attn_implementation", None) == "sdpa":
        draft.set_attn_implementation(GROUPED_SDPA)  # the copy's config only: the target keeps its own
    return draft


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """SDPA for grouped-query attention without repeating keys and values per query head.

    transformers' ``sdpa`` repeats each key/value head for its group of query heads whenever a
    mask is given and the forward is compiled: the copy's draft steps (compiled, always masked)
    would read a static cache of S slots ``groups`` times over. Here the group's query heads
    become extra query rows of their key/value head instead (``[B, kv, groups * q, D]``, the
    mask repeated to match), which is the same attention. Anything else goes to ``sdpa``."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (groups == 1 or attention_mask is None or attention_mask.shape[1] != 1
             or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    batch, heads, q, dim = query.shape
    mask_batch, slots = attention_mask.shape[0], attention_mask.shape[-1]
    mask = attention_mask[:, :, None].expand(mask_batch, 1, groups, q, slots).reshape(mask_batch, 1, groups * q, slots)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(batch, heads // groups, groups * q, dim),
                                                           key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, q, dim).transpose(1, 2).contiguous(), None


GROUPED_SDPA = "specdec_grouped_sdpa"
AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def _torchao(weights: str):
    try:
        from torchao.quantization import (Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                                          Int8WeightOnlyConfig, quantize_)
    except ImportError as exc:
        raise ImportError(f"self_draft with weights={weights!r} needs torchao: pip install \"specdec[quant]\" "
                          "(or use weights='bfloat16', which needs no extra package)") from exc
    configs = {"int8": Int8WeightOnlyConfig, "w8a8": Int8DynamicActivationInt8WeightConfig,
               "int4": Int4WeightOnlyConfig}
    return quantize_, configs[weights]()


class _Copies:
    """The copies one configured generator built, per (target, weights); shared by its sessions."""

    def __init__(self):
        self._made: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.nn.Module]]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, target, weights: str):
        weights = resolve_weights(target, weights)
        with self._lock:
            made = self._made.setdefault(target, {})
            if weights not in made:
                made[weights] = build_copy(target, weights)
            return made[weights]


@register_candidate_generator("self_draft")
class SelfDraftGenerator(DraftModelGenerator):
    def __init__(self, *, weights: str = "auto", num_tokens: int = 5, schedule: str = "auto",
                 max_tokens: int = 16, compile_draft: bool | dict = True, lookup: bool = False):
        if weights not in WEIGHTS:
            raise ValueError(f"self_draft: weights must be one of {WEIGHTS}, got {weights!r}")
        if not isinstance(compile_draft, (bool, dict)):
            raise TypeError(f"compile_draft must be True, False or a dict of torch.compile options, got {compile_draft!r}")
        # no draft yet: setup() builds it from the call's target (once per decoder, see _Copies)
        super().__init__(torch.nn.Module(), num_tokens=num_tokens, schedule=schedule, max_tokens=max_tokens)
        self.weights, self.compile_draft = weights, compile_draft
        self.lookup = PromptLookupGenerator(schedule="auto", max_tokens=max_tokens) if lookup else None
        self._copies = _Copies()

    def session(self) -> "SelfDraftGenerator":
        fresh = super().session()
        fresh._copies = self._copies  # the copy is built once per decoder, not per call
        return fresh

    def setup(self, ctx: DecodeContext) -> None:
        self.draft = self._copies.get(ctx.target, self.weights)
        super().setup(ctx)
        if self.lookup is not None:
            self.lookup.setup(ctx)

    def acceptance_prior(self) -> float | tuple[float, float]:
        # The copy is the target rounded: its greedy token agreed with the target's on 90-99% of
        # positions (docs/self_draft.md). With lookup, the policy learns the two sources apart:
        # source 0 the copy (whose drafts cost time), source 1 a lookup match (accepted less often).
        return (0.85, 0.5) if self.lookup is not None else 0.85

    def attach_options(self) -> dict:
        # The copy has the target's cache layout, so it mirrors the target's cache: it starts from
        # the keys and values of the target's prefill and takes those of every verified block (more
        # exact than its own, and no forward of its own over them). A draft step then feeds one
        # token; the re-feeds of rows that drift apart in a batch run eagerly.
        # The copy is this generator's own (built by it, changed by nothing), so its compiled steps
        # skip dynamo's guards on its modules.
        return {"cache_implementation": "static", "compile": self.compile_draft, "compile_widths": (1,),
                "prefill_from_target": True, "owned": True}

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        if self.lookup is None:
            return super().propose(ctx, max_drafts)
        found = self.lookup.propose(ctx, max_drafts)
        matched = found.lengths > 0  # [B]
        lookup_rate = ctx.draft_rate(found.lengths, source=1) if bool(matched.any()) else None
        if lookup_rate is not None:  # a match is taken where it pays at least as well as the copy
            matched &= (lookup_rate >= ctx.draft_rate(max_drafts, source=0)).to(matched.device)
        missing = ~matched & (max_drafts.to(found.lengths.device) > 0)  # [B]
        if bool(missing.any()):
            found = merge(found, super().propose(ctx, max_drafts), use_second=missing.to(max_drafts.device),
                          vocab=ctx.target_vocab_size)
        found.sources = (~missing).long().cpu()  # 0: the copy's drafts, 1: a lookup match
        return found

    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        super().observe(ctx, feedback)
        if self.lookup is not None:
            self.lookup.observe(ctx, feedback)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        if self.lookup is not None:
            self.lookup.select_rows(rows)

    def memory(self, target) -> dict[str, int]:
        """The copy's memory next to the target's (bytes as stored): what drafting with it costs.
        Builds the copy if no call has yet."""
        return {"draft_bytes": tensor_bytes(self._copies.get(target, self.weights)), "target_bytes": tensor_bytes(target)}


def merge(first: Proposal, second: Proposal, use_second: torch.Tensor, vocab: int) -> Proposal:
    """Row b from ``second`` where ``use_second[b]``, else from ``first``; point masses become
    one-hot rows when the other proposal carries probabilities."""
    device = second.lengths.device
    k = max(first.token_ids.shape[1], second.token_ids.shape[1])
    pad = lambda t: torch.nn.functional.pad(t.to(device), (0, k - t.shape[1]))  # noqa: E731
    pick = use_second[:, None]
    token_ids = torch.where(pick, pad(second.token_ids), pad(first.token_ids))
    lengths = torch.where(use_second, second.lengths, first.lengths.to(device))
    probs = None
    if second.probs is not None:
        first_probs = torch.nn.functional.one_hot(pad(first.token_ids), vocab).to(second.probs.dtype)
        second_probs = torch.nn.functional.pad(second.probs, (0, 0, 0, k - second.probs.shape[1]))
        probs = torch.where(pick[..., None], second_probs, first_probs)
    return Proposal(token_ids, lengths, probs)
