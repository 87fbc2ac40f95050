"""What ``weights="auto"`` measures: the calibration tokens, and models timed stepping through them.

The target and a copy step through the last :data:`STEPS` calibration tokens one at a time, as a
draft does, on caches of the kinds they run on (:class:`StepTimer`): each model once a round, the
order rotating from round to round, the target's wider forwards (:data:`WIDTHS`) timed in turn, a
copy no faster than the target timed no further (:func:`interleaved`). Each step keeps the model's
greedy next token, for the agreement ``choose.py`` rates a copy by.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

#: the widths of the target's forwards timed besides its one-token steps: the cost of verifying
#: drafts, and the draft-length policy's calibration (``specdec.policy.costs.CALIBRATED``)
WIDTHS = (2, 4, 16)
#: calibration tokens each model steps through one at a time, timed and compared: a draft steps one
#: token at a time, and a copy whose activations are quantized per tensor (torch's dynamic int8)
#: agrees with the target far less over a many-token forward than in one-token steps
STEPS = 16
#: after this many rounds a copy whose median step is no faster than the target's is no longer
#: timed: it cannot pay at any agreement
PRUNE_AFTER = 4
#: once a stage has a single copy left (the others dropped as no faster than the target), it is
#: timed this many steps and no more: its figures are compared with nothing, they only price it
LONE_STEPS = 8
#: the rounds a copy is timed even past the budget: one median needs some, and a choice needs a copy
MIN_ROUNDS = 2
#: a text to measure agreement on, when a tokenizer can encode it (else the call's prompt)
CALIBRATION_TEXT = (
    "The city council met on Tuesday to discuss the new budget. After a long debate, the members agreed "
    "to spend more on public transport and less on road repairs. Here is a short summary of the plan:\n"
    "1. Buses will run every ten minutes during rush hour.\n2. Two new bike lanes will open next spring.\n"
    "3. The price of a monthly pass will stay the same.\nIn Python, the function below returns the sum of "
    "a list of numbers:\n\ndef total(numbers):\n    result = 0\n    for n in numbers:\n        result += n\n"
    "    return result\n")


# -- timing -------------------------------------------------------------------------------------
class StepTimer:
    """A model stepping through the calibration tokens ``ids [1, L]`` one at a time, as a draft
    does, through the cache backends decoding uses (``specdec.kv``): prefilled with all but the
    last ``steps`` tokens, then :meth:`step` feeds the next one (timed, its greedy next token
    kept); :meth:`time` times a wider forward and rolls it back."""

    def __init__(self, model, ids: torch.Tensor, steps: int, cache=None):
        from ..kv import make_kv
        from ..modelinfo import cache_argument

        self.model = model
        self.start = self.position = ids.shape[1] - steps
        room = max(WIDTHS)  # the widest timed forward goes past the text's end: its first tokens again
        self.ids = torch.cat([ids, ids.repeat(1, room // ids.shape[1] + 1)[:, :room]], dim=1)
        self.kv = make_kv(model, 1, self.ids.shape[1] + 1, cache)
        self.cache_kwarg = cache_argument(model)
        with torch.no_grad():
            logits = self._forward(0, self.position, True, keep=0)  # [1, start, V]
        # the greedy next token at each prefilled position, compared for agreement too, except for a
        # model quantizing a forward's activations per tensor: its many-token forward is not a draft's
        per_tensor = any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in model.modules())
        self.prefilled = [None] * self.start if per_tensor else logits[0].argmax(-1).tolist()

    def _forward(self, start: int, width: int, first: bool = False, keep: int | None = None) -> torch.Tensor:
        from ..engines import measuring

        with measuring():  # no sign of use: these forwards do not get the target's weights packed
            return self._fed(start, width, first, width if keep is None else keep)

    def _fed(self, start: int, width: int, first: bool, keep: int) -> torch.Tensor:
        fed = self.kv.padded_width(width, first)
        kwargs = {"input_ids": self.ids[:, start: start + fed],
                  "position_ids": torch.arange(start, start + fed)[None, :],
                  self.cache_kwarg: self.kv.cache, "use_cache": True, "logits_to_keep": keep}
        mask = lambda slots: (torch.arange(slots) < start + width).long()[None, :]  # noqa: E731
        return self.kv.forward(self.model, kwargs, first_slot=start, width=width, first=first, mask=mask,
                               needs_mask=False, direct=True)

    def step(self) -> tuple[float, int]:
        """Feed the next calibration token: (seconds, the greedy next token after it)."""
        started = time.perf_counter()
        with torch.no_grad():
            logits = self._forward(self.position, 1)  # [1, 1, V]
        seconds = time.perf_counter() - started
        self.position += 1
        return seconds, int(logits[0, -1].argmax())

    def time(self, width: int) -> float:
        """Seconds of one forward of ``width`` tokens at the current position (then rolled back)."""
        started = time.perf_counter()
        with torch.no_grad():
            self._forward(self.position, width)
        seconds = time.perf_counter() - started
        self.kv.crop(self.position + width, self.position)
        return seconds

    def rewind(self) -> "StepTimer":
        """Back to the first timed token (the cache keeps the prefill); -> this timer."""
        self.kv.crop(self.position, self.start)
        self.position = self.start
        return self

    def release(self) -> None:
        self.kv.release()


def interleaved(timers: dict[str, StepTimer], steps: int, prune_after: int | None = None,
                out_of_time: Callable[[], bool] | None = None, tick: Callable[[int], None] | None = None,
                ) -> tuple[dict[str, float], dict[str, list[int]], dict[int, list[float]]]:
    """Every model of ``timers`` (the target's named ``"target"``) steps through ``steps`` tokens,
    one step each a round, the order rotating from round to round; the target's forward of one of
    :data:`WIDTHS` tokens is timed each round, the widths in turn. After ``prune_after`` rounds a
    model whose median step is no shorter than the target's steps no more (its figures are those
    of the rounds it ran), and where one copy is left, measuring ends after :data:`LONE_STEPS`
    rounds (the choice among them cannot change); after :data:`MIN_ROUNDS` it ends as soon as
    ``out_of_time()`` says so (the time budget). ``tick(r)`` after each round r (progress).
    -> ({name: median step seconds}, {name: greedy tokens}, {width: the target's seconds at that
    width, each time})."""
    names = list(timers)
    for timer in timers.values():
        timer.time(1)  # first-use work (kernel selection, allocation) is not a step's cost
    timers["target"].time(max(WIDTHS))
    times: dict[str, list[float]] = {name: [] for name in names}
    tops: dict[str, list[int | None]] = {name: list(timers[name].prefilled) for name in names}
    wide: dict[int, list[float]] = {width: [] for width in WIDTHS}
    for r in range(steps):
        if r == prune_after:
            target = statistics.median(times["target"])
            names = [n for n in names if n == "target" or statistics.median(times[n]) < target]
        if len(names) == 1 or (prune_after is not None and r >= max(prune_after, LONE_STEPS) and len(names) <= 2):
            break  # no copy left to time, or one whose figures are compared with no other's
        if out_of_time is not None and r >= MIN_ROUNDS and out_of_time():
            break  # the budget is spent: these rounds are what the choice is made from
        for name in names[r % len(names):] + names[: r % len(names)]:
            seconds, top = timers[name].step()
            times[name].append(seconds)
            tops[name].append(top)
        width = WIDTHS[r % len(WIDTHS)]
        wide[width].append(timers["target"].time(width))
        if tick is not None:
            tick(r)
    return {name: statistics.median(t) for name, t in times.items()}, tops, wide


# -- the calibration tokens ----------------------------------------------------------------------
def calibration_ids(tokenizer, fallback: torch.Tensor | None, device, longest: int = 128, model=None) -> torch.Tensor:
    """[1, L] the calibration tokens: :data:`CALIBRATION_TEXT` encoded by ``tokenizer``, or by
    ``model``'s own tokenizer where one is stored beside its weights (:func:`stored_tokenizer`),
    else ``fallback`` (the call's first prompt row, often too short to tell copies apart), at most
    ``longest`` tokens."""
    ids = None
    if tokenizer is None and model is not None:
        tokenizer = stored_tokenizer(model)
    if tokenizer is not None:
        try:
            ids = torch.as_tensor(tokenizer(CALIBRATION_TEXT)["input_ids"], dtype=torch.long)
        except Exception:  # a tokenizer that cannot encode plain text: use the prompt
            ids = None
    if ids is None or ids.numel() < 8:
        ids = fallback.reshape(-1) if fallback is not None and fallback.numel() >= 2 else torch.arange(2, 34)
    return ids[:longest].reshape(1, -1).to(device)


def stored_tokenizer(model):
    """The tokenizer saved with ``model``'s weights (its ``name_or_path``, read from disk only:
    nothing is downloaded), or None."""
    path = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # no tokenizer stored there (or none this transformers can read)
        return None
