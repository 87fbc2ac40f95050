"""SpecDecoder: the user's entry point; validation, then one :class:`~specdec.run.DecodeRun` per call.

One ``generate()`` call:

1. validate every argument before the first forward (one clear error, no work done);
2. make a :class:`~specdec.run.DecodeRun`: the target's state, the generator's per-call session
   (whose ``setup`` may attach assistants, still before any forward), the draft-length policy,
   stopper, statistics;
3. ``while run.step()``: plan, propose, admit, forward, verify, commit, observe (the data path
   is in ``run.py``);
4. return a :class:`~specdec.outputs.SpecOutput`: ``transformers``' ``GenerateDecoderOnlyOutput``
   (sequences, and scores / logits when asked) with the statistics.

A call's settings are resolved as ``model.generate()`` resolves them (``specdec/generation.py``):
the target's ``generation_config``, the call's arguments on top; its logits processors apply at
every verified position (``specdec/processors.py``). ``model.generate(custom_generate=
specdec.generate)`` enters the same run through :meth:`SpecDecoder.run` (``specdec/integration.py``).

The decoder holds only configuration (models, tokenizers, the generator as the user built it),
so one decoder serves several calls at once. Nothing here mutates the user's models, configs or
tensors, and nothing here knows a generator by name beyond asking the registry.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from transformers import LogitsProcessorList
from transformers.generation.stopping_criteria import MaxTimeCriteria, StopStringCriteria

from .call_inputs import check_token_input, prefill_only
from .compiled import warming
from .distributed import Ranks, call_fingerprint, coordinated
from .engines import check_engine, resolve_engine_name
from .generation import Resolved, build_processors, inferred_mask, resolve_config, resolved, split_settings
from .generators import CandidateGenerator, declared_drafting, most_drafts, plugin_name
from .grammar import GrammarConstraint, compile_grammar
from .kv import CacheSettings, length_ladder, static_problem
from .modelinfo import UNSET, pad_token_id, token_id_list, vocab_size
from .multimodal import PrefillSpec, Prefix, check_call, declared_inputs
from .outputs import SpecOutput
from .processors import BlockProcessors
from .probes import both_ways_problem, slot_problem
from .registry import resolve_draft
from .request import CallSettings, Prompt
from .return_sequences import grammars_per_row, repeated_prompt
from .run import DecodeRun
from .shared_prefill import prefilled
from .sampling import SamplingParams
from .state import ModelState, cache_problem
from .stopping import Stopper
from .validation import (check_generation_config, check_ids_in_vocab, check_max_new_tokens, check_positive_int,
                         check_prompt, check_rope_reach)

__all__ = ["SpecDecoder", "SpecOutput"]


class SpecDecoder:
    """Speculative decoding for a ``transformers`` causal LM.

    ``draft`` is a model (drafts with ``draft_model``), a registered generator name, a
    :class:`CandidateGenerator` instance or class, or None (plain decoding through the same loop).
    ``fast_head`` (default True) computes each model's output layer as ``W @ h.T`` in eager
    forwards where that is faster on this machine (``specdec.engines.forwards.head``); False keeps the models' own.
    ``engine`` (``specdec.engines.ENGINE_CHOICES``) says what runs every forward of this decoder's
    models: "auto" (default) and "cpu" specdec's CPU forwards where their probes and timings choose
    them, "eager" the models' own forward and nothing else (docs/engines.md); reported in
    ``out.stats.choices["engine"]``.
    ``distributed`` (a :class:`~specdec.distributed.DistributedOptions` or its fields as a dict)
    says how the ranks of a target sharded under ``torchrun`` share the call's decisions
    (docs/distributed.md); a target held whole by this process ignores it.
    """

    def __init__(self, target, draft=None, *, tokenizer=None, draft_tokenizer=None,
                 cache_implementation: str = "dynamic", compile: bool | dict = False, fast_head: bool = True,
                 engine: str = "auto", distributed=None, **generator_options):
        check_engine(resolve_engine_name(engine), target)  # a bad name: refused before anything else
        self.target = target
        self.ranks = Ranks.of(target, distributed)  # None: this process holds the whole target
        fast_head = fast_head if self.ranks is None else False  # a sharded head is the model's to gather
        self.tokenizer = tokenizer
        self.draft_tokenizer = draft_tokenizer
        self.cache = CacheSettings.make(cache_implementation, compile, fast_head=fast_head, engine=engine)
        if self.ranks is not None:
            self.ranks.check_cache(self.cache)
        if self.cache.static:
            problem = static_problem(target, prefill_inputs=False)
            if problem:
                raise ValueError(f"target: {problem}")
        self.candidate_generator = self._resolve(draft, generator_options)

    def _resolve(self, draft, options: dict) -> CandidateGenerator:
        """The generator ``draft`` means (:func:`~specdec.registry.resolve_draft`); a draft model
        whose tokenizer differs from the target's drafts through the cross-tokenizer generator."""
        tokenizers_differ = (isinstance(draft, torch.nn.Module) and not isinstance(draft, CandidateGenerator)
                             and self.tokenizer is not None and self.draft_tokenizer is not None
                             and self.tokenizer.get_vocab() != self.draft_tokenizer.get_vocab())
        return resolve_draft(draft, options, tokenizers_differ=tokenizers_differ)

    def generate(self, input_ids, attention_mask=None, *, max_new_tokens=UNSET, do_sample=UNSET, temperature=UNSET,
                 top_k=UNSET, top_p=UNSET, min_p=UNSET, generator: torch.Generator | None = None, eos_token_id=UNSET,
                 stopping_criteria=None, streamer=None, logits_processor=None,
                 prefix_allowed_tokens_fn=None, generation_config=None, prefix: Prefix | None = None,
                 grammar=None, **kwargs) -> SpecOutput:
        """Decode up to ``max_new_tokens`` per row; output as ``target.generate`` would give it.

        Settings not given come from ``generation_config`` or else the target's
        ``generation_config``, as ``model.generate()`` takes them: ``do_sample``, ``temperature``,
        ``top_k``, ``top_p``, ``min_p``, ``max_new_tokens`` (else ``max_length``), EOS and pad ids,
        and any other ``GenerationConfig`` setting, which may also be passed here by name
        (``repetition_penalty=1.1``, ``output_scores=True``, ...). Every logits processor
        ``generate()`` would build (and ``logits_processor``, ``prefix_allowed_tokens_fn``) applies
        at every verified position; ``num_return_sequences=n`` (sampling) returns ``n`` rows per
        prompt, each prompt's together, as ``generate()`` does (``specdec/return_sequences.py``);
        what cannot be reproduced (beam search, ...) is refused by name before any forward. An
        explicit ``eos_token_id=None`` means "no EOS" and ``[]`` an EOS criterion of no ids
        (finished rows padded), as in ``transformers``. ``tokenizer`` (as ``generate()``'s) reads the
        stop strings, else the decoder's does. Other keyword arguments go to the model (specdec/call_inputs.py: prefill-only
        inputs such as pixel values and grids; ``generate()``'s per-step ones dropped or refused),
        except the candidate generator's own per-call options
        (``CandidateGenerator.call_options``, e.g. ``suffix``'s ``memory_scope``). With ``prefix`` (from
        :meth:`prefill`) the prompt rows must extend the prefix rows and carry no such inputs.
        ``generator`` (a ``torch.Generator``) draws the sampling's randomness. ``grammar`` (a JSON
        schema as a dict or pydantic class, a :class:`~specdec.grammar.Grammar`, a compiled xgrammar
        grammar, or a list of one per row) constrains the output to it (docs/structured.md); it needs
        ``tokenizer``."""
        started = time.perf_counter()
        with self.calling() as coordinator:  # a sharded target's ranks check the arguments inside the call
            # the generator's own per-call options (CandidateGenerator.call_options) first
            options = {k: kwargs.pop(k) for k in self.candidate_generator.call_options if k in kwargs}
            tokenizer = kwargs.pop("tokenizer", None)  # generate()'s: the stop strings' (else the decoder's)
            settings, model_inputs = split_settings(kwargs)
            settings.update(self._explicit(max_new_tokens, do_sample, temperature, top_k, top_p, min_p, eos_token_id))
            width = check_prompt(input_ids, None)[0].shape[1]
            config = resolve_config(self.target, generation_config, settings, width)
            if config.num_return_sequences and config.num_return_sequences > 1:  # rows repeated, as generate() does
                input_ids, attention_mask = repeated_prompt(self.target, config.num_return_sequences, input_ids,
                                                            attention_mask, model_inputs, prefix)
                grammar = grammars_per_row(grammar, config.num_return_sequences, input_ids.shape[0])
            prompt = self._prompt(input_ids, attention_mask, model_inputs, prefix, config=config)
            check_generation_config(config)
            call = resolved(config, prompt.input_ids.shape[1])
            if grammar is not None:  # placed as a user's processor: after the config's, before the warpers
                logits_processor = [*(logits_processor or []), self.constraint(grammar, call.eos)]
            processors = build_processors(self.target, config, prompt.input_ids, prompt.mask(),
                                          prefix_allowed_tokens_fn, LogitsProcessorList(logits_processor or []))
            criteria = self._criteria(config, call, stopping_criteria, tokenizer)
            return self.run(prompt, call, processors, criteria, streamer=streamer, generator=generator, started=started,
                            coordinator=coordinator, generator_options=options)

    @staticmethod
    def _criteria(config, call: Resolved, stopping_criteria, tokenizer) -> list:
        """The call's stopping criteria beside its budget and EOS: the user's, ``max_time``'s, and
        with a call's ``tokenizer`` (``generate()``'s keyword) the stop strings read by it."""
        criteria = [*(stopping_criteria or []), *([MaxTimeCriteria(config.max_time)] if config.max_time else [])]
        if call.stop_strings and tokenizer is not None:
            criteria.append(StopStringCriteria(tokenizer, call.stop_strings))
            call.stop_strings = None  # not the decoder's tokenizer's too
        return criteria

    def calling(self):
        """A context for one call, around all of it (argument checks first), yielding its
        coordinator (``specdec/distributed/``): for a target sharded over ranks, a check that
        fails on one rank only, or any error raised inside, becomes one error on every rank, and
        the ranks stay in step for the next call; for a target held whole, nothing."""
        return coordinated(self.ranks)

    def constraint(self, grammar, eos: list[int]) -> GrammarConstraint:
        """``grammar`` (or a list of one per row) compiled for the target's tokenizer (once per
        tokenizer and grammar), ending at ``eos``."""
        compile_one = lambda g: compile_grammar(g, self.tokenizer, vocab_size(self.target), eos)  # noqa: E731
        return GrammarConstraint([compile_one(g) for g in grammar] if isinstance(grammar, (list, tuple))
                                 else compile_one(grammar))

    @staticmethod
    def _explicit(max_new_tokens, do_sample, temperature, top_k, top_p, min_p, eos_token_id) -> dict:
        """The settings the call gave by argument, type-checked before anything is resolved."""
        given = {name: value for name, value in (("max_new_tokens", max_new_tokens), ("do_sample", do_sample),
                                                 ("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                                                 ("min_p", min_p)) if value is not UNSET}
        if "max_new_tokens" in given:
            given["max_new_tokens"] = check_max_new_tokens(max_new_tokens)
        SamplingParams(given.get("do_sample", False), given.get("temperature", 1.0), given.get("top_k"),
                       given.get("top_p"), given.get("min_p")).validate()
        if eos_token_id is not UNSET:
            given["eos_token_id"] = None if eos_token_id is None else token_id_list(eos_token_id)
        return given

    def run(self, prompt: Prompt, call: Resolved, processors, stopping_criteria=(), *, streamer=None,
            generator: torch.Generator | None = None, stream_prompt: bool = True,
            started: float | None = None, coordinator, generator_options: dict | None = None) -> SpecOutput:
        """One decode run of a validated ``prompt`` with resolved settings ``call`` and ``generate()``'s
        ``processors`` (a ``LogitsProcessorList``): the loop both ``generate`` and
        ``model.generate(custom_generate=specdec.generate)`` run. ``coordinator``: the call's, from
        :meth:`calling` (where the caller checked the arguments, inside it).
        ``generator_options``: the generator's per-call options (``CandidateGenerator.for_call``)."""
        started = time.perf_counter() if started is None else started
        call.sampling.validate()
        check_rope_reach(self.target, int(prompt.lengths.max()) + call.max_new_tokens - 1)  # the last is never fed
        if call.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: SpecDecoder(target, draft, tokenizer=...)")
        if streamer is not None and prompt.rows.shape[0] > 1:
            raise ValueError("a streamer needs batch size 1 (as in transformers)")
        ranks = coordinator
        if self.ranks is not None:  # what every rank must have been given alike, compared at the first message
            sampled = bool(call.sampling.do_sample)
            ranks.given(self._fingerprint(prompt, call, processors, stopping_criteria, generator, stream_prompt),
                        generator if sampled else None)
        settings = CallSettings(
            max_new_tokens=call.max_new_tokens, sampling=call.sampling, generator=generator, pad=call.pad,
            streamer=ranks.streamer(streamer, prompt_streamed=not stream_prompt), cache=self.cache, ranks=ranks,
            processors=ranks.processors(BlockProcessors(processors, prompt.input_ids) or None),
            output_scores=call.return_dict and call.output_scores,
            output_logits=call.return_dict and call.output_logits,
            stream_prompt=stream_prompt,
            stopper=ranks.stopper(Stopper(
                max_new_tokens=call.max_new_tokens, eos_token_ids=call.eos, stop_strings=call.stop_strings,
                tokenizer=self.tokenizer, stopping_criteria=list(stopping_criteria),
                # generate() pads finished rows where it built an EOS criterion, an empty list of ids included
                pads_finished=True if getattr(call.config, "_eos_token_tensor", None) is not None else None)))
        configured = (self.candidate_generator.for_call(**generator_options) if generator_options
                      else self.candidate_generator)
        # inference mode, as the warm-up's (a graph compiled in one mode is compiled again in the
        # other): each small operation of a step costs less than under no_grad (docs/performance.md,
        # "The loop's own cost"). Every tensor made here stays with the call, or with the static
        # cache pool, which only these calls and the warm-up write; the output is made outside it.
        with torch.inference_mode():
            run = DecodeRun(self.target, configured, prompt, settings,
                            tokenizer=self.tokenizer, draft_tokenizer=self.draft_tokenizer)
            try:
                while run.step():
                    pass
            finally:
                run.release()
        output = run.finish(prompt.input_ids, started)
        output.sequences, output.stats = ranks.finish(output.sequences, output.stats)
        return output

    def _fingerprint(self, prompt: Prompt, call: Resolved, processors, criteria, generator, stream_prompt: bool):
        """The parts of a call every rank of a sharded target must be given alike
        (``specdec/distributed/fingerprint.py``)."""
        plugin = plugin_name(self.candidate_generator)
        drafting = declared_drafting(self.candidate_generator, plugin)  # sizes the ranks' draft messages
        return call_fingerprint(
            prompt.input_ids, prompt.mask(), call.max_new_tokens, call.sampling, call.eos, call.pad, call.stop_strings,
            call.return_dict, call.output_scores, call.output_logits, stream_prompt, plugin, self.cache,
            self.ranks.options, prompt.prefix is not None, model_inputs=prompt.spec.user_inputs,
            drafting=(drafting, most_drafts(self.candidate_generator, drafting)), processors=processors,
            criteria=criteria, generator=generator, sampled=bool(call.sampling.do_sample))

    def warmup(self, batch_size: int = 1, max_length: int = 1024) -> float:
        """Compile every forward a call can run (``compile=True``, or a generator whose draft
        compiles, like ``self_draft``): the target's and each assistant's, at every padded width a
        step can feed (the ladder's widths below the generator's most drafts and the pending
        token, ``generators.most_drafts``, then that block's own width, so the widest step pads
        nothing: a fixed ``num_tokens=3`` compiles widths 1, 2 and 4, ``num_tokens=4`` 1, 2, 4
        and 5; a wider forward, which only a grammar's forced tokens make, runs eagerly), for
        ``batch_size`` rows and static caches of each length of ``kv.length_ladder`` up to
        ``max_length`` tokens (prompt + new tokens) and the call margin (1024 -> caches of 256,
        512, 1024 and 1280 slots), and calibrate the draft-length policy.
        From then on each call takes the shortest warmed-up cache it fits in (attention reads every
        slot, so short calls stay fast), and calls of that batch size up to ``max_length`` compile
        nothing new (a batch whose rows finish at different times runs smaller batches too: warm
        those up as well). Returns the seconds spent (report them apart from decoding time); 0.0
        when nothing compiles."""
        batch_size = check_positive_int(batch_size, "batch_size")
        max_length = check_positive_int(max_length, "max_length")
        started = time.perf_counter()
        vocab = min(vocab_size(self.target), 256)  # (a pipeline stage may hold no embeddings)
        ids = torch.arange(8).remainder(vocab)[None, :].repeat(batch_size, 1)
        prompt = self._prompt(ids, None, {}, None)
        compiled = False
        generator = self.candidate_generator
        most = most_drafts(generator, declared_drafting(generator, plugin_name(generator)))
        # a step feeds at most its pending token and most drafts: where the ladder reaches that
        # block, it is the widest width compiled, padded to nothing (a wider forward, a grammar's, runs eagerly)
        if most is not None and any(w >= 1 + most for w in self.cache.widths):
            self.cache = replace(self.cache, widths=tuple(w for w in self.cache.widths if w < 1 + most) + (1 + most,))
        # generators that compile only when warmed up (self_draft's copy) compile here; in inference
        # mode, as every call's forwards run (a graph compiled under no_grad would be compiled again)
        with warming(), torch.inference_mode():
            for length in length_ladder(max_length + ModelState.margin()):
                # one new token: the caches then hold exactly ``length`` slots
                settings = CallSettings(max_new_tokens=1, sampling=SamplingParams(), generator=None,
                                        pad=pad_token_id(self.target, ()), cache=replace(self.cache, lengths=(length,)),
                                        stopper=Stopper(max_new_tokens=1, eos_token_ids=(), stop_strings=None,
                                                        tokenizer=None, stopping_criteria=None))
                run = DecodeRun(self.target, self.candidate_generator, prompt, settings,
                                tokenizer=self.tokenizer, draft_tokenizer=self.draft_tokenizer)
                states = [state for state in run.states() if state.compiled]
                try:
                    for state in states:
                        state.warm_up()
                finally:
                    run.release()
                if not states:
                    break  # nothing compiles: no cache length matters
                compiled = True
                self.cache = replace(self.cache, lengths=tuple(sorted({*self.cache.lengths, length})))
        return time.perf_counter() - started if compiled else 0.0

    def prefill(self, input_ids, attention_mask=None, **model_inputs) -> Prefix:
        """Run the target once over a prompt prefix (e.g. a system prompt with its image) and keep
        its cache and what the prefill derived (mRoPE positions), so that
        ``generate(prefix_ids + question_ids, prefix=prefix)`` continues from it, any number of
        times. Only the target's cache is kept: assistants prefill the whole prompt, once, in their
        own first forward (with the prefix's image inputs)."""
        with self.calling() as coordinator:  # a sharded target's ranks agree on the prefix before its forward
            if self.cache.static:
                raise ValueError("prefill() needs the dynamic cache (cache_implementation='dynamic')")
            if self.cache.engine == "llama_cpp":
                raise ValueError("prefill() keeps a transformers cache, which engine='llama_cpp' cannot continue "
                                 "(it keeps its own keys and values); pass the whole prompt to generate()")
            prompt = self._prompt(input_ids, attention_mask, model_inputs, None)
            if self.ranks is not None:
                coordinator.given(call_fingerprint(prompt.input_ids, prompt.mask(), "prefill",
                                                   model_inputs=prompt.spec.user_inputs))
            coordinator.together(lambda: None)
            return prefilled(self.target, prompt.spec, pad_token_id(self.target), self.cache)

    def _prompt(self, input_ids, attention_mask, model_inputs: dict, prefix: Prefix | None,
                prepared: bool = False, config=None) -> Prompt:
        """Validate a prompt against the target (before any forward) and strip its left padding;
        every tensor on the target's device. ``model_inputs``: the call's model keywords
        (``prepared``: as ``generate()`` prepared them, ``specdec/call_inputs.py``). With no mask
        the pad id's columns are padding, as in ``generate()`` (with ``config``'s special tokens,
        else the target's); a prepared call's missing mask is one ``generate()`` dropped as all ones."""
        check_token_input(model_inputs)
        if attention_mask is None and not prepared:
            input_ids, attention_mask = _inferred_prompt(self.target, input_ids, config)
        else:
            input_ids, attention_mask = check_prompt(input_ids, attention_mask)
        model_inputs = prefill_only(self.target, model_inputs, attention_mask, prepared=prepared)
        batch, width = input_ids.shape
        problem = cache_problem(self.target, batch)
        if problem:
            raise ValueError(f"target: {problem}")
        if prefix is None:
            check_call(self.target, input_ids, attention_mask, model_inputs)
        unknown = sorted(set(model_inputs) - declared_inputs(self.target))
        if unknown:
            raise ValueError(f"{type(self.target).__name__}.forward does not take {unknown}; "
                             "extra keyword arguments are prefill-only model inputs (e.g. pixel_values)")
        check_ids_in_vocab(input_ids, self.target)
        # the last checks: they may run forwards
        problem = both_ways_problem(self.target) or slot_problem(self.target, batch)
        if problem:
            raise ValueError(f"target: {problem}")
        device = self.target.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        lengths = attention_mask.sum(1)  # [B]
        cols = (width - lengths)[:, None] + torch.arange(width, device=device)[None, :]
        rows = input_ids.gather(1, cols.clamp(max=width - 1))  # [B, P] row b's tokens from column 0
        if prefix is not None:
            prefix.check_continuation(self.target, rows, lengths, model_inputs)
            return Prompt(input_ids, rows, lengths, prefix.spec, prefix)
        return Prompt(input_ids, rows, lengths, PrefillSpec.from_call(rows, lengths, model_inputs))


def _inferred_prompt(target, input_ids, config) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt and the mask ``generate()`` infers for it when given none; a mask that specdec
    cannot take (a pad id inside or at the end of a row) is refused saying where it came from."""
    input_ids = check_prompt(input_ids, None)[0]
    attention_mask = inferred_mask(target, input_ids, config)
    try:
        return check_prompt(input_ids, attention_mask)
    except ValueError as error:
        raise ValueError(f"{error} (no attention_mask was given, so, as in generate(), every pad_token_id "
                         "column was taken as padding: pass attention_mask to attend them)") from None
