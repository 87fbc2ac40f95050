"""Checks that run before any forward: one clear error, and no work done.

Everything ``generate()`` is given is checked here (or by the module that owns the concept:
``multimodal.check_call`` for image inputs, ``state.cache_problem`` for caches), and every
proposal a plugin returns is checked before the target sees it, with the plugin's name in the
message. Pure functions of their arguments; nothing here runs a model.
"""

from __future__ import annotations

import copy
import numbers

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from .generators import Proposal
from .modelinfo import vocab_size

INTEGER_DTYPES = (torch.long, torch.int32, torch.int16, torch.int8, torch.uint8)
#: generation modes whose output specdec reproduces (with its own sampling arguments)
SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:120]


# -- the prompt -----------------------------------------------------------------------------------
def check_prompt(input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (input_ids [B, L] long, attention_mask [B, L] long), left-padded rows, none empty."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None, :]
    if input_ids.dim() != 2 or input_ids.dtype not in INTEGER_DTYPES:
        raise ValueError(f"input_ids must be an integer tensor [batch, length], got {_describe(input_ids)}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: generation needs at least one input token")
    input_ids = input_ids.long()
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.dim() == 1:
        attention_mask = attention_mask[None, :]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
    # values first, in the mask's own dtype: casting 0.4 to an integer would silently drop a token
    if attention_mask.is_complex() or bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 and 1")
    attention_mask = attention_mask.long()
    if bool((attention_mask.sum(1) == 0).any()):
        raise ValueError("the prompt is empty for at least one row (its attention_mask is all zeros)")
    seen = attention_mask.cumsum(1)  # [B, L] attended tokens up to each column
    zero = attention_mask == 0
    holes = (zero & (seen > 0) & (seen < attention_mask.sum(1, keepdim=True))).any(1)  # [B] a 0 between 1s
    if bool(holes.any()):
        row = int(holes.nonzero()[0])
        raise ValueError(f"attention_mask row {row} has a hole (a 0 between 1s): specdec takes left-padded rows "
                         "whose tokens are all attended")
    if bool((zero & (seen > 0)).any()):
        raise ValueError("the batch is right-padded; pad on the left (tokenizer.padding_side = 'left'), "
                         "as transformers' generate expects for decoder-only models")
    return input_ids, attention_mask


def check_ids_in_vocab(input_ids: torch.Tensor, model) -> None:
    vocab = vocab_size(model)
    if int(input_ids.max()) >= vocab or int(input_ids.min()) < 0:
        raise ValueError(f"input_ids hold ids outside the target's vocabulary [0, {vocab})")


def check_max_new_tokens(max_new_tokens) -> int:
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    return int(max_new_tokens)


# -- the target's generation config ---------------------------------------------------------------
def _greedy_effects(model, config, prompt_length: int, eos: list[int]) -> list[str]:
    """What ``generate()`` would do beyond plain greedy decoding with ``config``: an unsupported
    generation mode and the logits processors ``transformers`` builds (by class name)."""
    config = copy.deepcopy(config)
    config.do_sample = False  # sampling warpers come from generate()'s own arguments
    config.eos_token_id = eos or None  # this call's EOS ids (min_new_tokens and kin depend on them)
    mode = config.get_generation_mode()
    effects = [mode.value] if mode not in SUPPORTED_MODES else []
    try:
        model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=model.device)
        processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=prompt_length,
                                                 device=str(model.device), model_kwargs={})
    except Exception as exc:  # a setting transformers itself cannot build a processor for
        return effects + [f"an unbuildable logits processor ({exc})"]
    return effects + [type(p).__name__ for p in processors]


def unsupported_generation_settings(model, prompt_length: int, eos: list[int]) -> list[str]:
    """The settings of ``model.generation_config`` that would make ``model.generate()`` differ.

    Asks ``transformers`` itself rather than a hand list: the generation mode the config selects
    (beam search, contrastive search, DoLa, ... are not reproduced) and the logits processors
    ``generate`` would build for a greedy call of this prompt length (repetition penalty, forced
    BOS, watermarking, ...). specdec applies none of them, so any of them changes the output. Each
    is traced back to the setting(s) whose default value makes it disappear."""
    config = model.generation_config
    effects = _greedy_effects(model, config, prompt_length, eos)
    if not effects:
        return []
    defaults = GenerationConfig()
    found = []
    for name, value in config.to_diff_dict().items():
        if not hasattr(defaults, name) or name == "transformers_version":
            continue
        trial = copy.deepcopy(config)
        setattr(trial, name, getattr(defaults, name))
        removed = [e for e in effects if e not in _greedy_effects(model, trial, prompt_length, eos)]
        if removed:
            found.append(f"{name}={value!r} ({', '.join(removed)})")
    return found or effects


def check_generation_config(model, prompt_length: int, eos: list[int]) -> None:
    unsupported = unsupported_generation_settings(model, prompt_length, eos)
    if unsupported:
        raise ValueError(f"target.generation_config sets {'; '.join(unsupported)}: target.generate() would apply "
                         "this and specdec does not, so its output would differ; unset those settings (e.g. on a "
                         "copy of the generation config) to decode speculatively")


# -- proposals ------------------------------------------------------------------------------------
def check_proposal(proposal, plugin: str, batch: int, vocab: int, do_sample: bool, n_sources: int = 1) -> None:
    """A plugin's proposal must be a well-formed :class:`Proposal` of target ids; name the plugin if not."""
    where = f"candidate generator {plugin!r}"
    if not isinstance(proposal, Proposal):
        raise TypeError(f"{where}: propose() must return a Proposal, got {_describe(proposal)}")
    ids, lengths, probs = proposal.token_ids, proposal.lengths, proposal.probs
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in INTEGER_DTYPES or ids.shape[0] != batch:
        raise ValueError(f"{where}: Proposal.token_ids must be an integer tensor [batch={batch}, K], got {_describe(ids)}")
    k = ids.shape[1]
    if (not isinstance(lengths, torch.Tensor) or lengths.dtype not in INTEGER_DTYPES
            or tuple(lengths.shape) != (batch,)):
        raise ValueError(f"{where}: Proposal.lengths must be an integer tensor [batch={batch}], got {_describe(lengths)}")
    if bool(((lengths < 0) | (lengths > k)).any()):
        raise ValueError(f"{where}: Proposal.lengths {lengths.tolist()} must lie in [0, K={k}] "
                         f"(token_ids holds K={k} drafts per row)")
    valid = torch.arange(k, device=ids.device)[None, :] < lengths.to(ids.device)[:, None]  # [B, K]
    drafted = ids[valid]
    if drafted.numel() and (int(drafted.min()) < 0 or int(drafted.max()) >= vocab):
        raise ValueError(f"{where} proposed ids outside the target's vocabulary [0, {vocab})")
    sources = proposal.sources
    if sources is not None and (not isinstance(sources, torch.Tensor) or sources.dtype not in INTEGER_DTYPES
                                or tuple(sources.shape) != (batch,)
                                or bool(((sources < 0) | (sources >= n_sources)).any())):
        raise ValueError(f"{where}: Proposal.sources must be None or an integer tensor [batch={batch}] of source "
                         f"indexes in [0, {n_sources}) (one per prior in drafting().priors), got {_describe(sources)}")
    confidence = proposal.confidence
    if confidence is not None and (not isinstance(confidence, torch.Tensor) or not confidence.is_floating_point()
                                   or confidence.dim() != 2 or confidence.shape[0] != batch or confidence.shape[1] < k):
        raise ValueError(f"{where}: Proposal.confidence must be None or a float tensor [batch={batch}, K={k}] of the "
                         f"drafts' probabilities, got {_describe(confidence)}")
    if probs is None:
        return
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point() or tuple(probs.shape) != (batch, k, vocab):
        raise ValueError(f"{where}: Proposal.probs must be None or a float tensor [batch={batch}, K={k}, "
                         f"vocab={vocab}], got {_describe(probs)}")
    if do_sample and drafted.numel():
        own = probs.gather(2, ids.clamp(0, vocab - 1).to(probs.device)[..., None]).squeeze(-1)  # [B, K]
        if bool((own[valid.to(probs.device)] <= 0).any()):
            raise ValueError(f"{where}: Proposal.probs gives a draft probability 0 to a token it proposed; probs "
                             "must be the distribution the drafts were sampled from")
