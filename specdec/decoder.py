"""SpecDecoder: the controller and its loop.

One ``generate()`` call:

1. validate every argument before the first forward (one clear error, no work done);
2. wrap the target in a :class:`~specdec.state.ModelState`; the generator's ``setup`` may attach
   assistant models, which the controller wraps the same way and owns from then on;
3. loop: the generator proposes ``[B, K]`` drafts; the target scores ``[last committed, d1..dK]``
   in one forward (its very first forward is the prefill, prompt and drafts together); the
   verifier keeps an accepted prefix plus one target token per row; the stopper cuts the block
   where plain generation would have stopped; every state rolls back to the committed prefix;
   finished rows leave the batch;
4. return ``SpecOutput(sequences, stats)`` shaped like ``transformers``' output.

Nothing here mutates the user's models, configs or tensors, and nothing here knows a generator
by name beyond asking the registry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .generators import CandidateGenerator, DecodeContext, Feedback, NoDraft, token_id_list
from .metrics import AcceptanceStats
from .multimodal import PrefillSpec, Prefix, check_assistant, check_call, declared_inputs
from .registry import get_candidate_generator
from .sampling import SamplingParams
from .state import ModelState, cache_problem
from .stopping import Stopper, StreamFeed
from .verify import greedy_verify, speculative_sample

#: generator used when ``draft`` is a model sharing the target's tokenizer
MODEL_DRAFT_GENERATOR = "draft_model"
#: generator used when ``draft`` is a model and the two tokenizers given differ
CROSS_TOKENIZER_GENERATOR = "cross_tokenizer"


@dataclass
class SpecOutput:
    sequences: torch.Tensor  # [B, prompt + new] like transformers' generate output
    stats: AcceptanceStats


#: generation_config fields that change greedy output in ``target.generate`` and their neutral values
LOGITS_SETTINGS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
                   "suppress_tokens": None, "begin_suppress_tokens": None, "min_new_tokens": 0, "min_length": 0,
                   "forced_eos_token_id": None, "sequence_bias": None, "exponential_decay_length_penalty": None}


def unsupported_generation_settings(model) -> list[str]:
    """``generation_config`` settings that ``target.generate`` would apply and specdec does not."""
    config = model.generation_config
    found = []
    for name, neutral in LOGITS_SETTINGS.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral and value != []:
            found.append(f"{name}={value!r}")
    return found


def _eos_ids(eos_token_id, model) -> list[int]:
    """The EOS ids to stop on: the argument, else the target's generation config (as generate())."""
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
    return token_id_list(eos_token_id)


def _check_proposal(gen: CandidateGenerator, draft_ids: torch.Tensor, offered: torch.Tensor, vocab: int) -> None:
    """A plugin's drafts must be target ids; say which plugin broke the contract."""
    if draft_ids.numel():
        valid = draft_ids[torch.arange(draft_ids.shape[1], device=draft_ids.device)[None, :] < offered[:, None]]
        if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab):
            raise ValueError(f"candidate generator {gen.name or type(gen).__name__!r} proposed ids outside the "
                             f"target's vocabulary [0, {vocab})")


class SpecDecoder:
    """Speculative decoding for a ``transformers`` causal LM.

    ``draft`` is a model (drafts with ``draft_model``), a registered generator name, a
    :class:`CandidateGenerator` instance or class, or None (plain decoding through the same loop).
    """

    def __init__(self, target, draft=None, *, tokenizer=None, draft_tokenizer=None, **generator_options):
        self.target = target
        self.tokenizer = tokenizer
        self.draft_tokenizer = draft_tokenizer
        self.candidate_generator = self._resolve(draft, generator_options)

    def _resolve(self, draft, options: dict) -> CandidateGenerator:
        if isinstance(draft, CandidateGenerator):
            if options:
                raise TypeError(f"options {sorted(options)} cannot be applied to a generator instance")
            return draft
        if draft is None:
            if options:
                raise TypeError(f"options {sorted(options)} need a draft (a model or a generator name)")
            return NoDraft()
        if isinstance(draft, str):
            cls, args = get_candidate_generator(draft), ()
        elif isinstance(draft, type) and issubclass(draft, CandidateGenerator):
            cls, args = draft, ()
        elif isinstance(draft, torch.nn.Module):
            tokenizers_differ = (self.tokenizer is not None and self.draft_tokenizer is not None
                                 and self.tokenizer.get_vocab() != self.draft_tokenizer.get_vocab())
            name = CROSS_TOKENIZER_GENERATOR if tokenizers_differ else MODEL_DRAFT_GENERATOR
            cls, args = get_candidate_generator(name), (draft,)
        else:
            raise TypeError(f"draft must be a model, a generator name or a CandidateGenerator, got {type(draft).__name__}")
        try:
            return cls(*args, **options)
        except TypeError as exc:
            raise TypeError(f"bad options for candidate generator {cls.name or cls.__name__!r}: {exc}") from None

    # ------------------------------------------------------------------------------------------
    def generate(self, input_ids, attention_mask=None, *, max_new_tokens: int, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None, eos_token_id=None, stop_strings=None,
                 stopping_criteria=None, streamer=None, prefix: Prefix | None = None, **model_inputs) -> SpecOutput:
        """``model_inputs`` are prefill-only (pixel values, grids, token type ids, ...). With ``prefix``
        (from :meth:`prefill`) the prompt rows must extend the prefix rows and carry no such inputs."""
        started = time.perf_counter()
        input_ids, attention_mask, rows_tokens, lengths = self._prompt_rows(
            input_ids, attention_mask, model_inputs, media_in_prompt=prefix is None)
        batch, width = input_ids.shape
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        sampling = SamplingParams(bool(do_sample), float(temperature), top_k, top_p)
        sampling.validate()
        if stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: SpecDecoder(target, draft, tokenizer=...)")
        if streamer is not None and batch > 1:
            raise ValueError("a streamer needs batch size 1 (as in transformers)")

        eos = _eos_ids(eos_token_id, self.target)
        pad = getattr(self.target.generation_config, "pad_token_id", None)
        pad = int(pad if pad is not None else (eos[0] if eos else 0))
        stopper = Stopper(max_new_tokens=max_new_tokens, eos_token_ids=eos, stop_strings=stop_strings,
                          tokenizer=self.tokenizer, stopping_criteria=stopping_criteria)

        device = self.target.device
        capacity = width + max_new_tokens + 1
        if prefix is not None:
            prefix.check_continuation(self.target, rows_tokens, lengths, model_inputs)
        # the prompt rows that the prefill-only inputs describe: this prompt's, or the prefix's
        spec = prefix.spec if prefix is not None else PrefillSpec.from_call(rows_tokens, lengths, model_inputs)
        prefill, positions = spec.for_model(self.target) if prefix is None else (None, None)
        target_state = ModelState(self.target, rows_tokens, lengths, capacity, pad_token_id=pad,
                                  prefill_inputs=prefill, positions=positions)
        if prefix is not None:
            target_state.continue_from(prefix)
        assistants: list[ModelState] = []  # follow the target's tokens
        own_states: list[ModelState] = []  # kept in sync by their generator

        def attach(model, tokens=None, lengths=None, pad_token_id=None) -> ModelState:
            problem = cache_problem(model, batch)
            if problem:
                raise ValueError(f"assistant: {problem}")
            check_assistant(self.target, model)
            if tokens is None:  # follows the target's tokens: the controller keeps it in sync
                prefill, positions = spec.for_model(model)  # the inputs its forward declares; its own positions
                state = ModelState(model, target_state.tokens[:, :width], target_state.lengths, capacity,
                                   pad_token_id=pad, prefill_inputs=prefill, positions=positions)
                assistants.append(state)
            else:  # its own token space (e.g. another tokenizer): the generator keeps it in sync
                state = ModelState(model, tokens, lengths, tokens.shape[1] + capacity,
                                   pad_token_id=pad if pad_token_id is None else pad_token_id,
                                   prefill_inputs=spec.plain_inputs(model))
                own_states.append(state)
            return state

        ctx = DecodeContext(self.target, self.tokenizer, self.draft_tokenizer, sampling, generator,
                            target_state, spec.user_inputs, attach)
        gen = self.candidate_generator
        gen.setup(ctx)  # validates and attaches assistants: still before any forward

        stats = AcceptanceStats()
        vocab = ctx.target_vocab_size
        feed = StreamFeed(streamer)
        feed.prompt(input_ids)
        prompt_lengths = lengths.clone()
        row_ids = torch.arange(batch, device=device)
        outputs: list[torch.Tensor | None] = [None] * batch

        with torch.no_grad():
            while row_ids.numel():
                tick = time.perf_counter()
                max_drafts = max_new_tokens - (target_state.lengths - prompt_lengths) - 1  # [B]
                proposal = gen.propose(ctx, max_drafts)
                drafted = time.perf_counter()
                offered = torch.minimum(proposal.lengths.to(device), max_drafts).clamp_min(0)
                offered = target_state.admissible_drafts(proposal.token_ids.to(device), offered)
                k = int(offered.max())
                draft_ids = proposal.token_ids[:, :k].to(device)
                _check_proposal(gen, draft_ids, offered, vocab)
                committed = target_state.lengths.clone()
                target_state.append(draft_ids, offered)
                logits = target_state.forward(start=committed - 1)  # [B, k+1, V]
                if sampling.do_sample:
                    draft_probs = proposal.probs[:, :k] if proposal.probs is not None else None
                    verdict = speculative_sample(sampling.probs(logits), draft_ids, offered, draft_probs, generator)
                else:
                    verdict = greedy_verify(logits, draft_ids, offered)
                target_state.rollback(committed + verdict.accepted)
                target_state.append(verdict.next_token[:, None])
                new = verdict.accepted + 1
                keep, finished = stopper.cut(target_state.tokens, target_state.lengths, prompt_lengths, new, logits)
                if bool((keep < new).any()):
                    target_state.rollback(committed + keep)
                verified = time.perf_counter()

                stats.record_step(offered.tolist(), verdict.accepted.tolist(), keep.tolist())
                stats.draft_seconds += drafted - tick
                stats.verify_seconds += verified - drafted
                if streamer is not None:
                    feed.tokens(target_state.tokens[0, int(committed[0]): int(target_state.lengths[0])])
                synced = time.perf_counter()
                for state in assistants:
                    state.sync(target_state.tokens, target_state.lengths, since=committed)
                gen.observe(ctx, Feedback(offered, verdict.accepted))
                stats.draft_seconds += time.perf_counter() - synced  # keeping drafts in step is drafting work

                if bool(finished.any()):
                    for b in finished.nonzero().flatten().tolist():
                        outputs[int(row_ids[b])] = target_state.tokens[b, int(prompt_lengths[b]): int(target_state.lengths[b])].clone()
                    rest = (~finished).nonzero().flatten()
                    row_ids, prompt_lengths = row_ids[rest], prompt_lengths[rest]
                    if rest.numel():
                        for state in (target_state, *assistants, *own_states):
                            state.select_rows(rest)
                        gen.select_rows(rest)
        feed.end()
        stats.total_seconds = time.perf_counter() - started
        return SpecOutput(self._assemble(input_ids, outputs, pad), stats)

    def prefill(self, input_ids, attention_mask=None, **model_inputs) -> Prefix:
        """Run the target once over a prompt prefix (e.g. a system prompt with its image) and keep
        its cache and what the prefill derived (mRoPE positions), so that
        ``generate(prefix_ids + question_ids, prefix=prefix)`` continues from it, any number of
        times. Only the target's cache is kept: assistants prefill the whole prompt, once, in their
        own first forward (with the prefix's image inputs)."""
        input_ids, attention_mask, rows_tokens, lengths = self._prompt_rows(
            input_ids, attention_mask, model_inputs, media_in_prompt=True)
        width = input_ids.shape[1]
        spec = PrefillSpec.from_call(rows_tokens, lengths, model_inputs)
        prefill, positions = spec.for_model(self.target)
        pad = getattr(self.target.generation_config, "pad_token_id", None)
        state = ModelState(self.target, rows_tokens, lengths, width, pad_token_id=int(pad or 0),
                           prefill_inputs=prefill, positions=positions)
        with torch.no_grad():
            state.forward(start=lengths - 1)
        return Prefix(self.target, spec, state.offsets.clone(), state.cached_slots, state.cache, state.positions)

    @staticmethod
    def _assemble(input_ids: torch.Tensor, outputs: list[torch.Tensor], pad: int) -> torch.Tensor:
        longest = max(o.numel() for o in outputs)
        new = input_ids.new_full((input_ids.shape[0], longest), pad)
        for b, o in enumerate(outputs):
            new[b, : o.numel()] = o
        return torch.cat([input_ids, new], dim=1)

    def _prompt_rows(self, input_ids, attention_mask, model_inputs: dict, *, media_in_prompt: bool):
        """Validate a prompt against the target (before any forward) and strip its left padding.

        Returns (input_ids [B, P], attention_mask [B, P], rows [B, P] with row b's tokens from
        column 0, lengths [B]), all on the target's device."""
        input_ids, attention_mask = self._check_prompt(input_ids, attention_mask)
        batch, width = input_ids.shape
        problem = cache_problem(self.target, batch)
        if problem:
            raise ValueError(f"target: {problem}")
        unsupported = unsupported_generation_settings(self.target)
        if unsupported:
            raise ValueError(f"target.generation_config sets {', '.join(unsupported)}: logits processors that "
                             "specdec does not apply, so its output would differ from target.generate(); unset them "
                             "(e.g. on a copy of the generation config) to decode speculatively")
        if media_in_prompt:
            check_call(self.target, input_ids, attention_mask, model_inputs)
        unknown = sorted(set(model_inputs) - declared_inputs(self.target))
        if unknown:
            raise ValueError(f"{type(self.target).__name__}.forward does not take {unknown}; "
                             "extra keyword arguments are prefill-only model inputs (e.g. pixel_values)")
        vocab = int(self.target.get_output_embeddings().weight.shape[0])
        if int(input_ids.max()) >= vocab or int(input_ids.min()) < 0:
            raise ValueError(f"input_ids hold ids outside the target's vocabulary [0, {vocab})")
        device = self.target.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        lengths = attention_mask.sum(1)  # [B]
        cols = (width - lengths)[:, None] + torch.arange(width, device=device)[None, :]
        return input_ids, attention_mask, input_ids.gather(1, cols.clamp(max=width - 1)), lengths

    @staticmethod
    def _check_prompt(input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dim() == 1:
            input_ids = input_ids[None, :]
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"input_ids must be an integer tensor [batch, length], got {tuple(input_ids.shape)} {input_ids.dtype}")
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError("the prompt is empty: generation needs at least one input token")
        input_ids = input_ids.long()
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        else:
            if attention_mask.dim() == 1:
                attention_mask = attention_mask[None, :]
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
            attention_mask = attention_mask.long()
            if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
                raise ValueError("attention_mask must hold only 0 and 1")
        if bool((attention_mask.sum(1) == 0).any()):
            raise ValueError("the prompt is empty for at least one row (its attention_mask is all zeros)")
        # left padding only: once a row's mask turns 1 it must stay 1
        if bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
            raise ValueError("the batch is right-padded; pad on the left (tokenizer.padding_side = 'left'), "
                             "as transformers' generate expects for decoder-only models")
        return input_ids, attention_mask
