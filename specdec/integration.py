"""Speculative decoding inside ``model.generate()`` and pipelines: ``custom_generate=specdec.generate``.

``transformers`` (5.24) lets a callable replace ``generate()``'s decoding loop: ``generate()``
prepares the generation config, special tokens, attention mask, logits processors (warpers
included) and stopping criteria as usual, then calls ``custom_generate(model, input_ids,
logits_processor=, stopping_criteria=, generation_config=, synced_gpus=, streamer=,
**model_kwargs)``; keyword arguments named in the callable's signature and not in ``_sample``'s
are passed through to it. So::

    model.generate(**inputs, custom_generate=specdec.generate, draft="prompt_lookup")
    pipeline("text-generation", model=model, tokenizer=tok)(text, custom_generate=specdec.generate,
                                                            draft=small_model)

run the same :class:`~specdec.run.DecodeRun` as ``SpecDecoder(model, draft).generate(...)``
(through :meth:`SpecDecoder.run`): the processors ``generate()`` built apply at every verified
position, its stopping criteria stop the run (max length and EOS as the run's own budget and end
ids, any other criterion checked token by token), and the output is ``generate()``'s: the
sequences, or with ``return_dict_in_generate=True`` a ``GenerateDecoderOnlyOutput`` (scores and
logits when asked) carrying ``stats``. The same callable is what the Hub-layout folder
``hub/specdec_custom_generate`` loads (``custom_generate="<that folder>", trust_remote_code=True``).

What outlives a call is kept per target model (:class:`Drafters`): the candidate generator each
draft *name* (with its options) resolves to, with what it builds once (a low-precision copy of
the target), so repeated calls do not rebuild it. The table is bounded: targets are held weakly,
at most :data:`MAX_DRAFTERS` drafters a target (least recently used dropped), and a draft given
as a model is never kept past its call (its generator holds it). A lock guards the table; each
call still decodes on a session of its own, so calls from several threads share the drafter, not
their state. :func:`release` drops them. The forward-cost curves the draft-length policy measures
are kept per model by the policy itself (weakly: they go with the model).

Two things ``generate()`` (5.25) does not hand a callable: the ``streamer`` (it gives it the
prompt, then drops it from the callable's arguments) and the ``tokenizer``, even where the
callable's signature names it, so ``stop_strings`` fail inside ``generate()`` before the callable
runs. The streamer is read from ``generate()``'s own frame; stop strings are given as the criterion
``generate()`` would build from them, ``stopping_criteria=[StopStringCriteria(tokenizer,
strings)]`` (the Hub-layout folder makes that criterion itself); a draft with another tokenizer
takes both tokenizers as ``target_tokenizer=`` and ``draft_tokenizer=``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .decoder import SpecDecoder
from .distributed import Ranks, coordinated
from .generation import resolved
from .generators import CandidateGenerator
from .names import did_you_mean
from .processors import with_user_processor
from .return_sequences import grammars_per_row
from .validation import check_generation_config

#: drafters kept per target model, the most recently used first: a call with another draft name,
#: other options or other tokenizers builds one more, and the least recently used goes
MAX_DRAFTERS = 4


class Drafters:
    """The candidate generators built for ``custom_generate`` calls, per target model and draft.

    Bounded, so that no sequence of calls grows it: the table holds each target weakly (a target
    that goes away takes its drafters with it) and at most :data:`MAX_DRAFTERS` drafters a
    target, least recently used dropped first. Only a draft given by name (or generator class,
    or None) is kept: a draft given as an object (a draft model) is the caller's, and its
    generator, which holds it, is built for the call alone, so the table never keeps a user's
    model alive (12 calls with 12 fresh draft models once kept all 12). A caller who wants a draft
    model's generator (and a low-precision copy it builds) kept passes a generator instance, or
    uses ``SpecDecoder``."""

    def __init__(self, limit: int = MAX_DRAFTERS):
        self.limit = limit
        # model -> {key: (generator, what its key names by id: kept alive with it, so no id is reused)}
        self._made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def decoder(self, model, draft, options: dict, tokenizer, draft_tokenizer, decoder_options: dict) -> SpecDecoder:
        """A decoder for this call: a new ``SpecDecoder`` around the generator ``draft`` resolved to
        for ``model`` (kept for later calls where ``draft`` is a name; a generator instance is
        taken as it is)."""
        if isinstance(draft, CandidateGenerator):
            if options:
                raise TypeError(f"draft_options {sorted(options)} cannot be applied to a generator instance")
        elif (isinstance(draft, (str, type)) or draft is None) and plain(options) and plain(decoder_options):
            draft = self._kept(model, draft, options, tokenizer, draft_tokenizer, decoder_options)
        else:  # the caller's object (a draft model, or one among the options): built for this call, not kept
            return SpecDecoder(model, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer,
                               **decoder_options, **options)
        return SpecDecoder(model, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer, **decoder_options)

    def _kept(self, model, name, options: dict, tokenizer, draft_tokenizer, decoder_options: dict):
        """The generator ``name`` (or a generator class) resolves to for ``model`` with these
        options and tokenizers, built on first use and kept (least recently used dropped past
        ``limit``)."""
        key = (name, repr(sorted(options.items())), id(tokenizer), id(draft_tokenizer),
               repr(sorted(decoder_options.items())))
        with self._lock:
            made = self._made.setdefault(model, OrderedDict())
            if key not in made:
                generator = SpecDecoder(model, name, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer,
                                        **decoder_options, **options).candidate_generator
                made[key] = (generator, (tokenizer, draft_tokenizer, options, decoder_options))
                while len(made) > self.limit:
                    made.popitem(last=False)
            made.move_to_end(key)
            return made[key][0]

    def release(self, model=None) -> None:
        """Drop the drafters built for ``model`` (all models when None)."""
        with self._lock:
            if model is None:
                self._made.clear()
            else:
                self._made.pop(model, None)

    def count(self, model) -> int:
        with self._lock:
            return len(self._made.get(model, {}))

    def generators(self, model) -> list:
        """The generators kept for ``model``, least recently used first."""
        with self._lock:
            return [generator for generator, _ in self._made.get(model, {}).values()]


DRAFTERS = Drafters()


def plain(value) -> bool:
    """Whether ``value`` is told apart from any other by its ``repr`` alone: None, numbers, strings,
    paths, dtypes, and lists, tuples, sets, dicts and frozen dataclasses of them (an object's
    ``repr``, a module's above all, can be the same for two different ones)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, os.PathLike, torch.dtype)):
        return True
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and value.__dataclass_params__.frozen:
        return plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return all(plain(k) and plain(v) for k, v in value.items())
    return isinstance(value, (list, tuple, set, frozenset)) and all(plain(v) for v in value)


def release(model=None) -> None:
    """Free what ``custom_generate`` calls kept for ``model`` (every model when None): the resolved
    drafters and the copies they built. The next call builds them again."""
    DRAFTERS.release(model)


def generate(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
             streamer=None, draft=None, draft_options: dict | None = None, target_tokenizer=None,
             draft_tokenizer=None, generator: torch.Generator | None = None, decoder_options: dict | None = None,
             grammar=None, draft_call_options: dict | None = None, **model_kwargs) -> Any:
    """``model.generate(..., custom_generate=specdec.generate, draft=...)``: the decoding loop, speculative.

    ``draft`` is anything ``SpecDecoder`` takes (a registered generator name, a draft model, a
    ``CandidateGenerator``; None decodes plainly through the same loop), ``draft_options`` its
    options (``{"num_tokens": 4}``); ``decoder_options`` ``SpecDecoder``'s own (``cache_implementation``,
    ``compile``, ``fast_head``, ``engine``, ``distributed``); ``generator`` a ``torch.Generator`` for
    the sampling's randomness; ``grammar`` what ``SpecDecoder.generate`` takes (compiled for
    ``target_tokenizer``); ``draft_call_options`` the generator's options for this call alone
    (``CandidateGenerator.call_options``, e.g. ``{"memory_scope": "alice"}`` for ``suffix``).
    Returns what ``generate()`` returns."""
    started = time.perf_counter()  # the call's time, its argument checks included (as SpecDecoder.generate's)
    called = _generate_arguments()  # what transformers 5.25 leaves out of a custom_generate callable's arguments
    streamer = streamer if streamer is not None else called.get("streamer")
    synced_gpus = synced_gpus or bool(called.get("synced_gpus"))
    # a sharded target's ranks check the arguments inside the call: a check failing on one rank fails every rank
    with coordinated(Ranks.of(model, (decoder_options or {}).get("distributed"))) as coordinator:
        if synced_gpus:
            raise ValueError("synced_gpus=True (DeepSpeed ZeRO-3 / FSDP) is not supported by specdec's custom_generate")
        if called.get("assistant_model") is not None:
            raise ValueError("assistant_model= is transformers' own assisted generation, which custom_generate "
                             "replaces: pass the model as draft= instead")
        check_generation_config(generation_config)
        check_decoder_options(decoder_options or {})
        decoder = DRAFTERS.decoder(model, draft, dict(draft_options or {}), target_tokenizer, draft_tokenizer,
                                   dict(decoder_options or {}))
        options = dict(draft_call_options or {})  # generate() refuses keywords no model input takes: a dict
        unknown = sorted(set(options) - set(decoder.candidate_generator.call_options))
        if unknown:
            raise TypeError(f"draft_call_options {unknown}: the candidate generator takes "
                            f"{list(decoder.candidate_generator.call_options)} per call")
        prompt = decoder._prompt(input_ids, model_kwargs.get("attention_mask"), model_kwargs, None, prepared=True)
        max_length, eos, criteria = _split_criteria(stopping_criteria)
        call = resolved(generation_config, input_ids.shape[1], max_length, eos)
        call.stop_strings = None  # generate()'s StopStringCriteria is among the criteria
        if grammar is not None:  # generate() repeated each prompt's rows for num_return_sequences: so are its grammars
            grammar = grammars_per_row(grammar, generation_config.num_return_sequences or 1, input_ids.shape[0])
            logits_processor = with_user_processor(logits_processor, decoder.constraint(grammar, call.eos))
        out = decoder.run(prompt, call, logits_processor, criteria, streamer=streamer, generator=generator,
                          stream_prompt=False, started=started, coordinator=coordinator, generator_options=options)
        return out if call.return_dict else out.sequences


def check_decoder_options(options: dict) -> None:
    """Refuse a ``decoder_options`` key that ``SpecDecoder`` does not take as its own (before it is
    merged with ``draft_options``, where a typo would read as an unknown option of the generator)."""
    own = [name for name, p in inspect.signature(SpecDecoder.__init__).parameters.items()
           if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("tokenizer", "draft_tokenizer")]
    unknown = sorted(set(options) - set(own))
    if unknown:
        hint = did_you_mean(unknown[0], own)
        raise TypeError(f"decoder_options: unknown SpecDecoder setting(s) {unknown}.{hint} It takes {own}; "
                        "a candidate generator's options go in draft_options")


def _split_criteria(stopping_criteria) -> tuple[int | None, list[int] | None, list]:
    """generate()'s stopping criteria -> (max_length, EOS ids, the rest): the first two become the
    run's own budget and end ids (checked over whole blocks), the rest are checked token by token."""
    max_length, eos, rest = None, None, []
    for criterion in stopping_criteria or ():
        if type(criterion) is MaxLengthCriteria:
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        elif type(criterion) is EosTokenCriteria:
            eos = list(dict.fromkeys([*(eos or []), *criterion.eos_token_id.flatten().tolist()]))  # eos[0] pads
        else:
            rest.append(criterion)
    return max_length, eos if eos is not None else [], rest


def _generate_arguments() -> dict:
    """The arguments of the ``GenerationMixin.generate`` call that called us (its frame's locals):
    transformers 5.24+ gives the streamer the prompt and then leaves it, ``synced_gpus`` and
    ``assistant_model`` out of a custom_generate callable's arguments."""
    frame = sys._getframe(1)
    for _ in range(4):  # generate() calls the callable directly; allow a wrapper or two
        frame = frame.f_back
        if frame is None:
            return {}
        if frame.f_code.co_name == "generate" and frame.f_globals.get("__name__") == "transformers.generation.utils":
            return frame.f_locals
    return {}
