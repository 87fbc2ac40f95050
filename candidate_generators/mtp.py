"""``mtp``: the multi-token-prediction (MTP) layers a checkpoint carries draft for their own model.

DeepSeek-V3, GLM-4.5/4.6 and a few other checkpoints ship ``num_mtp_layers`` extra layers trained to
predict tokens ``t + 2, t + 3, ...`` from the target's last hidden state at token ``t`` and the token
``t + 1``. The model classes of ``transformers`` drop those weights when they load; transformers'
own ``MtpModel`` (``transformers/modeling_layers.py``) builds them around the target (sharing its
embeddings, output layer and rotary embedding) and reads them from the checkpoint again. This
generator drafts with that ``MtpModel``, through its public entry points only: ``from_pretrained``
(or an instance the caller built), ``forward_layer`` (one MTP layer over some columns, on an
``MtpCache``; ``transformers/cache_utils.py``) and ``shared_head``.

``SpecDecoder(target, "mtp")`` loads the MTP layers from the target's checkpoint
(``config.name_or_path``) once per decoder; its calls share them and each keeps its own caches.
``mtp=`` takes an ``MtpModel`` built in code instead. A target whose config has no
``num_mtp_layers``, or a checkpoint without MTP weights, is refused in ``setup``, before any forward.

Columns, in token positions. Column ``j`` of MTP layer 0 is the pair (the target's last hidden state
of token ``j``, token ``j + 1``) at position ``j + 1``; its output predicts token ``j + 2``. Layer
``i`` runs ``i`` tokens further: its column ``j`` takes layer ``i - 1``'s output there and token
``j + 1 + i``, at position ``j + 1 + i``. With ``L`` committed tokens a row feeds columns up to
``L - 2`` (the newest token has no hidden state yet); the last column's output at layer ``i`` drafts
token ``L + i``, and that draft is layer ``i + 1``'s newest token. So each step drafts exactly
``num_mtp_layers`` tokens (the policy may verify fewer).

Invariants, per row:

* the hidden states come from the verifying forwards (``DraftingInfo.hidden_layers``: the target's
  last, post-norm hidden state, as ``MtpModel`` expects; ``observe`` stores them by position);
* the row's ``MtpCache`` holds columns ``low .. fed - 1`` of every layer; a column is exact while every
  token it saw is committed: layer 0 sees committed tokens only, layer ``i`` column ``j`` also sees
  the drafts at ``L .. j + 1 + i``. Before feeding, the cache is cropped to its exact columns
  (:func:`exact_columns`), so a rejected draft never stays in it, and the columns from there to
  ``L - 2`` are fed in one ``forward_layer`` call per layer. One MTP layer never crops.

Rows run one at a time: ``MtpModel`` builds its attention masks without a padding mask (it is made
for transformers' batch-size-1 assisted generation), so each row has its own ``MtpCache`` and its
own ``forward_layer`` calls; a left-padded batch decodes exactly, at ``B`` small MTP forwards per
layer per step.

Drafts are the argmax of the call's processed scores (``ctx.scores``) under greedy decoding, and a
sample from ``ctx.probs`` under sampling, with those probabilities in the proposal, so the verifier
keeps the target's distribution whatever the MTP layers say. Each draft's probability goes to the
policy as ``Proposal.confidence``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

from specdec.generators import CandidateGenerator, DecodeContext, DraftingInfo, Feedback, Proposal, vocab_size
from specdec.registry import register_candidate_generator
from specdec.sampling import sample

#: the acceptance the policy assumes of MTP drafts until it has measured some (DeepSeek-V3 reports
#: 85-90% for its one MTP layer on real text; random test layers fall far below, and are measured)
MTP_PRIOR = 0.7

#: model types whose config has ``num_mtp_layers`` in transformers 5.25 (surveyed over every config
#: class; the text config of kimi_k25 is a deepseek_v3 one)
MTP_MODEL_TYPES = ("deepseek_v3", "glm4_moe", "ernie4_5_moe", "mellum", "bailing_hybrid", "param2moe", "sarvam_mla",
                   "sarvam_moe", "step3p5", "step3p7", "inkling")


# -- what a target must have ---------------------------------------------------------------------
def mtp_layer_count(target) -> int:
    """The number of MTP layers ``target``'s config declares; a ValueError naming why there are none."""
    text = target.config.get_text_config()
    count = getattr(text, "num_mtp_layers", None)
    name = f"{type(target).__name__} ({getattr(text, 'model_type', '?')})"
    if count is None:
        raise ValueError(
            f"mtp: {name} has no multi-token-prediction layers: its config has no num_mtp_layers. transformers "
            f"builds MTP layers for the model types {', '.join(MTP_MODEL_TYPES)} (DeepSeek-V3, GLM-4.5/4.6, ...); "
            "checkpoints of other models that carry MTP weights (Qwen3-Next, MiMo, DeepSeek-V3.2, ...) have them "
            "dropped at load. Draft with another generator (`specdec list`).")
    if int(count) < 1:
        raise ValueError(f"mtp: {name} declares num_mtp_layers = {count}: no MTP layers to draft with")
    return int(count)


def checkpoint_keys(folder: Path) -> list[str] | None:
    """The tensor names of the safetensors checkpoint in ``folder`` (its index when sharded), or None
    when there is none."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    keys = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            keys.extend(handle.keys())
    return keys


def load_mtp(target) -> MtpModel:
    """``target``'s MTP layers read from its checkpoint (``config.name_or_path``), on the device of its
    last layer; ValueError naming what is missing (no checkpoint, no MTP weights), checked before
    anything loads where the checkpoint is a local folder."""
    source = str(getattr(target.config, "name_or_path", "") or "")
    name = type(target).__name__
    if not source:
        raise ValueError(f"mtp: this {name} was built in code, not loaded from a checkpoint, so there are no "
                         "MTP weights to read: pass mtp=MtpModel(target, num_mtp_layers) with weights of your own")
    try:
        pattern = MtpModel.get_mtp_weights_regex(target)
    except ValueError as error:
        raise ValueError(f"mtp: {name} names no MTP weights to load ({error})") from None
    folder = Path(source)
    if folder.is_dir():
        keys = checkpoint_keys(folder)
        if keys is None:
            raise ValueError(f"mtp: {source} holds no safetensors checkpoint (MTP layers load from safetensors only)")
        if not any(pattern.search(key) for key in keys):
            raise ValueError(f"mtp: the checkpoint {source} holds no MTP weights (no tensor matches "
                             f"{pattern.pattern!r}, the keys {name} leaves out when it loads)")
    device = next(target.get_decoder().layers[-1].parameters()).device
    try:
        mtp = MtpModel.from_pretrained(target, device_map={"": device})
    except (OSError, RuntimeError, ValueError) as error:
        raise ValueError(f"mtp: could not load the MTP layers of {source}: {error}") from error
    return mtp.eval()


def check_fit(mtp: MtpModel, target) -> None:
    """An ``MtpModel`` given as ``mtp=`` must belong to ``target``: its hidden size, its vocabulary, its
    device; a ValueError naming the difference."""
    text = target.config.get_text_config()
    if mtp.config.hidden_size != text.hidden_size:
        raise ValueError(f"mtp: the MtpModel's hidden size {mtp.config.hidden_size} is not the target's "
                         f"({text.hidden_size}): it was built for another model")
    head, own = mtp.shared_head.weight, target.get_output_embeddings().weight
    if head.shape != own.shape:
        raise ValueError(f"mtp: the MtpModel's output layer is {tuple(head.shape)}, the target's "
                         f"{tuple(own.shape)}: it was built for another model")
    device = next(target.parameters()).device
    if head.device != device:
        raise ValueError(f"mtp: the MtpModel is on {head.device}, the target on {device}: move it to the target's device")


# -- the math, pure ------------------------------------------------------------------------------
def exact_columns(fed: int, drafted_at: int, seen: list[int], committed: torch.Tensor, layers: int) -> int:
    """How many leading columns of a row's MTP cache stay exact (``fed`` are held) now that ``committed
    [L']`` are the row's tokens, when the last feed ran at ``drafted_at`` committed tokens and its
    layers ``1 ..`` saw the drafts ``seen`` (the first ``layers - 1`` drafts, tokens ``drafted_at ..``).

    Layer ``i`` column ``j`` saw tokens up to ``j + 1 + i``; with the first ``m`` drafts committed as
    drafted, tokens below ``drafted_at + m`` are as seen, so every layer is exact on columns below
    ``drafted_at + m - layers`` (all ``fed`` when ``m = layers - 1``; one layer never loses any)."""
    matched = 0
    for offset, token in enumerate(seen):
        index = drafted_at + offset
        if index >= committed.shape[0] or int(committed[index]) != token:
            break
        matched += 1
    return min(fed, drafted_at + matched - layers)


def head_logits(mtp: MtpModel, hidden: torch.Tensor, vocab: int) -> torch.Tensor:
    """The MTP layers' output ``[B, H]`` -> logits ``[B, vocab]`` through the shared output layer, with
    the config's muP divisor and unpadded vocabulary applied as ``MtpModel`` applies them (config
    fields ``logits_mup_width_multiplier`` and ``unpadded_vocab_size``, transformers/modeling_layers.py);
    ids past the head's rows at -inf."""
    multiplier = getattr(mtp.config, "logits_mup_width_multiplier", None)
    if multiplier is not None:
        hidden = hidden / multiplier
    logits = mtp.shared_head(hidden).float()  # [B, V']
    unpadded = getattr(mtp.config, "unpadded_vocab_size", None)
    if unpadded is not None and unpadded < logits.shape[-1]:
        logits = logits[:, :unpadded]
    if logits.shape[-1] < vocab:
        logits = torch.nn.functional.pad(logits, (0, vocab - logits.shape[-1]), value=float("-inf"))
    return logits[:, :vocab]


class RowCache:
    """One row's MTP state: its ``MtpCache`` (columns ``low .. fed - 1`` of every layer) and what its last
    feed drafted (``drafted_at`` committed tokens then; ``seen`` the drafts its deeper layers took)."""

    def __init__(self, mtp: MtpModel, layers: int):
        self.cache = MtpCache(config=mtp.config)
        self.cache.activate_past_recording(recurrent_states_to_keep=layers)  # sliding layers can crop back
        self.fed = 0
        self.drafted_at = 0
        self.seen: list[int] = []

    def crop_to(self, columns: int) -> None:
        if self.fed > columns:
            self.cache.crop(-(self.fed - columns))
        self.fed = columns


@register_candidate_generator("mtp")
class MtpGenerator(CandidateGenerator):
    """``SpecDecoder(target, "mtp")``; ``mtp=``: an ``MtpModel`` built for the target (default: loaded from its
    checkpoint); ``schedule``: "auto" (the core's policy verifies as many of the block's drafts as pay) or "fixed"
    (every step offers all ``num_mtp_layers``)."""

    SCHEDULES = ("auto", "fixed")

    def __init__(self, *, mtp: MtpModel | None = None, schedule: str = "auto"):
        if schedule not in self.SCHEDULES:
            raise ValueError(f"mtp: schedule must be one of {self.SCHEDULES}, got {schedule!r}")
        if mtp is not None and not isinstance(mtp, MtpModel):
            raise TypeError(f"mtp: mtp= must be a transformers MtpModel, got {type(mtp).__name__}")
        self.mtp_source = mtp
        self.schedule = schedule
        self._loaded: dict = {}  # the decoder's MTP layers, per target, shared by its sessions

    def session(self) -> "MtpGenerator":
        fresh = super().session()
        fresh._loaded = self._loaded
        return fresh

    def drafting(self) -> DraftingInfo:
        # drafts come in blocks of num_mtp_layers (known once the target is): the policy is told the
        # most a block holds when the layers are at hand, and may verify fewer
        layers = len(self.mtp_source.layers) if self.mtp_source is not None else None
        if layers is None and len(self._loaded) == 1:
            layers = len(next(iter(self._loaded.values())).layers)
        cap = (layers or 4) if self.schedule == "auto" else None  # None: no policy, every step offers all
        # the MTP layers read the target's last hidden state (its final norm applied): known after setup
        last = getattr(self, "last", None)
        return DraftingInfo(MTP_PRIOR, cap, hidden_layers=(last,) if last is not None else ())

    def _mtp(self, target) -> MtpModel:
        key = id(target)
        if key not in self._loaded:
            if self.mtp_source is not None:
                check_fit(self.mtp_source, target)
                self._loaded[key] = self.mtp_source
            else:
                self._loaded[key] = load_mtp(target)
        return self._loaded[key]

    # -- a call ----------------------------------------------------------------------------------------
    def setup(self, ctx: DecodeContext) -> None:
        target = ctx.target
        self.layers = mtp_layer_count(target)  # refuses a target without MTP layers, before any forward
        self.last = target.config.get_text_config().num_hidden_layers  # output_hidden_states index
        self.mtp = self._mtp(target)
        if len(self.mtp.layers) != self.layers:
            raise ValueError(f"mtp: the MtpModel has {len(self.mtp.layers)} layers, the target's config "
                             f"num_mtp_layers = {self.layers}")
        self.vocab = vocab_size(target)
        self.dtype = self.mtp.layers[0].eh_proj.weight.dtype
        self.device = self.mtp.layers[0].eh_proj.weight.device  # where the MTP layers run (the target's last layer's)
        batch, device = ctx.batch_size, ctx.tokens.device
        self.rows = [RowCache(self.mtp, self.layers) for _ in range(batch)]
        self.hidden = torch.zeros(batch, ctx.tokens.shape[1] + 64, self.mtp.config.hidden_size, dtype=self.dtype,
                                  device=device)  # [B, capacity, H] the target's last hidden state by position
        self.low = torch.full((batch,), -1, dtype=torch.long, device=device)  # [B] first position known (-1: none)
        self.known = torch.zeros(batch, dtype=torch.long, device=device)  # [B] positions below are known
        self.forwards = 0

    @torch.no_grad()
    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        lengths = ctx.lengths.to(self.known.device)  # [B] committed tokens
        # a row drafts once the target's hidden states reach its last pair (token L - 2 with token L - 1)
        ready = (self.low >= 0) & (self.known >= lengths - 1) & (self.low <= lengths - 2)  # [B]
        limit = torch.where(ready, max_drafts.to(ready.device).clamp(0, self.layers), 0)  # [B]
        rows = [b for b in range(ctx.batch_size) if int(limit[b]) > 0]
        if not rows:
            return Proposal.empty(ctx.batch_size, max_drafts.device)
        inputs = {b: self._columns(ctx, b, int(lengths[b])) for b in rows}  # b -> (ids [1, T], hidden, positions)
        drafts, probs, confidence = [], [], []
        for layer in range(self.layers):
            logits = torch.zeros(ctx.batch_size, self.vocab, device=ctx.tokens.device)  # [B, V] (idle rows: 0)
            for b in rows:
                ids, hidden, positions = inputs[b]
                out = self.mtp.forward_layer(layer, hidden, positions, self.rows[b].cache, input_ids=ids)  # [1, T, H]
                logits[b] = head_logits(self.mtp, out[:, -1], self.vocab)[0].to(logits.device)
                inputs[b] = (ids, out, positions)
                self.forwards += 1
            scores = ctx.scores(logits, torch.stack(drafts, dim=1) if drafts else None)  # [B, V] processed
            if ctx.sampling.do_sample:
                p = ctx.probs(scores)  # [B, V]
                token = sample(p, ctx.generator)
                probs.append(p)
                confidence.append(p.gather(1, token[:, None]))
            else:  # the argmax (the first of equal maxima) and its softmax probability, without the softmax
                top, token = scores.max(dim=-1)
                confidence.append(torch.exp(scores - top[:, None]).sum(dim=-1, keepdim=True).reciprocal())
            drafts.append(token)
            if layer + 1 < self.layers:  # the next layer runs one token further: the draft is its newest
                for b in rows:
                    ids, out, positions = inputs[b]
                    inputs[b] = (torch.cat([ids[:, 1:], token[b].view(1, 1).to(ids.device)], dim=1), out, positions + 1)
        token_ids = torch.stack(drafts, dim=1)  # [B, layers]
        for b in rows:
            self.rows[b].drafted_at = int(lengths[b])
            self.rows[b].seen = token_ids[b, : self.layers - 1].tolist()
        return Proposal(token_ids.to(max_drafts.device), limit.to(max_drafts.device),
                        torch.stack(probs, dim=1) if probs else None, confidence=torch.cat(confidence, dim=1))

    def _columns(self, ctx: DecodeContext, b: int, length: int):
        """Row ``b`` with ``length`` committed tokens: crop its cache to the exact columns and return layer
        0's inputs for the rest up to ``length - 2``: ``ids [1, T]`` (each column's next token),
        ``hidden [1, T, H]`` (the target's, per column), ``positions [1, T]``."""
        row, low = self.rows[b], int(self.low[b])
        tokens = ctx.tokens[b, :length]
        row.fed = max(row.fed, low)  # an empty cache starts at the first known position
        keep = exact_columns(row.fed, row.drafted_at, row.seen, tokens, self.layers) if row.seen else row.fed
        keep = min(max(keep, low), length - 2)  # at least the last pair is fed: its output drafts
        row.crop_to(keep)
        columns = torch.arange(keep, length - 1, device=tokens.device)  # [T]
        ids = tokens[columns + 1][None]  # [1, T]
        hidden = self.hidden[b, keep: length - 1][None]  # [1, T, H]
        row.fed = length - 1
        return ids.to(self.device), hidden.to(self.device), (columns + 1)[None].to(self.device)

    @torch.no_grad()
    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        hidden = getattr(feedback, "hidden", None)
        if hidden is None:
            return
        states = hidden.states[self.last]  # [B, M, H]
        start, count = hidden.start.to(self.known.device), hidden.count.to(self.known.device)  # [B]
        end = start + count  # [B]
        need = int(end.max())
        if need > self.hidden.shape[1]:
            grown = self.hidden.new_zeros(self.hidden.shape[0], max(need, 2 * self.hidden.shape[1]), self.hidden.shape[2])
            grown[:, : self.hidden.shape[1]] = self.hidden
            self.hidden = grown
        columns = torch.arange(states.shape[1], device=start.device)[None, :]  # [1, M]
        valid = columns < count[:, None]  # [B, M]
        rows = torch.arange(states.shape[0], device=start.device)[:, None].expand_as(valid)
        self.hidden[rows[valid], (start[:, None] + columns)[valid]] = states.to(self.hidden)[valid]
        reported = count > 0
        self.low = torch.where(reported & (self.low < 0), start, self.low)
        self.known = torch.where(reported, torch.maximum(self.known, end), self.known)

    def select_rows(self, rows: torch.Tensor) -> None:
        kept = rows.tolist()
        self.rows = [self.rows[b] for b in kept]
        rows = rows.to(self.known.device)
        self.hidden, self.low, self.known = self.hidden[rows], self.low[rows], self.known[rows]

    def report(self) -> dict:
        return {"mtp_layers": self.layers, "mtp_forwards": self.forwards}
