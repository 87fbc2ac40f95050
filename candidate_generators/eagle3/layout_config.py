"""An EAGLE-3 head's ``config.json`` in either layout, read into a :class:`HeadConfig` and written from one.

Aux layer numbering (``HeadConfig.aux_layers`` are indices into transformers'
``output_hidden_states``: 0 is the embeddings, ``i`` the output of layer ``i - 1``):

* SpecForge / SGLang id ``i`` is the *output* of layer ``i`` = hidden state ``i + 1``. SpecForge's HF
  target backend reads ``outputs.hidden_states[id + 1]`` ("offset 1" for the embeddings,
  specforge/modeling/target/eagle3_target_model.py); SGLang's ``set_eagle3_layers_to_capture``
  stores ``layers_to_capture = [id + 1 ...]`` and captures the residual stream *entering* those
  layers (python/sglang/srt/models/llama.py). Default when no ids are given:
  ``[1, n//2 - 1, n - 4]`` (SpecForge, specforge/algorithms/model_providers.py), which SGLang
  states directly as ``layers_to_capture = [2, n//2, n - 3]``.
* speculators / vLLM id ``i`` is the stream *entering* layer ``i`` = hidden state ``i``: vLLM's
  Llama appends ``hidden_states + residual`` before running layer ``idx`` when ``idx`` is in
  ``aux_hidden_state_layers`` (vllm/model_executor/models/llama.py), and takes the ids unchanged
  from ``eagle_aux_hidden_state_layer_ids`` (vllm/transformers_utils/configs/speculators/algos.py,
  gpu_model_runner ``_get_eagle3_aux_layers_from_config``). speculators' own converters add 1 to
  go from "hidden_states[id + 1]" numbering to theirs (speculators/convert/dflash/converter.py).
  Default: ``[2, n//2, n - 3]`` (vLLM ``get_eagle3_aux_hidden_state_layers``, speculators
  ``resolve_target_layer_ids``).

Both defaults are the same hidden states, ``HeadConfig.for_target``'s; absent ids resolve through
it, and so need the target's config.

Every variant the head does not compute is refused, naming it (``fc_norm``, ``norm_before_fc``,
``norm_before_residual``, speculators' ``norm_output``, SpecForge's ``norm_output: false``, more
than one layer, tied embeddings, biases, a head of another width than its target), and
:func:`check_fit` refuses a head that does not fit a target before any forward, naming the mismatch.
"""

from __future__ import annotations

import dataclasses

import torch

from .head import HeadConfig

SPECFORGE_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_TYPE = "eagle3"

#: the Llama fields a head's shape is read from; the first four have no sensible default
_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
_SHAPE_FIELDS = _REQUIRED + ("num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                             "rope_theta", "rope_scaling", "rope_parameters")


# -- which layout -----------------------------------------------------------------------------------
def detect_layout(config: dict) -> str:
    """``config.json``'s contents -> ``"specforge"`` or ``"speculators"``."""
    if config.get("speculators_model_type") == SPECULATORS_TYPE:
        return "speculators"
    if SPECFORGE_ARCH in (config.get("architectures") or []):
        return "specforge"
    raise ValueError("not an EAGLE-3 head layout this project reads: looked for architectures containing "
                     f"{SPECFORGE_ARCH!r} (SpecForge) and speculators_model_type == {SPECULATORS_TYPE!r} "
                     f"(speculators), found architectures={config.get('architectures')!r}, "
                     f"speculators_model_type={config.get('speculators_model_type')!r}")


# -- aux layer numbering ----------------------------------------------------------------------------
def layer_ids(ids, where: str) -> tuple[int, ...]:
    """A config's list of layer ids, each a whole number >= 0 (a fraction was truncated, and
    SpecForge's -1 loaded as the embeddings, which no layer's output is)."""
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise ValueError(f"config.json's {where}={ids!r}: expected a list of layer ids, whole numbers >= 0")
    return tuple(ids)


def specforge_to_hidden(ids) -> tuple[int, ...]:
    """SpecForge/SGLang layer ids (outputs of layers) -> ``output_hidden_states`` indices."""
    return tuple(i + 1 for i in layer_ids(list(ids), "eagle_config.eagle_aux_hidden_state_layer_ids"))


def hidden_to_specforge(layers) -> list[int]:
    """``output_hidden_states`` indices -> SpecForge/SGLang layer ids."""
    if any(int(i) < 1 for i in layers):
        raise ValueError(f"aux_layers={tuple(layers)}: SpecForge numbers layers by their outputs, so hidden "
                         "state 0 (the embeddings) has no id there")
    return [int(i) - 1 for i in layers]


def _default_aux_layers(target_config, where: str) -> tuple[int, ...]:
    if target_config is None:
        raise ValueError(f"config.json records no aux layer ids ({where}); their default depends on the "
                         "target's layer count: pass target_config")
    return HeadConfig.for_target(getattr(target_config, "config", target_config), draft_vocab_size=1).aux_layers


# -- config.json -> HeadConfig ----------------------------------------------------------------------
def head_config_of(config: dict, target_config) -> tuple[str, HeadConfig]:
    """``config.json``'s contents -> (its layout, the :class:`HeadConfig` it describes); ``target_config``
    resolves defaults the file leaves to the target."""
    layout = detect_layout(config)
    if layout == "specforge":
        shape, aux, extra = _specforge_fields(config, target_config)
    else:
        shape, aux, extra = _speculators_fields(config, target_config)
    missing = [k for k in _REQUIRED if shape.get(k) is None]
    if missing:
        raise ValueError(f"{layout} config.json lacks {', '.join(missing)}")
    if shape.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"{layout} head uses hidden_act={shape['hidden_act']!r}; the head computes silu only")
    from transformers import LlamaConfig  # parses Llama's rope fields, old and new, and fills defaults

    llama = LlamaConfig(**{k: v for k, v in shape.items() if k in _SHAPE_FIELDS and v is not None})
    hidden = llama.hidden_size
    draft_vocab = extra["draft_vocab_size"] or llama.vocab_size
    target_hidden = extra["target_hidden_size"] or hidden
    if target_hidden != hidden:
        raise ValueError(f"{layout} head is {hidden} wide but reads a {target_hidden}-wide target: such a head "
                         "embeds tokens with its own embed_tokens, which this head does not hold (it uses the "
                         "target's embeddings)")
    head_config = HeadConfig.for_target(llama, draft_vocab_size=draft_vocab, aux_layers=aux)
    model_type = extra["target_model_type"]
    if model_type is None and target_config is not None:
        model_type = _text(target_config).model_type
    return layout, dataclasses.replace(head_config, target_hidden_size=target_hidden,
                                       target_model_type=model_type or "")


def _specforge_fields(config: dict, target_config):
    """SpecForge's draft config (specforge/modeling/draft/llama3_eagle.py, configs/*-eagle3.json)."""
    _refuse_variants("specforge", config, {
        "num_hidden_layers": lambda v: v not in (None, 1),  # SGLang adds plain layers after midlayer
        "tie_word_embeddings": bool,  # SGLang then makes lm_head the embeddings
        "fc_norm": bool, "attention_bias": bool, "mlp_bias": bool, "bias": bool,
        "norm_output": lambda v: v is False,  # compute_logits then skips the norm
    })
    eagle = config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise ValueError("specforge head has eagle_config.use_aux_hidden_state=false: it fuses no target layers")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    aux = specforge_to_hidden(ids) if ids else None
    direct = config.get("eagle_aux_hidden_state_layer_ids")  # vLLM reads a top-level list in its own numbering
    if direct:
        if aux is not None and tuple(direct) != aux:
            raise ValueError(f"config.json's eagle_config.eagle_aux_hidden_state_layer_ids={list(ids)} (SpecForge "
                             f"ids, hidden states {list(aux)}) disagrees with the top-level "
                             f"eagle_aux_hidden_state_layer_ids={list(direct)} (vLLM's numbering)")
        aux = layer_ids(direct, "eagle_aux_hidden_state_layer_ids")
    if aux is None:
        aux = _default_aux_layers(target_config, "eagle_config.eagle_aux_hidden_state_layer_ids")
    extra = {"draft_vocab_size": config.get("draft_vocab_size"),
             "target_hidden_size": config.get("target_hidden_size"),
             "target_model_type": (config.get("specdec") or {}).get("target_model_type")}
    return config, aux, extra


def _speculators_fields(config: dict, target_config):
    """speculators' ``Eagle3SpeculatorConfig`` (src/speculators/models/eagle3/config.py), as vLLM reads it
    (vllm/transformers_utils/configs/speculators/{base,algos}.py)."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("speculators config.json lacks transformer_layer_config (the draft layer's shape)")
    if layer.get("model_type") != "llama":
        raise ValueError(f"speculators head has a {layer.get('model_type')!r} layer (a missing model_type means "
                         "qwen3 to speculators); the head is a Llama layer")
    if "norm_before_residual" not in config:
        raise ValueError("speculators config.json does not say norm_before_residual: speculators defaults it to "
                         "false, vLLM's reader to true, so the head's residual is ambiguous")
    _refuse_variants("speculators", config, {
        "norm_before_residual": bool, "norm_before_fc": bool, "fc_norm": bool, "norm_output": bool,
        "embed_requires_grad": bool,  # its trained embeddings would differ from the target's
    })
    _refuse_variants("speculators transformer_layer_config", layer, {
        "num_hidden_layers": lambda v: v not in (None, 1), "tie_word_embeddings": bool,
        "attention_bias": bool, "mlp_bias": bool,
    })
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    aux = layer_ids(ids, "eagle_aux_hidden_state_layer_ids") if ids else \
        _default_aux_layers(target_config, "eagle_aux_hidden_state_layer_ids")
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {})
    model_type = ((config.get("specdec") or {}).get("target_model_type")
                  or _model_type_of(verifier.get("architectures")))
    extra = {"draft_vocab_size": config.get("draft_vocab_size"),
             "target_hidden_size": config.get("target_hidden_size"),
             "target_model_type": model_type}
    return layer, aux, extra


def _refuse_variants(where: str, config: dict, tests: dict) -> None:
    for key, unsupported in tests.items():
        if key in config and unsupported(config[key]):
            raise ValueError(f"{where} head has {key}={config[key]!r}, which this head does not compute")


def _model_type_of(architectures) -> str | None:
    """A verifier's class names (``["LlamaForCausalLM"]``) -> its transformers model type, or None when
    unknown or ambiguous (several model types share ``LlamaForCausalLM``; the one spelled like the
    class, ``llama``, is taken)."""
    from transformers.models.auto import modeling_auto

    for arch in architectures or []:
        types = [t for names in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                 modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
                 for t, name in names.items() if name == arch]
        stem = arch.split("For")[0].replace("_", "").lower()
        spelled = [t for t in types if t.replace("_", "").replace("-", "") == stem]
        if len(set(types)) == 1 or spelled:
            return (spelled or types)[0]
    return None


def _architecture_of(model_type: str) -> list[str]:
    from transformers.models.auto import modeling_auto

    name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return [name] if isinstance(name, str) else []


# -- fit ---------------------------------------------------------------------------------------------
def _text(target_config):
    target_config = getattr(target_config, "config", target_config)  # a model is accepted too
    return getattr(target_config, "text_config", None) or target_config


def check_fit(config: HeadConfig, target_config) -> None:
    """Refuse (``ValueError`` naming the mismatch) a head that cannot draft for ``target_config``."""
    outer = getattr(target_config, "config", target_config)
    text = _text(target_config)
    if config.target_model_type and config.target_model_type not in (getattr(outer, "model_type", None),
                                                                     getattr(text, "model_type", None)):
        raise ValueError(f"the head was made for a {config.target_model_type!r} target; this target is "
                         f"{text.model_type!r}")
    if config.target_hidden_size != text.hidden_size:
        raise ValueError(f"the head fuses target hidden states {config.target_hidden_size} wide; the target's "
                         f"hidden_size is {text.hidden_size}")
    if config.hidden_size != text.hidden_size:
        raise ValueError(f"the head is {config.hidden_size} wide but embeds tokens with the target's "
                         f"{text.hidden_size}-wide embeddings")
    if config.vocab_size != text.vocab_size:
        raise ValueError(f"the head maps a vocabulary of {config.vocab_size} tokens (t2d); the target's "
                         f"vocab_size is {text.vocab_size}")
    layers = text.num_hidden_layers
    bad = [i for i in config.aux_layers if not 0 <= i <= layers]
    if bad:
        raise ValueError(f"aux layers {bad} are out of range: a {layers}-layer target has output_hidden_states "
                         f"0..{layers}")


# -- HeadConfig -> config.json ---------------------------------------------------------------------
def _layer_fields(c: HeadConfig) -> dict:
    """The Llama fields both layouts spell the same way (rope in the old and the new spelling)."""
    rope = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
            "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling, "rope_parameters": rope,
            "vocab_size": c.vocab_size, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}


def specforge_config(c: HeadConfig, dtype: torch.dtype) -> dict:
    return {"architectures": [SPECFORGE_ARCH], **_layer_fields(c), "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": hidden_to_specforge(c.aux_layers)},
            "torch_dtype": str(dtype).removeprefix("torch."), "specdec": {"target_model_type": c.target_model_type}}


def speculators_config(c: HeadConfig, dtype: torch.dtype, verifier: str | None, tokens: int) -> dict:
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": SPECULATORS_TYPE,
            "transformer_layer_config": _layer_fields(c), "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size, "norm_before_residual": False, "norm_before_fc": False,
            "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
            "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
                "verifier": {"name_or_path": verifier, "architectures": _architecture_of(c.target_model_type)}},
            "torch_dtype": str(dtype).removeprefix("torch."), "specdec": {"target_model_type": c.target_model_type}}
