"""Training an EAGLE-3 head for a target: ``specdec train-head`` and :func:`train_head`.

The pipeline, each part resumable from ``out``:

1. prompts (with ``synthetic_prompts``, also user turns the target writes itself,
   ``out/synthetic_prompts.jsonl``) -> the target's own greedy answers (``data.py``,
   ``out/answers.jsonl``), and the standard library's documentation as plain text
   (``doc_text_tokens``; the target's distribution at every position of it is a label as good
   as any);
2. the draft vocabulary: the ``draft_vocab_size`` most frequent ids in the answers (the prompts'
   ids too when the answers hold fewer distinct ids), ``d2t``/``t2d`` of the head;
3. training, step by step: a batch of answered sequences goes through the target once (no
   gradient) for its hidden states at the head's ``aux_layers`` and its next-token
   distributions (kept in memory up to ``feature_bytes``, so later epochs skip the target; nothing
   is written to disk), then the head runs ``depth`` draft steps over every position at once
   (*training-time test*: step ``k`` takes the head's own outputs of step ``k - 1`` as its
   features, and its queries attend to the committed positions' keys of step 0 plus their own
   keys of steps 1..k, exactly what they attend to when drafting ``k`` tokens ahead). The loss
   at each step is the cross-entropy against the target's distribution over the draft
   vocabulary (its top ``TOP_K``), on positions whose next token is part of an answer, weighted
   ``0.8 ** k``; the progress bar shows the loss and each step's top-1 agreement with the target;
4. every ``checkpoint_seconds`` and at the end, ``out/checkpoint.pt`` (head, optimizer, step,
   seconds spent, data order); a rerun resumes from it. The head is written in SpecForge's
   layout (bfloat16 safetensors) to ``out/head/`` (``layouts.save_head``).

Initialisation: the head's ``lm_head`` rows and final norm are the target's own for the draft
vocabulary; the head embeds tokens with the target's (frozen) input embeddings.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from .data import (documentation_prompts, documentation_text, evaluated_question_ids, held_out_prompts, read_jsonl,
                   self_distill, synthetic_prompts)
from .head import Eagle3Head, HeadConfig

#: the target's most likely draft-vocabulary tokens kept per position as the soft label
TOP_K = 16


@dataclass
class TrainSettings:
    steps: int | None = None  # optimizer steps to stop at (None: no limit)
    minutes: float | None = None  # training minutes to stop at, this run and earlier ones together
    draft_vocab_size: int = 8192
    depth: int = 4  # training-time-test steps (drafts ahead) per position
    batch_tokens: int = 4096  # tokens per optimizer step, padding included
    max_length: int = 1024  # a longer sequence keeps its last max_length tokens
    lr: float = 1e-3
    warmup: int = 30
    answer_tokens: int = 256
    max_prompt_tokens: int = 512  # a longer prompt is not answered (generating over it costs most)
    generate_batch: int = 16
    feature_bytes: int = 4 << 30  # memory for the target's features of earlier batches
    checkpoint_seconds: float = 120.0
    seed: int = 0
    doc_prompts: int = 200
    doc_text_tokens: int = 200_000  # the standard library's documentation read as text (data.documentation_text)
    synthetic_prompts: int = 0  # user turns the target writes itself, answered too (data.synthetic_prompts)

    def __post_init__(self):
        if self.steps is None and self.minutes is None:
            raise ValueError("train-head needs a limit: steps, minutes or both")
        if self.steps is not None and self.steps < 1 or self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"steps must be >= 1 and minutes > 0, got steps={self.steps}, minutes={self.minutes}")
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if isinstance(self.synthetic_prompts, bool) or not isinstance(self.synthetic_prompts, int) \
                or self.synthetic_prompts < 0:
            raise ValueError(f"synthetic_prompts must be an int >= 0, got {self.synthetic_prompts!r}")


# -- the training-time test -------------------------------------------------------------------------
def ttt_loss(head: Eagle3Head, embed, aux: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
             answer: torch.Tensor, top_ids: torch.Tensor, top_probs: torch.Tensor, depth: int):
    """One batch's loss over ``depth`` draft steps.

    ``aux [B, T, 3 H]`` the target's hidden states at the head's layers, concatenated; ``ids [B, T]``;
    ``valid [B, T]`` real tokens (right padding false); ``answer [B, T]`` tokens the target wrote;
    ``top_ids, top_probs [B, T, K]``: at position p, the target's distribution over the next
    token (draft-vocabulary ids, probabilities). -> (loss, accuracy per step [depth], counts [depth])."""
    batch, length = ids.shape
    bases = length - 1  # base t pairs the feature of token t with token t + 1
    t = torch.arange(bases, device=ids.device)
    features = head.fc(aux[:, :bases])  # [B, T', H]
    causal = (t[None, :] <= t[:, None])[None] & valid[:, None, :bases]  # [B, T', T'] base t sees base s <= t
    keys, values = [], []
    losses, accuracy, counts = [], [], []
    for k in range(depth):
        token_at = (t + k + 1).clamp(max=length - 1)  # [T'] the token each base's step-k pair holds
        tokens = ids[:, token_at]  # [B, T']
        positions = (t + k)[None, :].expand(batch, -1)
        q, key, value = head.project(features, embed(tokens), positions)  # [B, h, T', d], [B, g, T', d] x2
        keys.append(key)
        values.append(value)
        attended = _ttt_attention(q, keys, values, causal, head.scale)
        hidden = head.finish(attended, features)  # [B, T', H]
        logits = head.logits(hidden).float()  # [B, T', Vd]
        label_at = (t + k + 1).clamp(max=length - 1)  # the target's distribution after that token
        inside = (t + k + 2 < length)[None, :]
        mask = inside & valid[:, (t + k + 2).clamp(max=length - 1)] & answer[:, (t + k + 2).clamp(max=length - 1)]
        probs, labels = top_probs[:, label_at].float(), top_ids[:, label_at]  # [B, T', K]
        log_q = F.log_softmax(logits, dim=-1).gather(2, labels)  # [B, T', K]
        per_position = -(probs * log_q).sum(-1)  # [B, T']
        n = mask.sum()
        losses.append((per_position * mask).sum() / n.clamp(min=1) * 0.8 ** k)
        hit = (logits.argmax(-1) == labels[..., 0]) & mask
        accuracy.append(hit.sum().float() / n.clamp(min=1))
        counts.append(n)
        features = hidden  # the next step's feature at each base: this step's output
    return sum(losses), torch.stack(accuracy).detach(), torch.stack(counts)


def _ttt_attention(q: torch.Tensor, keys: list, values: list, causal: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries of step k (``q [B, h, T', d]``) over step 0's keys at bases ``s <= t`` and their own
    base's keys of steps 1..k (``keys[j], values[j] [B, g, T', d]``) -> ``[B, h, T', d]``."""
    repeat = q.shape[1] // keys[0].shape[1]
    grow = (lambda x: x.repeat_interleave(repeat, dim=1)) if repeat > 1 else (lambda x: x)  # noqa: E731
    k0, v0 = grow(keys[0]), grow(values[0])
    scores = (q @ k0.transpose(-1, -2)).float() * scale  # [B, h, T', T']
    scores = scores.masked_fill(~causal[:, None], float("-inf"))
    diagonal = [((q * grow(k)).sum(-1).float() * scale)[..., None] for k in keys[1:]]  # [B, h, T', 1] each
    weights = torch.softmax(torch.cat([scores, *diagonal], dim=-1), dim=-1).to(q.dtype)
    out = weights[..., : scores.shape[-1]] @ v0
    for j, v in enumerate(values[1:]):
        out = out + weights[..., scores.shape[-1] + j, None] * grow(v)
    return out


# -- the target's side ------------------------------------------------------------------------------
@torch.no_grad()
def target_features(model, ids: torch.Tensor, valid: torch.Tensor, aux_layers, draft_ids: torch.Tensor):
    """-> (aux [B, T, 3 H] in bfloat16, top_ids [B, T, K] draft-vocabulary ids, top_probs [B, T, K])."""
    out = model(input_ids=ids, attention_mask=valid.long(), output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1).to(torch.bfloat16)
    probs = torch.softmax(out.logits.float(), dim=-1)[..., draft_ids]  # [B, T, Vd]
    top_probs, top_ids = probs.topk(min(TOP_K, probs.shape[-1]), dim=-1)
    return aux, top_ids.to(torch.int32), top_probs.to(torch.float16)


def draft_vocabulary(sequences: list[dict], size: int, vocab: int) -> torch.Tensor:
    """The ``size`` ids most frequent in the answers (then in the prompts, then the lowest ids), sorted."""
    answers, prompts = torch.zeros(vocab, dtype=torch.long), torch.zeros(vocab, dtype=torch.long)
    for r in sequences:
        ids = torch.tensor(r["ids"], dtype=torch.long)
        answers += torch.bincount(ids[r["prompt_length"]:], minlength=vocab)[:vocab]
        prompts += torch.bincount(ids[: r["prompt_length"]], minlength=vocab)[:vocab]
    rank = answers.float() * (vocab + 1) + prompts.float().clamp(max=vocab) + (1 - torch.arange(vocab) / vocab)
    return rank.topk(size).indices.sort().values


# -- the loop -----------------------------------------------------------------------------------------
def train_head(target, tokenizer, out: str | Path, settings: TrainSettings, *, head_config: HeadConfig | None = None,
               prompts: list[dict] | None = None, progress: bool = True, target_name: str = "") -> Path:
    """Train (or resume training) a head for ``target`` into ``out``; -> the folder of the head
    (``out/head``, SpecForge's layout). ``prompts``: records ``{"key", "turns"}`` (default: the
    held-out Spec-Bench questions and the standard library's documentation, ``data.py``)."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(settings.seed)
    records = _training_records(target, tokenizer, out, settings, prompts, progress)
    checkpoint_path = out / "checkpoint.pt"
    state = torch.load(checkpoint_path, weights_only=False) if checkpoint_path.is_file() else None
    head = _head(target, records, settings, head_config, state)
    draft_ids = head.target_ids(torch.arange(head.config.draft_vocab_size))
    table = target.get_input_embeddings()
    embed = lambda tokens: table(tokens).detach()  # noqa: E731  (the target's, frozen)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    batches = _batches(records, settings)
    step, spent, order, cursor = _resume(state, optimizer, len(batches), settings.seed, out / "log.jsonl")
    features = _Features(settings.feature_bytes)
    started, saved = time.perf_counter() - spent, time.perf_counter()
    bar = tqdm(total=settings.steps, initial=step, desc="train-head", unit="step", disable=not progress)

    def checkpoint() -> None:
        _save_checkpoint(checkpoint_path, head, optimizer, settings, target_name, step=step,
                         seconds=time.perf_counter() - started, order=order, cursor=cursor)

    head.train()
    while (fraction := _progress(settings, step, time.perf_counter() - started)) < 1.0:
        if cursor >= len(order):
            order, cursor = _shuffled(len(batches), settings.seed, step), 0
        index = order[cursor]
        ids, valid, answer = batches[index]
        aux, top_ids, top_probs = features.get(index, lambda: target_features(target, ids, valid,
                                                                              head.config.aux_layers, draft_ids))
        loss, accuracy, _ = ttt_loss(head, embed, aux.float(), ids, valid, answer, top_ids.long(), top_probs,
                                     settings.depth)
        loss = _update(optimizer, params, loss, _learning_rate(settings, step, fraction))
        step, cursor = step + 1, cursor + 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", acc="/".join(f"{float(a):.2f}" for a in accuracy))
        _log(out, step, loss, accuracy, time.perf_counter() - started)
        if time.perf_counter() - saved >= settings.checkpoint_seconds:
            checkpoint()
            saved = time.perf_counter()
    bar.close()
    checkpoint()
    return _export(head, out)


def _export(head, out: Path) -> Path:
    """The trained head, in bfloat16, as ``out/head`` (SpecForge's layout) -> that folder."""
    from .layouts import save_head

    head.eval()
    folder = out / "head"
    save_head(head.to(torch.bfloat16), folder, layout="specforge")
    return folder


def _resume(state: dict | None, optimizer, batches: int, seed: int, log: Path) -> tuple[int, float, list[int], int]:
    """(step, seconds spent, batch order, cursor into it) from a checkpoint's ``state`` (its
    optimizer state loaded), or a fresh start; an order of another batch count is drawn again.
    The ``log`` is cut back to the steps up to that one (steps logged after the last checkpoint
    are run again)."""
    step, spent, order, cursor = 0, 0.0, None, 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        step, spent, order, cursor = state["step"], state["seconds"], state["order"], state["cursor"]
    if order is None or len(order) != batches:
        order, cursor = _shuffled(batches, seed, step), 0
    if log.is_file():
        log.write_text("".join(json.dumps(row) + "\n" for row in read_jsonl(log) if row["step"] <= step))
    return step, spent, order, cursor


def _save_checkpoint(path: Path, head, optimizer, settings: TrainSettings, target_name: str, **progress) -> None:
    """Everything a rerun resumes from (the head, the optimizer, ``progress``: step, seconds, order,
    cursor), written to a temporary file and renamed, so an interrupted save loses nothing."""
    partial = path.with_suffix(".tmp")
    torch.save({"config": head.config.to_dict(), "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                **progress, "settings": asdict(settings), "target": target_name}, partial)
    partial.replace(path)


def _update(optimizer, params: list, loss: torch.Tensor, lr: float) -> float:
    """One optimizer step on ``loss`` at learning rate ``lr`` (gradients clipped to norm 0.5) -> the
    loss as a float."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    optimizer.step()
    return float(loss.detach())


def _training_records(target, tokenizer, out: Path, settings: TrainSettings, prompts: list[dict] | None,
                      progress: bool) -> list[dict]:
    """The sequences to train on: the target's answers (generated, or read back from ``out``) and
    the documentation text; a ValueError when there are none."""
    if prompts is None:
        prompts = default_prompts(settings.doc_prompts)
    if settings.synthetic_prompts:
        prompts = prompts + synthetic_prompts(target, tokenizer, settings.synthetic_prompts,
                                              out / "synthetic_prompts.jsonl", seed=settings.seed,
                                              batch_size=settings.generate_batch, progress=progress)
    records = self_distill(target, tokenizer, prompts, out / "answers.jsonl", answer_tokens=settings.answer_tokens,
                           batch_size=settings.generate_batch, max_prompt_tokens=settings.max_prompt_tokens,
                           progress=progress)
    records = [r for r in records if len(r["ids"]) - r["prompt_length"] >= 2]
    if settings.doc_text_tokens:
        records += documentation_text(tokenizer, settings.doc_text_tokens)
    if not records:
        raise ValueError("train-head: no answers to train on (every prompt was too long or answered nothing)")
    return records


def _head(target, records: list[dict], settings: TrainSettings, head_config: HeadConfig | None,
          state: dict | None) -> Eagle3Head:
    """The head a checkpoint holds, or a new one: shaped like the target's layers, its draft
    vocabulary from ``records``, its output layer and final norm the target's."""
    if state is not None:
        head = Eagle3Head(HeadConfig(**state["config"]))
        head.load_state_dict(state["head"])
        return head
    vocab = target.config.get_text_config().vocab_size
    head = Eagle3Head(head_config or HeadConfig.for_target(target.config, min(settings.draft_vocab_size, vocab)))
    head.set_vocab(draft_vocabulary(records, head.config.draft_vocab_size, vocab))
    _init_from_target(head, target)
    return head


class _Features:
    """The target's features of each batch (by index), kept while they fit in ``limit`` bytes."""

    def __init__(self, limit: int):
        self.limit, self.held, self.kept = limit, 0, {}

    def get(self, index: int, compute):
        if index in self.kept:
            return self.kept[index]
        computed = compute()
        size = sum(x.numel() * x.element_size() for x in computed)
        if self.held + size <= self.limit:
            self.kept[index], self.held = computed, self.held + size
        return computed


def _progress(settings: TrainSettings, step: int, seconds: float) -> float:
    """How far through its limits the run is: 1.0 (or more) once ``steps`` or ``minutes`` is reached."""
    return max(step / settings.steps if settings.steps else 0.0,
               seconds / (settings.minutes * 60) if settings.minutes else 0.0)


def default_prompts(doc_prompts: int = 200) -> list[dict]:
    """The held-out Spec-Bench questions (none a committed benchmark config evaluates) and the
    standard library's documentation (``data.py``)."""
    from specdec.prompts import load_questions

    root = Path(__file__).resolve().parents[2]
    folders = [root / "benchmarks" / "configs", root / "specdec" / "bench" / "configs"]
    prompts = held_out_prompts(load_questions(), evaluated_question_ids([f for f in folders if f.is_dir()]))
    return prompts + documentation_prompts(doc_prompts)


def _init_from_target(head: Eagle3Head, target) -> None:
    """The head's output layer and final norm start as the target's own, for its draft vocabulary."""
    with torch.no_grad():
        rows = head.target_ids(torch.arange(head.config.draft_vocab_size))
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[rows].float())
        norm = getattr(getattr(target, "model", None), "norm", None)
        if norm is not None and norm.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm.weight.float())


def _batches(records: list[dict], settings: TrainSettings) -> list[tuple[torch.Tensor, ...]]:
    """Sequences grouped by length into batches of about ``batch_tokens`` tokens (right padded) ->
    (ids [B, T], valid [B, T], answer [B, T]) each."""
    rows = []
    for r in records:
        ids = r["ids"][-settings.max_length:]
        cut = len(r["ids"]) - len(ids)
        rows.append((ids, max(r["prompt_length"] - cut, 0)))
    rows.sort(key=lambda row: len(row[0]))
    out, i = [], 0
    while i < len(rows):
        width = len(rows[i][0])
        count = 1
        while i + count < len(rows) and (count + 1) * len(rows[i + count][0]) <= settings.batch_tokens:
            count += 1
        chunk = rows[i: i + count]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        valid = torch.zeros(len(chunk), width, dtype=torch.bool)
        answer = torch.zeros_like(valid)
        for b, (row, prompt_length) in enumerate(chunk):
            ids[b, : len(row)] = torch.tensor(row)
            valid[b, : len(row)] = True
            answer[b, prompt_length: len(row)] = True
        out.append((ids, valid, answer))
        i += count
    return out


def _shuffled(count: int, seed: int, step: int) -> list[int]:
    order = list(range(count))
    random.Random(seed * 1_000_003 + step).shuffle(order)
    return order


def _learning_rate(settings: TrainSettings, step: int, fraction: float) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine decay to a tenth by the end of the limit."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(fraction, 1.0))))


def _log(out: Path, step: int, loss: float, accuracy: torch.Tensor, seconds: float) -> None:
    with (out / "log.jsonl").open("a") as f:
        f.write(json.dumps({"step": step, "loss": round(loss, 4), "accuracy": [round(float(a), 4) for a in accuracy],
                            "seconds": round(seconds, 1)}) + "\n")
