"""Checks that run before any forward: one clear error, and no work done.

Everything ``generate()`` is given is checked here (or by the module that owns the concept:
``multimodal.check_call`` for image inputs, ``state.cache_problem`` for caches), and every
proposal a plugin returns is checked before the target sees it, with the plugin's name in the
message. Pure functions of their arguments; nothing here runs a model.
"""

from __future__ import annotations

import numbers

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from .generators import Proposal
from .host import host_ints
from .modelinfo import vocab_size

INTEGER_DTYPES = (torch.long, torch.int32, torch.int16, torch.int8, torch.uint8)
#: generation modes whose output a speculative run reproduces
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


def check_positive_int(value, name: str) -> int:
    """``value`` as an int if it is a positive integer (not a bool); else a ValueError naming ``name``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_max_new_tokens(max_new_tokens) -> int:
    return check_positive_int(max_new_tokens, "max_new_tokens")


def check_flag(value, name: str) -> bool:
    """A True/False argument: anything else (``"no"``, 1) is refused rather than read for its truth."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


# -- positions ------------------------------------------------------------------------------------
def position_limit(model) -> int | None:
    """How many positions ``model`` has if they are learned absolute embeddings (GPT-2, OPT, ...:
    a table of ``max_position_embeddings`` rows, an ``IndexError`` past it), else None (rotary,
    ALiBi, sinusoidal positions take any index). Found as an embedding table other than the
    token embeddings with ``max_position_embeddings`` rows (OPT's has 2 more: its offset)."""
    config = model.config.get_text_config(decoder=True)
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    tokens = model.get_input_embeddings()
    for module in model.modules():
        if (isinstance(module, torch.nn.Embedding) and module is not tokens
                and limit <= module.num_embeddings <= limit + 2):
            return limit
    return None


def check_prompt_positions(model, lengths: torch.Tensor) -> None:
    """Refuse a prompt row longer than a learned-position model has positions (``generate()``
    fails with an ``IndexError`` inside its first forward)."""
    limit = position_limit(model)
    longest = int(lengths.max()) if lengths.numel() else 0
    if limit is not None and longest > limit:
        raise ValueError(f"the prompt has {longest} tokens, more than the {limit} positions "
                         f"{type(model).__name__} learned (config.max_position_embeddings={limit}); "
                         f"shorten it to at most {limit} tokens")


def check_rope_reach(model, reach: int) -> None:
    """Refuse a call whose rows may feed ``reach`` positions, past where ``model``'s RoPE changes
    with the sequence's length (dynamic NTK past ``max_position_embeddings``, LongRoPE past
    ``original_max_position_embeddings``): ``generate()`` rotates each new token by the
    frequencies of its own step's length (and Phi-3 then rebuilds its cache), a verification a
    whole block by its last token's."""
    config = model.config.get_text_config()
    rope = getattr(config, "rope_parameters", None) or {}
    per_layer_type = rope and all(isinstance(v, dict) for v in rope.values())
    kinds = list(rope.values()) if per_layer_type else [rope]
    for kind in kinds:
        name = kind.get("rope_type", "default")
        if "dynamic" in name:
            limit = config.max_position_embeddings
        elif name == "longrope":
            limit = kind.get("original_max_position_embeddings") or config.max_position_embeddings
        else:
            continue
        if reach > limit:
            raise ValueError(f"{type(model).__name__}'s RoPE ({name}) changes its frequencies past {limit} positions, "
                             f"which this call may feed ({reach}: the longest row and max_new_tokens, less one); generate() "
                             "rotates each new token by its own step's, a verification a block by its last "
                             f"token's: keep rows within {limit} positions")


# -- the call's generation config ------------------------------------------------------------------
#: the settings that select a generation mode other than greedy search and sampling, and the
#: value each has when it does not
MODE_SETTINGS = (("num_beams", 1), ("num_beam_groups", 1), ("penalty_alpha", None), ("dola_layers", None),
                 ("constraints", None), ("force_words_ids", None), ("prompt_lookup_num_tokens", None),
                 ("assistant_early_exit", None), ("use_mtp", False))
#: settings not reproduced in any mode: (name, whether a value sets it, what generate() would do)
OTHER_EFFECTS = (
    ("token_healing", bool, "re-tokenizing the prompt's last token"),
    ("output_attentions", bool, "attentions at every step"),
    ("output_hidden_states", bool, "hidden states at every step"),
    ("guidance_scale", lambda v: v != 1, "classifier-free guidance: a second forward per step, on a cache of "
                                         "its own"),
    ("cache_implementation", lambda v: v == "quantized", "a quantized key/value cache, which changes the logits"),
)


def unsupported_generation_settings(config: GenerationConfig) -> list[str]:
    """The settings of a call's resolved generation ``config`` (the target's ``generation_config``
    with the call's arguments on top, ``specdec/generation.py``) that a speculative run does not
    reproduce, each named with what ``generate()`` would do: a generation mode other than greedy
    search and sampling (beam search, contrastive search, DoLa, assisted generation, constraints),
    token healing, per-step attentions or hidden states, classifier-free guidance and SynthID
    watermarking (both remember earlier steps). Every other
    setting is honoured: logits processors apply at every verified position
    (``specdec/processors.py``), stop strings stop the run."""
    found = []
    mode = config.get_generation_mode()
    if mode not in SUPPORTED_MODES:
        named = [f"{name}={getattr(config, name, None)!r}" for name, off in MODE_SETTINGS
                 if getattr(config, name, off) not in (off, None)]
        found.append(f"{', '.join(named) or 'the generation config'} ({mode.value})")
    for name, is_set, what in OTHER_EFFECTS:
        value = getattr(config, name, None)
        if value is not None and is_set(value):
            found.append(f"{name}={value!r} ({what})")
    watermark = getattr(config, "watermarking_config", None)
    if watermark is not None and type(watermark).__name__.startswith("SynthID"):
        found.append(f"watermarking_config={type(watermark).__name__} (SynthID watermarking, which remembers "
                     "earlier steps)")
    return found


def check_generation_config(config: GenerationConfig) -> None:
    """Refuse a resolved generation ``config`` whose settings a speculative run would not reproduce."""
    unsupported = unsupported_generation_settings(config)
    if unsupported:
        raise ValueError(f"the generation settings set {'; '.join(unsupported)}: generate() would do this and a "
                         "speculative run does not, so the output would differ; unset those settings (on the call, "
                         "or on a copy of target.generation_config)")


# -- proposals ------------------------------------------------------------------------------------
def check_hidden_layers(layers, model, plugin: str) -> tuple[int, ...]:
    """A generator's ``DraftingInfo.hidden_layers``, checked against ``model`` before any forward:
    each an ``output_hidden_states`` index (0 .. num_hidden_layers); a ValueError naming the plugin."""
    count = model.config.get_text_config().num_hidden_layers + 1
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < count:
            raise ValueError(f"candidate generator {plugin!r} reads hidden state {layer!r} of {type(model).__name__}, "
                             f"which has {count} (0: the embeddings, then each of its {count - 1} layers)")
    return tuple(dict.fromkeys(int(layer) for layer in layers))


def _source_indexes(sources, batch: int, n_sources: int) -> bool:
    """Whether ``sources`` is an integer tensor [batch] of indexes in [0, n_sources)."""
    if not isinstance(sources, torch.Tensor) or sources.dtype not in INTEGER_DTYPES or tuple(sources.shape) != (batch,):
        return False
    picks = host_ints(sources)
    return not batch or (0 <= min(picks) and max(picks) < n_sources)


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
    counts = host_ints(lengths)  # host values: read from the device at most once (specdec/host.py)
    longest = max(counts, default=0)
    if min(counts, default=0) < 0 or longest > k:
        raise ValueError(f"{where}: Proposal.lengths {counts} must lie in [0, K={k}] "
                         f"(token_ids holds K={k} drafts per row)")
    if longest:  # the drafts within each row's length
        drafted = [token for row, n in zip(host_ints(ids), counts) for token in row[:n]]
        if min(drafted) < 0 or max(drafted) >= vocab:
            raise ValueError(f"{where} proposed ids outside the target's vocabulary [0, {vocab})")
    sources = proposal.sources
    if sources is not None and not _source_indexes(sources, batch, n_sources):
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
    if do_sample and longest:
        own = probs.gather(2, ids.clamp(0, vocab - 1).to(probs.device)[..., None]).squeeze(-1)  # [B, K]
        valid = torch.arange(k, device=probs.device)[None, :] < lengths.to(probs.device)[:, None]  # [B, K]
        if bool((own[valid] <= 0).any()):
            raise ValueError(f"{where}: Proposal.probs gives a draft probability 0 to a token it proposed; probs "
                             "must be the distribution the drafts were sampled from")
