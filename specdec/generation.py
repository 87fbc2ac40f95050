"""A call's generation settings, resolved as ``model.generate()`` resolves them.

Both doors into a decode run end with the same three things: a ``GenerationConfig`` (the
target's ``generation_config``, the call's arguments on top, ``transformers``' global defaults
under both), the ``LogitsProcessorList`` ``generate()`` builds from it, and what the run needs
of it (:class:`Resolved`: sampling parameters, new-token budget, EOS and pad ids, stop strings,
the outputs asked for).

* ``SpecDecoder.generate(...)`` resolves them here with ``transformers``' own preparation
  (``_prepare_generation_config``, ``_prepare_special_tokens``, ``_prepare_generated_length``,
  ``_get_logits_processor``), so its defaults are the target's ``generation_config``: a model
  that ships ``do_sample=True`` with a temperature samples, as ``model.generate()`` would.
* ``model.generate(custom_generate=specdec.generate)`` gets them prepared by ``generate()``
  itself (``specdec/integration.py``).

What a speculative run cannot reproduce is refused by name before any forward
(``validation.check_generation_config``): generation modes other than greedy search and sampling,
token healing, per-step attentions and hidden states, and the processors that remember earlier
steps (``specdec/processors.py``). Several sampled sequences per prompt are rows repeated
(``specdec/return_sequences.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from .modelinfo import token_id_list
from .sampling import SamplingParams

#: GenerationConfig attributes a call may set
GENERATION_SETTINGS = frozenset(name for name in vars(GenerationConfig()) if not name.startswith("_"))


@dataclass
class Resolved:
    """What a decode run takes from a resolved generation config."""

    config: GenerationConfig
    sampling: SamplingParams
    max_new_tokens: int
    eos: list[int]
    pad: int
    stop_strings: list[str] | None = None
    return_dict: bool = False
    output_scores: bool = False
    output_logits: bool = False


def split_settings(kwargs: dict) -> tuple[dict, dict]:
    """A call's keyword arguments -> (generation settings, model inputs): a ``GenerationConfig``
    attribute is a setting (``repetition_penalty=1.2``), anything else goes to the model."""
    settings = {k: v for k, v in kwargs.items() if k in GENERATION_SETTINGS}
    return settings, {k: v for k, v in kwargs.items() if k not in settings}


def resolve_config(model, generation_config: GenerationConfig | None, settings: dict,
                   prompt_width: int) -> GenerationConfig:
    """The config ``model.generate(generation_config=..., **settings)`` would decode with for a
    prompt of ``prompt_width`` columns: merged, special tokens as tensors, lengths absolute."""
    default_max = (settings.get("max_length") is None and getattr(generation_config, "max_length", None) is None
                   and model.generation_config.max_length is None)
    default_min = (settings.get("min_length") is None and getattr(generation_config, "min_length", None) is None
                   and model.generation_config.min_length is None)
    config, _ = model._prepare_generation_config(generation_config, **settings)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=model.device)
    return model._prepare_generated_length(config, has_default_max_length=default_max,
                                           has_default_min_length=default_min, model_input_name="input_ids",
                                           input_ids_length=prompt_width, inputs_tensor=None)


def inferred_mask(model, input_ids: torch.Tensor, config: GenerationConfig | None = None) -> torch.Tensor:
    """``[B, L]`` the attention mask ``generate()`` uses when given none, with ``config``'s special
    tokens (default: the model's ``generation_config``): the pad id's columns are padding, unless
    the pad id is an EOS id."""
    if config is None:
        config = copy.deepcopy(model.generation_config)
        model._prepare_special_tokens(config, kwargs_has_attention_mask=False, device=model.device)
    return model._prepare_attention_mask_for_generation(input_ids.to(model.device), config, {})


def build_processors(model, config: GenerationConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     prefix_allowed_tokens_fn=None, logits_processor=None):
    """The ``LogitsProcessorList`` ``generate()`` builds for this call (warpers included when sampling)."""
    return model._get_logits_processor(
        generation_config=config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, logits_processor=logits_processor,
        device=input_ids.device, model_kwargs={"attention_mask": attention_mask})


def sampling_of(config: GenerationConfig) -> SamplingParams:
    """The sampling parameters of a resolved config (those a plugin reads in ``ctx.sampling``)."""
    temperature = 1.0 if config.temperature is None else config.temperature
    return SamplingParams(bool(config.do_sample), temperature, config.top_k, config.top_p, config.min_p)


def resolved(config: GenerationConfig, prompt_width: int, max_length: int | None = None,
             eos: list[int] | None = None) -> Resolved:
    """Read a resolved ``config`` (``max_length`` and ``eos``, where ``generate()``'s stopping
    criteria say otherwise). Raises ValueError when the prompt leaves no room for a new token."""
    max_length = config.max_length if max_length is None else max_length
    if max_length is None or max_length <= prompt_width:
        raise ValueError(f"max_new_tokens must be a positive int: max_length={max_length} leaves no new token "
                         f"after a prompt of {prompt_width} columns (set max_new_tokens)")
    eos = token_id_list(config.eos_token_id) if eos is None else eos
    pad = token_id_list(config.pad_token_id)
    strings = config.stop_strings
    return Resolved(config, sampling_of(config), max_length - prompt_width, eos,
                    pad[0] if pad else (eos[0] if eos else 0),
                    [strings] if isinstance(strings, str) else (list(strings) if strings else None),
                    bool(config.return_dict_in_generate), bool(config.output_scores), bool(config.output_logits))
