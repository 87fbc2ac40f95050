"""``eagle3``: a trained head drafts from the hidden states of the target's own verifying forward.

``SpecDecoder(target, "eagle3", head=FOLDER)`` loads a head (SpecForge's or ``speculators``'
layout, ``layouts.py``); without ``head=`` the head shipped for the target (``heads/``) is used.
The head is loaded once per decoder and shared by its calls; each call keeps its own
:class:`~.head.HeadCache` and feature buffer.

Each step, in token positions (pair ``t`` = the feature of token ``t`` with token ``t + 1``,
predicting token ``t + 2``; ``head.py``):

* ``observe`` takes the target's hidden states of the tokens the step committed
  (``feedback.hidden``, declared by ``DraftingInfo.hidden_layers``), fuses them (``head.fc``) and
  stores each row's features by position: ``known[b]`` positions hold the target's features;
* ``propose`` feeds the head every pair not yet in its cache (positions ``fed[b] .. known[b] - 1``,
  one forward for the batch), whose last output predicts the first draft; each further draft is
  one one-column head step on the head's own previous output and the draft just made, asking
  ``ctx.keep_drafting`` after each (its own probability ends the block). A row whose features
  do not reach its last committed token (before the target's prefill) drafts nothing.

Drafts are the argmax of the head's logits over its draft vocabulary (mapped to target ids) under
greedy decoding, and a sample from their softmax scattered into the target's vocabulary under
sampling, with those probabilities in the proposal: the verifier's speculative sampling keeps the
output the target's distribution whatever the head says. The call's logits processors score each
draft position first (``ctx.scores``), as for every drafter that has logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.generators import CandidateGenerator, DecodeContext, DraftingInfo, DraftLengthSchedule, Feedback, Proposal
from specdec.modelinfo import tensor_bytes
from specdec.registry import register_candidate_generator
from specdec.sampling import sample
from specdec.validation import check_flag

from .head import Eagle3Head, HeadCache, attend, step

#: the acceptance the policy assumes of a head's drafts until it has measured some
HEAD_PRIOR = 0.6

#: the heads shipped with the project, by the name ``load_model`` gives the target
SHIPPED = Path(__file__).parent / "heads"


def shipped_head(target) -> Path | None:
    """The folder of the head shipped for ``target`` (matched by its config's shape and type), or None."""
    from .layouts import read_config

    if not SHIPPED.is_dir():
        return None
    text = target.config.get_text_config()
    for folder in sorted(p for p in SHIPPED.iterdir() if (p / "config.json").is_file()):
        config = read_config(folder, target.config)
        if (config.target_model_type == getattr(text, "model_type", None) and config.vocab_size == text.vocab_size
                and config.target_hidden_size == text.hidden_size
                and max(config.aux_layers) <= text.num_hidden_layers):
            return folder
    return None


@register_candidate_generator("eagle3")
class Eagle3Generator(CandidateGenerator):
    def __init__(self, *, head: str | Path | Eagle3Head | None = None, num_tokens: int = 5, schedule: str = "auto",
                 max_tokens: int = 10, tree: bool = False, tree_width: int = 4, tree_depth: int = 6):
        if head is not None and not isinstance(head, (str, Path, Eagle3Head)):
            raise TypeError(f"eagle3: head must be a folder or an Eagle3Head, got {type(head).__name__}")
        if isinstance(head, (str, Path)) and not Path(head).is_dir():
            raise FileNotFoundError(f"eagle3: head folder {str(head)!r} does not exist")
        check_flag(tree, "eagle3: tree")
        for name, value in (("tree_width", tree_width), ("tree_depth", tree_depth)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"eagle3: {name} must be a positive int, got {value!r}")
        self.head_source = head
        self.schedule = DraftLengthSchedule(num_tokens, schedule, max_tokens)
        self.tree, self.tree_width, self.tree_depth = tree, tree_width, tree_depth
        self._loaded: dict = {}  # the decoder's head, per target, shared by its sessions

    def session(self) -> "Eagle3Generator":
        fresh = super().session()
        fresh._loaded = self._loaded
        return fresh

    # -- the head -----------------------------------------------------------------------------------
    def _head(self, target) -> Eagle3Head:
        key = id(target)
        if key not in self._loaded:
            self._loaded[key] = self._load(target)
        return self._loaded[key]

    def _load(self, target) -> Eagle3Head:
        from .layouts import check_fit, load_head

        source = self.head_source
        param = next(target.parameters())
        if isinstance(source, Eagle3Head):
            check_fit(source.config, target.config)
            head = source
        else:
            folder = source if source is not None else shipped_head(target)
            if folder is None:
                raise ValueError(f"eagle3: no head ships for {type(target).__name__} "
                                 f"({target.config.get_text_config().model_type}); pass head=FOLDER (docs/eagle3.md: "
                                 "train one with `specdec train-head`, or bring a published one)")
            head = load_head(folder, target.config)
        return head.to(device=param.device, dtype=param.dtype).eval()

    def drafting(self) -> DraftingInfo:
        # the head's layers are known once setup has loaded it (the run reads them after setup)
        layers = self.head.config.aux_layers if getattr(self, "head", None) is not None else ()
        return DraftingInfo(HEAD_PRIOR, self.schedule.policy_drafts, stepwise=True, hidden_layers=layers)

    # -- a call --------------------------------------------------------------------------------------
    def setup(self, ctx: DecodeContext) -> None:
        self.head = self._head(ctx.target)
        self.embed = ctx.target.get_input_embeddings()
        self.vocab = ctx.target_vocab_size
        batch, device = ctx.batch_size, ctx.tokens.device
        self.to_target = self.head.target_ids(torch.arange(self.head.config.draft_vocab_size, device=device))
        self.cache = HeadCache(self.head, batch, ctx.tokens.shape[1] + 64, self.head.fc.weight.dtype, device)
        self.features = torch.zeros(batch, ctx.tokens.shape[1] + 64, self.head.config.hidden_size,
                                    dtype=self.head.fc.weight.dtype, device=device)  # [B, L, H] by position
        self.known = torch.zeros(batch, dtype=torch.long, device=device)  # [B] positions with the target's features
        self.fed = torch.zeros(batch, dtype=torch.long, device=device)  # [B] pairs in the head's cache
        self.schedule.reset(batch)

    def drafted_logits(self, ctx: DecodeContext, hidden: torch.Tensor, drafts: list[torch.Tensor]) -> torch.Tensor:
        """The head's hidden state ``[B, H]`` -> scores ``[B, V]`` over the target's vocabulary
        (tokens outside the draft vocabulary at -inf), processed as the call's processors say."""
        draft_logits = self.head.logits(hidden).float()  # [B, Vd]
        logits = draft_logits.new_full((draft_logits.shape[0], self.vocab), float("-inf"))
        logits[:, self.to_target] = draft_logits
        return ctx.scores(logits, torch.stack(drafts, dim=1) if drafts else None)

    @torch.no_grad()
    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        lengths = ctx.lengths  # [B] committed tokens
        # [B] features up to the last committed token's predecessor, which a one-token row lacks
        ready = (self.known >= lengths - 1) & (lengths > 1)
        limit = torch.where(ready, torch.minimum(self.schedule.current.to(max_drafts.device), max_drafts), 0)
        k = int(limit.clamp_min(0).max())
        if k == 0:
            return Proposal.empty(ctx.batch_size, max_drafts.device)
        last = self._catch_up(ctx, lengths)  # [B, H]: the head's output at position lengths - 2
        if self.tree:
            return self._draft_tree(ctx, last, limit, lengths)
        position = lengths - 1  # [B] where the next pair goes
        ids, probs, confidence = [], [], []
        for i in range(k):
            if ctx.sampling.do_sample:
                p = ctx.probs(self.drafted_logits(ctx, last, ids))  # [B, V]
                token = sample(p, ctx.generator)
                probs.append(p)
                confidence.append(p.gather(1, token[:, None]))
            else:  # with no processors, the argmax over the draft vocabulary's own columns: the same token
                scores = self.drafted_logits(ctx, last, ids) if ctx.processed else self.head.logits(last).float()
                top, token = scores.max(dim=-1)
                token = token if ctx.processed else self.to_target[token]
                confidence.append(torch.exp(scores - top[:, None]).sum(dim=-1, keepdim=True).reciprocal())
            ids.append(token)
            if i + 1 == k or not ctx.keep_drafting(torch.stack(ids, dim=1), torch.cat(confidence, dim=1), limit):
                break
            embeds = self.embed(token)[:, None]  # [B, 1, H]
            last = step(self.head, self.cache, last[:, None], embeds, position[:, None])[:, 0]
            position = position + 1
        return Proposal(torch.stack(ids, dim=1), limit.clamp(max=len(ids)),
                        torch.stack(probs, dim=1) if probs else None, confidence=torch.cat(confidence, dim=1))

    def _draft_tree(self, ctx: DecodeContext, root: torch.Tensor, limit: torch.Tensor,
                    lengths: torch.Tensor) -> Proposal:
        """A dynamic tree (EAGLE-2's expansion): the root's ``tree_width`` likeliest tokens, then at
        each depth the ``tree_width`` likeliest continuations (by the product of the head's
        probabilities along the path) of the frontier's nodes, up to ``tree_depth``; the row's
        ``limit[b]`` likeliest nodes of all those made, with their ancestors, are proposed as point
        masses (the verifier samples the target and descends where a child matches: lossless
        whatever the tree). A node's head step attends to the committed pairs and its own ancestors."""
        batch, width = root.shape[0], self.tree_width
        device = root.device
        keys, values = [], []  # per depth: [B, g, w, d] entries of the frontier's pairs
        tokens, parents, scores = [], [], []  # per depth: [B, w] token, global parent id (-1: root), log-prob
        log_p = torch.log_softmax(self.drafted_logits(ctx, root, []), dim=-1)  # [B, V]
        score, token = log_p.topk(width, dim=-1)  # [B, w]
        tokens.append(token), parents.append(torch.full_like(token, -1)), scores.append(score)
        feature = root[:, None].expand(-1, width, -1)  # [B, w, H]: each frontier node's pair feature
        ancestors = torch.eye(width, dtype=torch.bool, device=device)[None].repeat(batch, 1, 1)  # [B, w, n]
        committed = torch.arange(self.cache.capacity, device=device)[None, None, :] <= (lengths - 2)[:, None, None]
        for depth in range(1, min(self.tree_depth, int(limit.max()))):
            first = depth * width - width  # global id of the frontier's first node
            positions = (lengths - 2 + depth)[:, None].expand(-1, width)  # [B, w]
            q, k, v = self.head.project(feature, self.embed(token), positions)
            keys.append(k), values.append(v)
            seen = torch.cat([committed.expand(-1, width, -1), ancestors], dim=-1)  # [B, w, S + n]
            out = attend(q, torch.cat([self.cache.keys, *keys], dim=2), torch.cat([self.cache.values, *values], dim=2),
                         seen)
            hidden = self.head.finish(out, feature)  # [B, w, H]
            logits = self.head.logits(hidden).float()  # [B, w, Vd]: ranking only, no processors needed
            child_p, child = torch.log_softmax(logits, dim=-1).topk(width, dim=-1)  # [B, w, w]
            total = (score[:, :, None] + child_p).flatten(1)  # [B, w*w]
            score, pick = total.topk(width, dim=-1)  # [B, w]
            parent_local = pick // width  # [B, w] which frontier node
            token = self.head.target_ids(child.flatten(1).gather(1, pick))
            tokens.append(token), parents.append(first + parent_local), scores.append(score)
            feature = hidden.gather(1, parent_local[..., None].expand(-1, -1, hidden.shape[-1]))
            # the new frontier sees its parent's ancestors, its parent, and itself
            new = ancestors.gather(1, parent_local[..., None].expand(-1, -1, ancestors.shape[-1]))  # [B, w, n]
            ancestors = torch.cat([new, torch.eye(width, dtype=torch.bool, device=device)[None].repeat(batch, 1, 1)],
                                  dim=-1)
        return _best_subtree(torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1), limit)

    def _catch_up(self, ctx: DecodeContext, lengths: torch.Tensor) -> torch.Tensor:
        """Feed the head the pairs ``fed[b] .. lengths[b] - 2`` (features known, next token
        committed) in one forward -> its output at position ``lengths[b] - 2`` ``[B, H]``."""
        end = lengths - 1  # [B] pairs 0 .. end - 1 are complete
        start = torch.minimum(self.fed, end - 1).clamp_min(0)  # re-run the last pair when nothing is new
        width = int((end - start).max())
        positions = start[:, None] + torch.arange(width, device=start.device)[None, :]  # [B, T]
        positions = torch.minimum(positions, (end - 1)[:, None]).clamp_min(0)  # a short row repeats its last pair
        features = self.features.gather(1, positions[..., None].expand(-1, -1, self.features.shape[-1]))
        tokens = ctx.tokens.gather(1, positions + 1)  # [B, T] each pair's next token
        out = step(self.head, self.cache, features, self.embed(tokens), positions)  # [B, T, H]
        self.fed = torch.maximum(self.fed, end)
        return out[:, -1]

    @torch.no_grad()
    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        self.schedule.update(feedback)
        hidden = getattr(feedback, "hidden", None)
        if hidden is None:
            return
        fused = self.head.fuse([hidden.states[layer].to(self.features.dtype)
                                for layer in self.head.config.aux_layers])  # [B, M, H]
        end = hidden.start + hidden.count  # [B]
        need = int(end.max())
        if need > self.features.shape[1]:
            grown = self.features.new_zeros(self.features.shape[0], max(need, 2 * self.features.shape[1]),
                                            self.features.shape[2])
            grown[:, : self.features.shape[1]] = self.features
            self.features = grown
        columns = torch.arange(fused.shape[1], device=end.device)[None, :]  # [1, M]
        valid = columns < hidden.count[:, None]  # [B, M]
        rows = torch.arange(fused.shape[0], device=end.device)[:, None].expand_as(valid)
        self.features[rows[valid], (hidden.start[:, None] + columns)[valid]] = fused[valid]
        self.known = torch.where(hidden.count > 0, end, self.known)
        self.fed = torch.minimum(self.fed, self.known)  # a pair is fed again once its feature is the target's

    def select_rows(self, rows: torch.Tensor) -> None:
        self.schedule.select_rows(rows)
        rows = rows.to(self.known.device)
        self.cache.select_rows(rows)
        self.features, self.known, self.fed = self.features[rows], self.known[rows], self.fed[rows]

    # -- training (``specdec train-head``, train.py) ---------------------------------------------------
    @staticmethod
    def train_settings(**options):
        from .train import TrainSettings

        return TrainSettings(**options)

    @staticmethod
    def train(target, tokenizer, out, settings, *, prompts=None, target_name: str = "") -> Path:
        from .train import train_head

        return train_head(target, tokenizer, out, settings, prompts=prompts, target_name=target_name)

    def report(self) -> dict:
        """The head's size and this call's memory for it (its cache and features), in bytes."""
        held = (self.cache.keys, self.cache.values, self.features)
        return {"head_bytes": tensor_bytes(self.head), "call_bytes": sum(t.numel() * t.element_size() for t in held)}


def _best_subtree(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, limit: torch.Tensor) -> Proposal:
    """Nodes made (``tokens, parents, scores [B, n]``, global ids in creation order, parents first)
    -> the proposal of each row's ``limit[b]`` best-scored nodes closed under ancestors (the first
    ``limit[b]`` in creation order of that closure), parents re-indexed within the row."""
    batch, n = tokens.shape
    rank = scores.argsort(dim=1, descending=True).argsort(dim=1)  # [B, n] 0 = best
    keep = rank < limit[:, None]
    for i in range(n - 1, -1, -1):  # children come after parents: one backward pass closes the set
        p = parents[:, i]
        has = keep[:, i] & (p >= 0)
        keep[has.nonzero()[:, 0], p[has]] = True
    order = torch.arange(n, device=tokens.device)[None, :].expand(batch, -1)
    position = torch.where(keep, order, n).sort(dim=1).values  # [B, n] kept ids first, in creation order
    count = torch.minimum(keep.sum(1), limit)
    width = int(count.max())
    local = torch.full((batch, n + 1), -1, dtype=torch.long, device=tokens.device)  # global id -> local index
    local.scatter_(1, position[:, :width], torch.arange(width, device=tokens.device)[None, :].expand(batch, -1))
    chosen = position[:, :width].clamp(max=n - 1)  # [B, k] (past a row's count: filler)
    chosen_parents = parents.gather(1, chosen)
    new_parents = torch.where(chosen_parents >= 0, local.gather(1, chosen_parents.clamp(min=0)), -1)
    return Proposal(tokens.gather(1, chosen), count, parents=new_parents)
