"""``draft_model``: a smaller causal LM with the target's tokenizer drafts K tokens.

The assistant is attached to the controller, which owns its cache; the generator holds only an
:class:`~specdec.assistant.Assistant` handle. The assistant is prefilled once, on the first call
to ``propose``, then drafts one token per forward on its own cache. After every verification the
controller brings it to the committed prefix, so it is never fed a token it already holds (only
the target's new token, and the last draft when all were accepted).

Each step it drafts one token at a time and asks ``ctx.keep_drafting`` after each, with its own
probabilities of the drafts so far: the core's policy ends the block where another draft no longer
pays, and at once after a drafted end of sequence. It drafts from its logits after the call's
logits processors (``ctx.scores``: a repetition penalty, banned n-grams, the sampling warpers, as
the target's scores get them), so its drafts agree with the target's processed choice.

Vocabularies may be padded to different sizes; drafts are restricted to the ids both models
have. A draft with a different tokenizer is refused (that needs a cross-tokenizer generator).

``tree=True`` (``tree_width`` 2: one alternative a depth) offers, beside the chain, the draft's
next-best tokens at its depths as leaves of one token tree, where the policy prices them worth
verifying (drawn without replacement when sampling; :func:`with_siblings`, docs/trees.md).

``weights=`` (``"w8a8"``, ``"bfloat16"``, ... see ``specdec/engines/forwards/lowbit.py``) drafts with a copy of the draft at
that precision instead, built once per decoder (the draft model is only read) and stepped
compiled on a static cache (``compile_draft``): on a CPU a w8a8 copy of a small draft steps
several times faster than the draft itself.
"""

from __future__ import annotations

import torch

from specdec.copies import LowPrecisionDraft
from specdec.generators import (CandidateGenerator, DecodeContext, DraftingInfo, DraftLengthSchedule, Feedback,
                                Proposal, host_ints, long_tensor, plugin_name, token_id_list, vocab_size)
from specdec.registry import register_candidate_generator
from specdec.sampling import sample
from specdec.validation import check_flag

#: vocabularies whose sizes differ by more than this are not "the same tokenizer, padded"
MAX_VOCAB_PADDING = 1024


def tokenizer_mismatch(target, draft, tokenizer, draft_tokenizer) -> str | None:
    """Why ``draft`` cannot draft for ``target`` token for token, or None."""
    if tokenizer is not None and draft_tokenizer is not None and tokenizer is not draft_tokenizer:
        if tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            return "the target and draft tokenizers have different vocabularies"
    vt, vd = vocab_size(target), vocab_size(draft)
    if abs(vt - vd) > MAX_VOCAB_PADDING:
        return f"vocabulary sizes differ beyond padding ({vt} vs {vd})"
    eos_t = token_id_list(target.generation_config.eos_token_id)
    eos_d = token_id_list(draft.generation_config.eos_token_id)
    if eos_t and eos_d and not set(eos_t) & set(eos_d):
        return f"end-of-sequence ids differ ({eos_t} vs {eos_d})"
    return None


@register_candidate_generator("draft_model")
class DraftModelGenerator(LowPrecisionDraft, CandidateGenerator):
    def __init__(self, draft, *, num_tokens: int = 5, schedule: str = "auto", max_tokens: int = 16,
                 weights: str | None = None, compile_draft: bool | dict | None = None, tree: bool = False,
                 tree_width: int = 2):
        if not isinstance(draft, torch.nn.Module):
            raise TypeError("draft_model needs a draft model: SpecDecoder(target, draft_model)")
        check_flag(tree, f"{plugin_name(self)}: tree")
        if isinstance(tree_width, bool) or not isinstance(tree_width, int) or tree_width < 2:
            raise ValueError(f"{plugin_name(self)}: tree_width must be an int >= 2 (the chain's token and at "
                             f"least one alternative a depth), got {tree_width!r}")
        self.draft = draft
        self.schedule = DraftLengthSchedule(num_tokens, schedule, max_tokens)
        self.assistant = None
        self.tree, self.tree_width = tree, tree_width
        self._init_precision(weights, compile_draft)

    def drafting(self) -> DraftingInfo:
        # stepwise: its own probability of each draft ends the block (ctx.keep_drafting)
        return DraftingInfo(max_drafts=self.schedule.policy_drafts, stepwise=True)

    def source_model(self, ctx: DecodeContext):
        """The model whose weights draft (at ``weights`` precision, if set)."""
        return self.draft

    def setup(self, ctx: DecodeContext) -> None:
        source = self.source_model(ctx)
        problem = tokenizer_mismatch(ctx.target, source, ctx.tokenizer, ctx.draft_tokenizer)
        if problem:
            raise ValueError(f"draft_model needs the target's tokenizer: {problem}. A draft with another "
                             "tokenizer needs the cross-tokenizer generator (pass tokenizer= and draft_tokenizer=).")
        self.draft = self.drafting_model(source, ctx)
        self.shared_vocab = min(vocab_size(ctx.target), vocab_size(self.draft))
        self.target_vocab = ctx.target_vocab_size
        self.assistant = ctx.attach(self.draft, **self.attach_options())
        self.schedule.reset(ctx.batch_size)

    def attach_options(self) -> dict:
        """How the draft keeps its cache (see ``DecodeContext.attach``): the call's own, unless
        it drafts compiled (``compile_draft``; a low-precision copy by default)."""
        return self.precision_attach_options()

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        counts = [max(min(a, b), 0) for a, b in zip(host_ints(self.schedule.current), host_ints(max_drafts))]
        k = max(counts, default=0)
        lengths = long_tensor(counts, max_drafts.device)
        if k == 0:
            return Proposal.empty(ctx.batch_size, max_drafts.device)
        ids, probs, confidence, depths = [], [], [], []
        for i in range(k):
            logits = self.assistant.next_logits()[:, : self.shared_vocab].float()  # [B, V]
            logits = ctx.scores(logits, torch.stack(ids, dim=1) if ids else None)  # the target's processors
            if ctx.sampling.do_sample:
                p = ctx.probs(logits)
                token = sample(p, ctx.generator)
                probs.append(torch.nn.functional.pad(p, (0, self.target_vocab - self.shared_vocab)))
                confidence.append(p.gather(1, token[:, None]))  # [B, 1]: the draft's own probability of it
            else:  # the argmax (the first of equal maxima) and its softmax probability, without the softmax
                top, token = logits.max(dim=-1)
                confidence.append(torch.exp(logits - top[:, None]).sum(dim=-1, keepdim=True).reciprocal())
            if self.tree:
                depths.append(probs[-1] if ctx.sampling.do_sample else logits)
            ids.append(token)
            if i + 1 < k and not ctx.keep_drafting(torch.stack(ids, dim=1), torch.cat(confidence, dim=1), lengths):
                break
            if i + 1 < k:  # the last draft is fed next step, and only if the target accepts it
                self.assistant.feed(token)
        token_ids = torch.stack(ids, dim=1)  # [B, k']
        chain = Proposal(token_ids, long_tensor([min(n, len(ids)) for n in counts], lengths.device),
                         torch.stack(probs, dim=1) if probs else None,
                         confidence=torch.cat(confidence, dim=1))
        if not self.tree or not bool((max_drafts.to(chain.lengths.device) > chain.lengths).any()):
            return chain  # no row has room for an alternative: nothing to price
        sampled = bool(ctx.sampling.do_sample)
        return with_siblings(chain, depths, max_drafts, self.tree_width, ctx.generator if sampled else None,
                             prices=ctx.node_prices(chain.confidence), sampled=sampled)

    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        self.schedule.update(feedback)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.schedule.select_rows(rows)


def with_siblings(chain: Proposal, depths: list[torch.Tensor], budget: torch.Tensor, width: int,
                  generator: torch.Generator | None, prices: torch.Tensor | None = None,
                  sampled: bool = False) -> Proposal:
    """A chain and, at each depth d, what the draft gave there (``depths[d] [B, V]``: its processed
    scores under greedy decoding, its distribution ``chain.probs[:, d]`` when sampling) -> the chain
    with up to ``width - 1`` alternatives at each of its depths, as one token tree within ``budget
    [B]`` nodes a row. Each alternative is a leaf, a child of the chain's node before it, valued by
    the draft's own chance that the target takes it: the chain's probability of reaching its depth
    times the alternative's probability (greedy: the next-best tokens by the draft's scores);
    sampling (``sampled``, or a ``generator`` given; ``generator`` None draws from torch's global
    one, as the sampling does): drawn without replacement from the draft's distribution without
    the chain's token, each with the distribution it was drawn from (``probs``), so recursive
    rejection verifies it exactly (docs/trees.md), and valued before it is drawn (the chance that
    the chain's token is wrong times that of two draws from what is left agreeing). A row takes its
    best open alternative, one at a time (at each depth in the order they were drawn:
    :func:`_best_in_draw_order`), while the k-th taken is worth ``prices[k]`` tokens
    (``ctx.node_prices``; None: all), within its budget. The chain leads (node order: the chain,
    then the alternatives by depth); a step where no row takes an alternative is the chain proposal."""
    n = chain.token_ids.shape[1]
    device = chain.token_ids.device
    chain_len = chain.lengths.to(device)
    confidence = chain.confidence.to(device).float()  # [B, n]
    reach = torch.cumprod(torch.cat([torch.ones_like(confidence[:, :1]), confidence[:, :-1]], dim=1), dim=1)
    reach = reach.masked_fill(torch.arange(n, device=device)[None, :] >= chain_len[:, None], 0)  # [B, n]
    room = (budget.to(device) - chain_len).clamp_min(0)  # [B] nodes left for alternatives
    if prices is not None:
        room = room.clamp_max(prices.numel())
    if not bool((room > 0).any()):
        return chain
    sampled = sampled or generator is not None
    tokens, value, drawn = _alternatives(chain, depths, confidence, width - 1, generator, sampled)
    chosen = _best_in_draw_order(reach[:, :, None] * value, room, prices)
    return _as_tree(chain, chosen.flatten(1), tokens.flatten(1), None if drawn is None else drawn.flatten(1, 2),
                    width - 1)


def _best_in_draw_order(value: torch.Tensor, room: torch.Tensor, prices: torch.Tensor | None) -> torch.Tensor:
    """``value [B, n, m]`` of each depth's alternatives in the order they were drawn -> which a row
    takes ``[B, n, m]``: the best one left, one at a time, while the k-th taken is worth ``prices[k]``
    (None: anything above 0), within ``room [B]``; at each depth only the next one drawn is open.
    So whether an alternative is taken never depends on its own token: its value is known before
    it is drawn, and a later one's (which may depend on it) is looked at only once it is taken,
    which recursive rejection needs to stay exact (a draw chosen by its own token is not a draw
    from the distribution it reports)."""
    batch, n, m = value.shape
    device = value.device
    chosen = torch.zeros(batch, n, m, dtype=torch.bool, device=device)
    taken = torch.zeros(batch, n, dtype=torch.long, device=device)  # [B, n] alternatives taken at each depth
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    rows = torch.arange(batch, device=device)
    steps = int(room.max()) if prices is None else min(int(room.max()), prices.numel())
    for k in range(steps):
        open_value = value.gather(2, taken.clamp(max=m - 1)[:, :, None])[:, :, 0].masked_fill(taken >= m, 0.0)
        best, depth = open_value.max(dim=1)  # [B]: the first of equal values, the shallowest
        alive &= (best > 0) & (k < room)
        if prices is not None:
            alive &= best >= float(prices[k])
        if not bool(alive.any()):  # every row has stopped
            break
        chosen[rows[alive], depth[alive], taken[rows, depth][alive]] = True
        taken[rows[alive], depth[alive]] += 1
    return chosen


def _alternatives(chain: Proposal, depths: list[torch.Tensor], confidence: torch.Tensor, others: int,
                  generator: torch.Generator | None, sampled: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`with_siblings`' candidates: ``others`` alternatives at each depth of the chain ->
    their tokens and values ``[B, n, others]`` (0: none there), and when sampling the distribution
    each was drawn from ``[B, n, others, V]``."""
    batch, n = chain.token_ids.shape
    device = chain.token_ids.device
    tokens = torch.zeros(batch, n, others, dtype=torch.long, device=device)
    value = torch.zeros(batch, n, others, device=device)
    drawn = []
    for d, scores in enumerate(depths):
        if not sampled:  # the next-best tokens, each valued by the draft's probability of it
            top = scores.topk(others + 1, dim=-1)  # the chain's token first: its argmax, of probability c
            p = torch.exp(top.values[:, 1:] - top.values[:, :1]) * confidence[:, d: d + 1]  # [B, others], no softmax
            tokens[:, d], value[:, d] = top.indices[:, 1:], torch.where(top.values[:, 1:].isfinite(), p, 0)
            continue
        left = scores.scatter(1, chain.token_ids[:, d: d + 1].to(device), 0.0)  # [B, V] without the chain's token
        per_depth = []
        for j in range(others):  # drawn without replacement, valued before each draw
            mass = left.sum(dim=-1, keepdim=True)  # [B, 1]
            q = left / mass.clamp_min(1e-30)
            tokens[:, d, j] = sample(torch.where(mass > 0, q, scores), generator)
            value[:, d, j] = torch.where(mass[:, 0] > 1e-12, (1 - confidence[:, d]) * (q * q).sum(dim=-1), 0)
            per_depth.append(q)
            left = left.scatter(1, tokens[:, d, j: j + 1], 0.0)
        drawn.append(torch.stack(per_depth, dim=1))  # [B, others, V]
    return tokens, value, torch.stack(drawn, dim=1) if drawn else None


def _as_tree(chain: Proposal, chosen: torch.Tensor, tokens: torch.Tensor, drawn: torch.Tensor | None,
             others: int) -> Proposal:
    """The chain and its ``chosen [B, S]`` alternatives (``tokens [B, S]``, their draws'
    distributions ``[B, S, V]`` when sampling; slot s at depth ``s // others``) as one tree
    proposal; the chain itself where none is chosen."""
    if not bool(chosen.any()):
        return chain
    batch, n = chain.token_ids.shape
    device = chain.token_ids.device
    chain_len = chain.lengths.to(device)
    total = chain_len + chosen.sum(dim=1)  # [B]
    k = int(total.max())
    index = chain_len[:, None] + chosen.long().cumsum(dim=1) - 1  # [B, S] node index of a chosen slot
    b, slot = torch.nonzero(chosen, as_tuple=True)
    at = index[b, slot]
    widen = lambda t, fill=0: torch.nn.functional.pad(t, (0, max(k - n, 0)), value=fill)[:, :k].clone()  # noqa: E731
    node_ids, conf = widen(chain.token_ids.to(device)), widen(chain.confidence.to(device).float(), float("nan"))
    node_ids[b, at] = tokens[b, slot]
    conf[b, at] = float("nan")  # no probability of its own for the policy: it prices a node by its position
    parents = (torch.arange(k, device=device) - 1)[None, :].repeat(batch, 1)
    parents[b, at] = torch.div(slot, others, rounding_mode="floor") - 1  # the chain's node before its depth
    probs = None
    if chain.probs is not None:
        probs = torch.nn.functional.pad(chain.probs, (0, 0, 0, max(k - n, 0)))[:, :k].clone()
        probs[b, at] = drawn[b, slot].to(probs.dtype)
    return Proposal(node_ids, total.to(chain.lengths.device), probs, parents=parents, confidence=conf)
