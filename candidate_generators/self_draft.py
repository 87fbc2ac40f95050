"""``self_draft``: the target's own weights at lower precision draft for it.

Decoding a small model on a CPU is bound by reading its weights, so a copy of the target with
fewer bytes per weight drafts faster than the target decodes, and agrees with it almost always
(same weights, rounded). The copy is built from the target once per decoder (the user's model is
never modified) and attached as a draft model. With ``lookup=True`` (the default: the hybrid) a
row drafts from prompt lookup where an n-gram matches and the policy expects the match to pay at
least as well as the copy (``ctx.draft_rate``), from the copy elsewhere; ``lookup=False`` drafts
from the copy alone.

``weights`` (``specdec/engines/forwards/lowbit.py``): ``"auto"`` (default), for a target on a CPU, is
the copy measured best on this machine (``specdec/copies/choose.py``: each candidate's draft
step timed against the target's forward, its agreement with the target on a short text, the
policy's expected rate; once per machine and model, then read from the cache), and
``"bfloat16"`` elsewhere; ``"bfloat16"``, ``"float16"``, ``"int8"``, ``"w8a8"``,
``"dynamic_int8"`` and ``"int4"`` as chosen (``int8``, and ``int4`` and ``w8a8`` off the CPU, by
``torchao``: ``pip install "specdec[quant]"``). ``auto``'s measuring stops at ``choice_budget``
seconds (None: ``choose.budget_seconds``, 30 s unless ``SPECDEC_CHOICE_BUDGET`` says) with the
best copy so far, said, and shows a progress bar on stderr as ``progress`` says (None: where
stderr is a terminal and ``SPECDEC_QUIET`` is not set). What was chosen, and why, is in
``out.stats.choices``; the seconds spent building or choosing the copy in
``out.stats.generator["setup_seconds"]``, apart from decoding (``out.stats.summary()``).

Its draft steps run on a static cache, whatever cache the target uses, with one-token forwards
compiled as ``compile_draft`` says: ``"auto"`` (default) compiles them in ``SpecDecoder.warmup()``
and runs them compiled in the calls after it, eagerly otherwise (no call compiles for minutes
unasked); True compiles on first use (said on stderr); False never.
The copy never runs over the prompt or a committed token: its cache mirrors the target's (the
keys and values of the target's prefill, then of each verified block), so it only computes its
drafts' own; under ``engine="llama_cpp"``, which keeps the target's keys and values in llama.cpp,
the copy (run by torch) prefills and follows the committed tokens itself.
Greedy output stays the target's and sampling stays lossless: the copy only proposes.
"""

from __future__ import annotations

import torch

from specdec.copies import budget_seconds
from specdec.distributed import sharding
from specdec.engines import check_weights
from specdec.generators import DecodeContext, DraftingInfo, Feedback, Proposal, host_ints
from specdec.modelinfo import tensor_bytes
from specdec.registry import register_candidate_generator
from specdec.validation import check_flag

from .draft_model import DraftModelGenerator
from .prompt_lookup import PromptLookupGenerator

#: the acceptance prior of the copy's drafts (docs/self_draft.md: how often it agrees)
COPY_PRIOR = 0.85


@register_candidate_generator("self_draft")
class SelfDraftGenerator(DraftModelGenerator):
    def __init__(self, *, weights: str = "auto", num_tokens: int = 5, schedule: str = "auto",
                 max_tokens: int = 16, compile_draft: bool | dict | str = "auto", lookup: bool = True,
                 choice_budget: float | None = None, progress: bool | None = None, tree: bool = False,
                 tree_width: int = 2):
        check_weights(weights, "self_draft")  # None would draft with the target itself, at the target's cost
        check_flag(lookup, "self_draft: lookup")
        if choice_budget is not None:
            budget_seconds(choice_budget)  # raises, naming it, for a budget that is not a number >= 0
        if progress is not None:
            check_flag(progress, "self_draft: progress")
        # no draft yet: setup() builds it from the call's target (once per decoder, see specdec.copies.Copies)
        super().__init__(torch.nn.Module(), num_tokens=num_tokens, schedule=schedule, max_tokens=max_tokens,
                         weights=weights, compile_draft=compile_draft, tree=tree, tree_width=tree_width)
        self.choice_budget, self.choice_progress = choice_budget, progress
        self.lookup = PromptLookupGenerator(schedule="auto", max_tokens=max_tokens) if lookup else None
        self.mirror = True  # setup() reads whether the call's engine lets the copy mirror the target's cache

    def source_model(self, ctx: DecodeContext):
        if sharding(ctx.target):  # the copy would be made of this rank's shards
            raise ValueError(f"self_draft copies the target's weights, which are sharded across ranks here "
                             f"({', '.join(sharding(ctx.target))} parallel); use a drafter that needs no copy of "
                             "the target: prompt_lookup, suffix or a draft model (docs/distributed.md)")
        return ctx.target

    def setup(self, ctx: DecodeContext) -> None:
        self.mirror = ctx.can_mirror
        super().setup(ctx)
        if self.lookup is not None:
            self.lookup.setup(ctx)

    def drafting(self) -> DraftingInfo:
        # The copy is the target rounded, so it agrees with it far more often than an unrelated
        # draft (docs/self_draft.md). With lookup, the policy learns the sources apart:
        # source 0 the copy (whose drafts cost time), then lookup's, two per match length.
        lookup = self.lookup.drafting().priors if self.lookup is not None else ()
        return DraftingInfo((COPY_PRIOR, *lookup), self.schedule.policy_drafts, stepwise=True)

    def attach_options(self) -> dict:
        # The copy has the target's cache layout, so it mirrors the target's cache: it starts from
        # the keys and values of the target's prefill and takes those of every verified block (more
        # exact than its own, and no forward of its own over them). A draft step then feeds one
        # token; the re-feeds of rows that drift apart in a batch run eagerly. Where the engine
        # keeps the target's keys and values itself (llama.cpp) the copy prefills and follows the
        # committed tokens like any draft model.
        if not self.mirror:
            return self.precision_attach_options()
        return {**self.precision_attach_options(widths=(1,)), "prefill_from_target": True}

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        if self.lookup is None:
            return super().propose(ctx, max_drafts)
        found = self.lookup.propose(ctx, max_drafts)
        # [B] bool on the CPU, from host values (no device read): the rows a lookup matched, those that may draft
        matched = torch.tensor([n > 0 for n in host_ints(found.lengths)])
        drafting = torch.tensor([n > 0 for n in host_ints(max_drafts)])
        lookup_sources = found.sources + 1  # [B] this generator's source of each row's match
        copy_rate = ctx.draft_rate(max_drafts, source=0) if bool(matched.any()) else None  # None: no policy
        if copy_rate is not None:  # a match is taken where it pays at least as well as the copy
            lookup_rate = torch.zeros(matched.shape, dtype=torch.float64)
            for source in lookup_sources[matched].unique().tolist():
                mine = lookup_sources == source
                lookup_rate[mine] = ctx.draft_rate(found.lengths, source=source).cpu()[mine]
            take = matched & (lookup_rate >= copy_rate.cpu())
            if bool((~take & drafting).any()):
                # the copy drafts for some row, and a batch's copy steps every row: its drafts are
                # made for a matched row too, so a match must beat them as made
                paid = ctx.draft_rate(max_drafts, source=0, paid=True).cpu()
                take &= lookup_rate >= paid
            matched = take
        missing = ~matched & drafting  # [B]
        if bool(missing.any()):
            found = merge(found, super().propose(ctx, max_drafts), use_second=missing.to(max_drafts.device),
                          vocab=ctx.target_vocab_size)
        found.sources = torch.where(missing, 0, lookup_sources)  # 0: the copy's drafts, else a match's
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
        return {"draft_bytes": tensor_bytes(self.drafting_model(target)), "target_bytes": tensor_bytes(target)}


def merge(first: Proposal, second: Proposal, use_second: torch.Tensor, vocab: int) -> Proposal:
    """Row b from ``second`` where ``use_second[b]``, else from ``first``; point masses become
    one-hot rows when the other proposal carries probabilities, a proposal without confidences
    gives NaN (none) when the other has them, and a chain's rows become chains of a tree (each
    node the child of the one before) when the other proposal is a tree."""
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
    confidence = None
    if first.confidence is not None or second.confidence is not None:
        def own(p: Proposal) -> torch.Tensor:  # [B, k]: its confidences, NaN where it has none
            if p.confidence is None:
                return torch.full((pick.shape[0], k), float("nan"), device=device)
            return torch.nn.functional.pad(p.confidence.to(device), (0, k - p.confidence.shape[1]), value=float("nan"))
        confidence = torch.where(pick, own(second), own(first))
    parents = None
    if first.is_tree or second.is_tree:
        def tree(p: Proposal) -> torch.Tensor:  # [B, k]: its parents, a chain's where it has none
            chain = (torch.arange(k, device=device) - 1)[None, :].expand(pick.shape[0], -1)
            return chain if p.parents is None else torch.nn.functional.pad(p.parents.to(device),
                                                                            (0, k - p.parents.shape[1]), value=-1)
        parents = torch.where(pick, tree(second), tree(first))
    return Proposal(token_ids, lengths, probs, parents=parents, confidence=confidence)
