"""SpecDecoder: the user's entry point; validation, then one :class:`~specdec.run.DecodeRun` per call.

One ``generate()`` call:

1. validate every argument before the first forward (one clear error, no work done);
2. make a :class:`~specdec.run.DecodeRun`: the target's state, the generator's per-call session
   (whose ``setup`` may attach assistants, still before any forward), the draft-length policy,
   stopper, statistics;
3. ``while run.step()``: plan, propose, admit, forward, verify, commit, observe (the data path
   is in ``run.py``);
4. return ``SpecOutput(sequences, stats)`` shaped like ``transformers``' output.

The decoder holds only configuration (models, tokenizers, the generator as the user built it),
so one decoder serves several calls at once. Nothing here mutates the user's models, configs or
tensors, and nothing here knows a generator by name beyond asking the registry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from .generators import CandidateGenerator
from .kv import CacheSettings, length_ladder, static_problem
from .metrics import AcceptanceStats
from .modelinfo import UNSET, eos_token_ids, pad_token_id
from .multimodal import PrefillSpec, Prefix, check_call, declared_inputs
from .registry import resolve_draft
from .run import CallSettings, DecodeRun, Prompt
from .sampling import SamplingParams
from .state import ModelState, cache_problem
from .stopping import Stopper
from .validation import (check_generation_config, check_ids_in_vocab, check_max_new_tokens, check_positive_int,
                         check_prompt)


@dataclass
class SpecOutput:
    sequences: torch.Tensor  # [B, prompt + new] like transformers' generate output
    stats: AcceptanceStats


class SpecDecoder:
    """Speculative decoding for a ``transformers`` causal LM.

    ``draft`` is a model (drafts with ``draft_model``), a registered generator name, a
    :class:`CandidateGenerator` instance or class, or None (plain decoding through the same loop).
    ``fast_head`` (default True) computes each model's output layer as ``W @ h.T`` in eager
    forwards where that is faster on this machine (``specdec.forwards.head``); False keeps the models' own.
    """

    def __init__(self, target, draft=None, *, tokenizer=None, draft_tokenizer=None,
                 cache_implementation: str = "dynamic", compile: bool | dict = False, fast_head: bool = True,
                 **generator_options):
        self.target = target
        self.tokenizer = tokenizer
        self.draft_tokenizer = draft_tokenizer
        self.cache = CacheSettings.make(cache_implementation, compile, fast_head=fast_head)
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

    def generate(self, input_ids, attention_mask=None, *, max_new_tokens: int, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None, eos_token_id=UNSET, stop_strings=None,
                 stopping_criteria=None, streamer=None, prefix: Prefix | None = None, **model_inputs) -> SpecOutput:
        """Decode up to ``max_new_tokens`` per row; output as ``target.generate`` would give it.

        ``eos_token_id`` defaults to the target's ``generation_config``; an explicit None (or [])
        means "no EOS", as in ``transformers``. ``model_inputs`` are prefill-only (pixel values,
        grids, token type ids, ...). With ``prefix`` (from :meth:`prefill`) the prompt rows must
        extend the prefix rows and carry no such inputs."""
        started = time.perf_counter()
        prompt = self._prompt(input_ids, attention_mask, model_inputs, prefix)
        batch = prompt.rows.shape[0]
        sampling = SamplingParams(do_sample, temperature, top_k, top_p)
        sampling.validate()
        if stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: SpecDecoder(target, draft, tokenizer=...)")
        if streamer is not None and batch > 1:
            raise ValueError("a streamer needs batch size 1 (as in transformers)")
        eos = eos_token_ids(self.target, eos_token_id)
        check_generation_config(self.target, prompt.input_ids, eos)
        settings = CallSettings(
            max_new_tokens=check_max_new_tokens(max_new_tokens), sampling=sampling, generator=generator,
            pad=pad_token_id(self.target, eos), streamer=streamer, cache=self.cache,
            stopper=Stopper(max_new_tokens=int(max_new_tokens), eos_token_ids=eos, stop_strings=stop_strings,
                            tokenizer=self.tokenizer, stopping_criteria=stopping_criteria))
        run = DecodeRun(self.target, self.candidate_generator, prompt, settings,
                        tokenizer=self.tokenizer, draft_tokenizer=self.draft_tokenizer)
        try:
            with torch.no_grad():
                while run.step():
                    pass
        finally:
            run.release()
        return SpecOutput(*run.finish(prompt.input_ids, started))

    def warmup(self, batch_size: int = 1, max_length: int = 1024) -> float:
        """Compile every forward a call can run (``compile=True``, or a generator whose draft
        compiles, like ``self_draft``): the target's and each assistant's, at every padded width,
        for ``batch_size`` rows and static caches of each length of ``kv.length_ladder`` up to
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
        vocab = min(int(self.target.get_input_embeddings().weight.shape[0]), 256)
        ids = torch.arange(8).remainder(vocab)[None, :].repeat(batch_size, 1)
        prompt = self._prompt(ids, None, {}, None)
        compiled = False
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
                with torch.no_grad():
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
        if self.cache.static:
            raise ValueError("prefill() needs the dynamic cache (cache_implementation='dynamic')")
        prompt = self._prompt(input_ids, attention_mask, model_inputs, None)
        check_generation_config(self.target, prompt.input_ids, eos_token_ids(self.target))
        prefill, positions = prompt.spec.for_model(self.target)
        state = ModelState(self.target, prompt.rows, prompt.lengths, pad_token_id=pad_token_id(self.target),
                           prefill_inputs=prefill, positions=positions)
        with torch.no_grad():
            state.forward(start=prompt.lengths - 1)
        return Prefix(self.target, prompt.spec, state.offsets.clone(), state.cached_slots, state.cache, state.positions)

    def _prompt(self, input_ids, attention_mask, model_inputs: dict, prefix: Prefix | None) -> Prompt:
        """Validate a prompt against the target (before any forward) and strip its left padding;
        every tensor on the target's device."""
        input_ids, attention_mask = check_prompt(input_ids, attention_mask)
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
        device = self.target.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        lengths = attention_mask.sum(1)  # [B]
        cols = (width - lengths)[:, None] + torch.arange(width, device=device)[None, :]
        rows = input_ids.gather(1, cols.clamp(max=width - 1))  # [B, P] row b's tokens from column 0
        if prefix is not None:
            prefix.check_continuation(self.target, rows, lengths, model_inputs)
            return Prompt(input_ids, rows, lengths, prefix.spec, prefix)
        return Prompt(input_ids, rows, lengths, PrefillSpec.from_call(rows, lengths, model_inputs))
