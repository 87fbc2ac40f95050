"""Copies of a model at lower precision, as a generator drafts with them.

:class:`LowPrecisionDraft` is the option a generator mixes in to draft with a copy of its model
(``weights=``; the copies themselves are the engines' ``build_copy``); :class:`Copies` builds each
copy once per configured generator and, for ``weights="auto"`` on a CPU, has ``choose.py``
measure which copy is best on this machine.
"""

from __future__ import annotations

import threading
import time
import weakref

from ..compiled import check_compile_options, compiles_now
from ..engines import EAGER_ONLY_WEIGHTS, build_copy, check_copyable, check_weights, resolve_weights


class Copies:
    """The copies one configured generator built, per (model, weights); shared by its sessions."""

    def __init__(self):
        self._made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {weights: copy}
        self._choices: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> what "auto" chose
        self._lock = threading.Lock()

    def get(self, model, weights: str, prompt=None, draft_cache=None, tokenizer=None, budget: float | None = None,
            progress: bool | None = None):
        """The copy of ``model`` at ``weights``, built on first use. ``"auto"`` on a CPU is the copy
        measured best on this machine (``choose.py``), the first time for this machine and model
        (then remembered on disk), on a calibration text encoded by ``tokenizer`` or the model's own
        tokenizer where one is stored beside it, else on ``prompt`` (the call's first prompt row),
        within ``budget`` seconds (``choose.budget_seconds``), a progress bar as ``progress`` says."""
        with self._lock:
            made = self._made.setdefault(model, {})
            if weights not in made:
                made[weights] = self._build(model, weights, prompt, draft_cache, made, tokenizer, budget, progress)
            return made[weights]

    def _build(self, model, weights: str, prompt, draft_cache, made: dict, tokenizer, budget=None, progress=None):
        if any(p.is_meta for p in model.parameters()):
            raise ValueError(f"a low-precision copy is made from the target's weights, and {type(model).__name__} "
                             "keeps some offloaded (a device_map with 'cpu' or 'disk' entries: accelerate loads them "
                             "per forward); draft with prompt_lookup, suffix or a draft model instead")
        check_copyable(model)  # before "auto" tries every candidate on it
        if weights == "auto" and next(model.parameters()).device.type == "cpu":
            from . import choose

            device = next(model.parameters()).device
            sample = lambda: choose.calibration_ids(tokenizer, prompt, device, model=model)  # noqa: E731  only when measuring
            self._choices[model], built = choose.choose(model, sample, build_copy, draft_cache, budget=budget,
                                                        progress=progress)
            made.update(built)
            weights = self._choices[model].weights
        weights = resolve_weights(model, weights)
        if weights not in made:
            made[weights] = build_copy(model, weights)
        return made[weights]

    def choice(self, model):
        """What ``"auto"`` chose for ``model`` (a :class:`~specdec.copies.choose.Choice`), or None."""
        return self._choices.get(model)


class LowPrecisionDraft:
    """A generator whose draft may run as a low-precision copy of itself (``weights=``), built
    once per configured generator (its sessions share it) and stepped on a static cache, compiled
    as ``compile_draft`` says: True (compile on first use, said on stderr), False (eager), a dict
    of ``torch.compile`` options, or ``"auto"`` (the default for a copy): compiled in
    ``SpecDecoder.warmup()`` and in the calls after one, eager otherwise, so that no call compiles
    for minutes unasked."""

    def _init_precision(self, weights: str | None, compile_draft: bool | dict | str | None) -> None:
        if weights is not None:
            check_weights(weights, type(self).name or type(self).__name__)
        if compile_draft is not None and compile_draft != "auto" and not isinstance(compile_draft, (bool, dict)):
            raise TypeError(f"compile_draft must be True, False, 'auto' or a dict of torch.compile options, "
                            f"got {compile_draft!r}")
        if isinstance(compile_draft, dict):
            check_compile_options(compile_draft, "compile_draft")
        self.weights = weights
        self.compile_draft = ("auto" if weights is not None else False) if compile_draft is None else compile_draft
        self._copies = Copies()
        # how "auto" measures, where a generator offers them (self_draft): the time budget (None: the
        # default, choose.budget_seconds) and the progress bar (None: where stderr is a terminal)
        self.choice_budget: float | None = None
        self.choice_progress: bool | None = None

    def session(self):
        fresh = super().session()
        fresh._copies = self._copies  # a copy is built once per decoder, not per call
        return fresh

    def drafting_model(self, model, ctx=None):
        """The model that drafts for ``model``: itself, or its copy at ``self.weights`` (``"auto"``:
        the copy measured best here, on a calibration text ``ctx``'s tokenizer, or the model's own,
        encodes, else on the call's first prompt row). The seconds spent building or choosing it now
        are reported."""
        if self.weights is None:
            self._model = model
            return model
        started = time.perf_counter()
        prompt = None if ctx is None else ctx.tokens[0, : int(ctx.lengths[0])]
        draft = self._copies.get(model, self.weights, prompt, draft_cache=self._timing_cache(),
                                 tokenizer=None if ctx is None else ctx.tokenizer,
                                 budget=self.choice_budget, progress=self.choice_progress)
        self._model = draft
        self._setup_seconds = getattr(self, "_setup_seconds", 0.0) + time.perf_counter() - started
        chosen = self._copies.choice(model)
        self.resolved_weights = chosen.weights if self.weights == "auto" and chosen else resolve_weights(
            model, self.weights)
        self._choice = chosen if self.weights == "auto" else None
        return draft

    def report(self) -> dict:
        return {**super().report(), **self.precision_report()}

    def _timing_cache(self):
        """The cache a copy's draft step is timed on when choosing: the kind it drafts on, eagerly."""
        from ..kv import CacheSettings

        return CacheSettings.make("static") if self.weights is not None else None

    def precision_report(self) -> dict:
        """What the call's ``stats`` should say of the copy: its precision (and, for ``"auto"``, why)
        and the seconds spent building or choosing it in this call."""
        if self.weights is None:
            return {}
        out = {"setup_seconds": getattr(self, "_setup_seconds", 0.0),
               "weights": getattr(self, "resolved_weights", self.weights)}
        if getattr(self, "_choice", None) is not None:
            out["weights_choice"] = self._choice.reason
        return out

    def precision_attach_options(self, widths: tuple[int, ...] = (1, 2)) -> dict:
        """How the drafting model keeps its cache: a copy's on a static cache, stepped compiled
        (``compile_draft``) at ``widths`` (what it feeds a step: a draft, or the target's token
        after the last draft; wider forwards run eagerly, which for a quantized copy costs about
        what the model itself does); the model as given, the call's own unless ``compile_draft``.
        A copy is this generator's own (built by it, changed by nothing), so its compiled steps
        skip dynamo's guards on its modules."""
        if self.weights is None and not self.compile_draft:
            return {}
        compiles = self.compile_draft
        if compiles == "auto":  # after (or in) a warm-up only: never a silent compile in a call
            compiles = getattr(self, "_model", None) is not None and compiles_now(self._model)
        compiles = compiles if getattr(self, "resolved_weights", None) not in EAGER_ONLY_WEIGHTS else False
        return {"cache_implementation": "static", "compile": compiles, "compile_widths": widths,
                "owned": self.weights is not None}
