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
from torch.nn import functional as F

from specdec.generators import CandidateGenerator, DecodeContext, DraftingInfo, DraftLengthSchedule, Feedback, Proposal
from specdec.registry import register_candidate_generator
from specdec.sampling import sample

from .head import Eagle3Head, HeadCache, step

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
                 max_tokens: int = 10):
        if head is not None and not isinstance(head, (str, Path, Eagle3Head)):
            raise TypeError(f"eagle3: head must be a folder or an Eagle3Head, got {type(head).__name__}")
        if isinstance(head, (str, Path)) and not Path(head).is_dir():
            raise FileNotFoundError(f"eagle3: head folder {str(head)!r} does not exist")
        self.head_source = head
        self.schedule = DraftLengthSchedule(num_tokens, schedule, max_tokens)
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
        index = self.head.target_ids(torch.arange(draft_logits.shape[1], device=logits.device))
        logits[:, index] = draft_logits
        return ctx.scores(logits, torch.stack(drafts, dim=1) if drafts else None)

    @torch.no_grad()
    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        lengths = ctx.lengths  # [B] committed tokens
        ready = self.known >= lengths - 1  # [B] features up to the last committed token's predecessor
        limit = torch.where(ready, torch.minimum(self.schedule.current.to(max_drafts.device), max_drafts), 0)
        k = int(limit.clamp_min(0).max())
        if k == 0:
            return Proposal.empty(ctx.batch_size, max_drafts.device)
        last = self._catch_up(ctx, lengths)  # [B, H]: the head's output at position lengths - 2
        position = lengths - 1  # [B] where the next pair goes
        ids, probs, confidence = [], [], []
        for i in range(k):
            scores = self.drafted_logits(ctx, last, ids)  # [B, V]
            if ctx.sampling.do_sample:
                p = ctx.probs(scores)
                token = sample(p, ctx.generator)
                probs.append(p)
                confidence.append(p.gather(1, token[:, None]))
            else:
                top, token = scores.max(dim=-1)
                confidence.append(torch.exp(scores - top[:, None]).sum(dim=-1, keepdim=True).reciprocal())
            ids.append(token)
            if i + 1 == k or not ctx.keep_drafting(torch.stack(ids, dim=1), torch.cat(confidence, dim=1), limit):
                break
            embeds = self.embed(token)[:, None]  # [B, 1, H]
            last = step(self.head, self.cache, last[:, None], embeds, position[:, None])[:, 0]
            position = position + 1
        return Proposal(torch.stack(ids, dim=1), limit.clamp(max=len(ids)),
                        torch.stack(probs, dim=1) if probs else None, confidence=torch.cat(confidence, dim=1))

    def _catch_up(self, ctx: DecodeContext, lengths: torch.Tensor) -> torch.Tensor:
        """Feed the head the pairs ``fed[b] .. lengths[b] - 2`` (features known, next token
        committed) in one forward -> its output at position ``lengths[b] - 2`` ``[B, H]``."""
        end = lengths - 1  # [B] pairs 0 .. end - 1 are complete
        start = torch.minimum(self.fed, end - 1).clamp_min(0)  # re-run the last pair when nothing is new
        width = int((end - start).max())
        positions = start[:, None] + torch.arange(width, device=start.device)[None, :]  # [B, T]
        positions = torch.minimum(positions, (end - 1)[:, None])  # a short row repeats its last pair
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
    def train(target, tokenizer, out, settings, *, target_name: str = "") -> Path:
        from .train import train_head

        return train_head(target, tokenizer, out, settings, target_name=target_name)

    def report(self) -> dict:
        return {"head_parameters": sum(p.numel() for p in self.head.parameters())}
