"""EAGLE-3 heads on disk: SpecForge's layout and vLLM ``speculators``' layout, both ways.

A head folder holds ``config.json`` and its weights (``model.safetensors``, a sharded
``model.safetensors.index.json``, or ``pytorch_model.bin`` / its index). The layout is read from
``config.json``:

* **specforge** (SpecForge's ``LlamaForCausalLMEagle3``, which SGLang serves): ``architectures``
  contains ``"LlamaForCausalLMEagle3"``; a flat Llama config (the head's own shape,
  ``num_hidden_layers: 1``) with ``vocab_size`` (the target's), ``draft_vocab_size``, optional
  ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``. Weight names are
  the module's own (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``).
* **speculators**: ``speculators_model_type == "eagle3"``; the layer's shape in
  ``transformer_layer_config``, with top-level ``draft_vocab_size``, ``target_hidden_size``,
  ``norm_before_residual``, ``eagle_aux_hidden_state_layer_ids`` and
  ``speculators_config.verifier``. Weights say ``layers.0.*`` where the module says ``midlayer.*``.

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

Vocabulary: draft id ``d`` is target id ``d + d2t[d]`` (SGLang ``hot_token_id = d2t + arange``,
vLLM ``compute_logits``: ``targets = arange + draft_id_to_target_id``); ``t2d`` is redundant with
``d2t`` (both servers skip it), so one of them is derived from the other when only one is stored,
and both are the identity when neither is and the two vocabularies are the same size
(speculators stores neither then).

``embed_tokens.weight`` is skipped when present: the head embeds tokens with the target's own input
embeddings (``head.py``). SpecForge's training checkpoints have left it out since 2025-08 (commit
"do not save embedding layer", scripts/train_eagle3_{online,offline}.py, now scripts/train_eagle3.py)
but its HF export adds it back (specforge/export/to_hf.py); speculators' drafts save it. Every other
name outside the module is refused, as is every variant the module does not compute (``fc_norm``,
``norm_before_fc``, ``norm_before_residual``, speculators' ``norm_output``, SpecForge's
``norm_output: false``, more than one layer, tied embeddings, biases, a head of another width than
its target).

Invariants: ``load_head(save_head(head, d, layout))`` has every parameter and buffer of ``head``;
``check_fit`` refuses a head that does not fit a target before any forward, naming the mismatch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .head import Eagle3Head, HeadConfig

LAYOUTS = ("specforge", "speculators")

SPECFORGE_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_TYPE = "eagle3"

#: weight files, in the order they are looked for
_SAFETENSORS, _SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
_BIN, _BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"

#: names a checkpoint may carry that the head has no use for: the drafter's copy of the target's
#: embeddings, and speculators' training-only copies of the verifier's norm and head
_SKIPPED = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")

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
def specforge_to_hidden(ids) -> tuple[int, ...]:
    """SpecForge/SGLang layer ids (outputs of layers) -> ``output_hidden_states`` indices."""
    return tuple(int(i) + 1 for i in ids)


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
def read_config(folder, target_config=None) -> HeadConfig:
    """The :class:`HeadConfig` that ``folder``'s ``config.json`` describes (``target_config`` resolves
    defaults the file leaves to the target: aux layers, and the target's model type)."""
    return _head_config(_read_json(_folder(folder)), target_config)[1]


def _head_config(config: dict, target_config) -> tuple[str, HeadConfig]:
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
        aux = tuple(int(i) for i in direct)
    if aux is None:
        aux = _default_aux_layers(target_config, "eagle_config.eagle_aux_hidden_state_layer_ids")
    extra = {"draft_vocab_size": config.get("draft_vocab_size"), "target_hidden_size": config.get("target_hidden_size"),
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
    aux = tuple(int(i) for i in ids) if ids else _default_aux_layers(target_config, "eagle_aux_hidden_state_layer_ids")
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {})
    model_type = (config.get("specdec") or {}).get("target_model_type") or _model_type_of(verifier.get("architectures"))
    extra = {"draft_vocab_size": config.get("draft_vocab_size"), "target_hidden_size": config.get("target_hidden_size"),
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


# -- weights -------------------------------------------------------------------------------------------
def _folder(folder) -> Path:
    path = Path(folder)
    if not path.exists():
        raise FileNotFoundError(f"no head folder at {str(path)!r}")
    if not path.is_dir():
        raise NotADirectoryError(f"{str(path)!r} is a file; a head is a folder with config.json and weights")
    return path


def _read_json(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise FileNotFoundError(f"{str(folder)!r} has no config.json (found: {found})")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def read_weights(folder) -> dict[str, torch.Tensor]:
    """Every tensor in ``folder``'s weight files, by its stored name."""
    from safetensors.torch import load_file

    folder = _folder(folder)
    for single, index in ((_SAFETENSORS, _SAFETENSORS_INDEX), (_BIN, _BIN_INDEX)):
        if (folder / single).is_file():
            files = [folder / single]
        elif (folder / index).is_file():
            with open(folder / index, encoding="utf-8") as handle:
                files = [folder / name for name in sorted(set(json.load(handle)["weight_map"].values()))]
        else:
            continue
        state: dict[str, torch.Tensor] = {}
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"{index} names {path.name}, which {str(folder)!r} lacks")
            if path.suffix == ".safetensors":
                state.update(load_file(path))
            else:
                state.update(torch.load(path, map_location="cpu", weights_only=True))
        return state
    raise FileNotFoundError(f"{str(folder)!r} has no weights (looked for {_SAFETENSORS}, {_SAFETENSORS_INDEX}, "
                            f"{_BIN}, {_BIN_INDEX})")


def to_head_names(state: dict, layout: str) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors -> the module's names (skipping those in ``_SKIPPED``)."""
    renamed = {}
    for name, tensor in state.items():
        if name in _SKIPPED:
            continue
        if layout == "speculators" and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        renamed[name] = tensor
    return renamed


def from_head_names(state: dict, layout: str) -> dict[str, torch.Tensor]:
    """The module's names -> ``layout``'s."""
    if layout == "specforge":
        return dict(state)
    return {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()}


def _vocab_maps(state: dict, config: HeadConfig) -> None:
    """Fill in ``d2t``/``t2d`` where one or both are absent, and check that they agree, in place."""
    vocab, draft = config.vocab_size, config.draft_vocab_size
    d2t, t2d = state.get("d2t"), state.get("t2d")
    for name, tensor, size in (("d2t", d2t, draft), ("t2d", t2d, vocab)):
        if tensor is not None and tuple(tensor.shape) != (size,):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected ({size},)")
    if d2t is None and t2d is None:
        if draft != vocab:
            raise ValueError(f"the checkpoint lacks d2t and t2d, which a draft vocabulary of {draft} tokens "
                             f"(of {vocab}) needs")
        d2t, t2d = torch.zeros(draft, dtype=torch.long), torch.ones(vocab, dtype=torch.bool)
    elif d2t is None:
        ids = t2d.bool().nonzero().flatten()  # [draft], ascending
        if ids.numel() != draft:
            raise ValueError(f"t2d marks {ids.numel()} tokens; the draft vocabulary has {draft}")
        d2t = ids - torch.arange(draft)
    targets = torch.arange(draft) + d2t.long()  # [draft]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"d2t maps draft ids outside the target vocabulary 0..{vocab - 1}")
    if targets.unique().numel() != draft:
        raise ValueError("d2t maps two draft ids to the same target id")
    if t2d is None:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[targets] = True
    t2d = t2d.bool()
    if int(t2d.sum()) != draft or not bool(t2d[targets].all()):
        raise ValueError("t2d disagrees with d2t: they must name the same target ids")
    state["d2t"], state["t2d"] = d2t.long(), t2d


# -- load and save ----------------------------------------------------------------------------------
def load_head(folder, target_config=None, *, dtype: torch.dtype | None = None) -> Eagle3Head:
    """The head in ``folder`` (either layout), checked against ``target_config`` when given (before its
    weights are read). ``dtype``: its parameters' dtype (default: the checkpoint's, ``fc.weight``'s)."""
    folder = _folder(folder)
    layout, config = _head_config(_read_json(folder), target_config)
    if target_config is not None:
        check_fit(config, target_config)
    state = to_head_names(read_weights(folder), layout)
    _vocab_maps(state, config)
    head = Eagle3Head(config)
    expected = head.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{layout} head in {str(folder)!r}: "
                         + "; ".join(part for part in (f"missing {', '.join(missing)}" if missing else "",
                                                       f"unexpected {', '.join(unexpected)}" if unexpected else "")
                                     if part))
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; this config needs {tuple(expected[name].shape)}")
    dtype = dtype or state["fc.weight"].dtype
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    head.load_state_dict(state, assign=True)  # parameters take the checkpoint's tensors; inv_freq stays fp32
    return head


def save_head(head: Eagle3Head, folder, layout: str = "specforge", *, verifier: str | None = None,
              speculative_tokens: int = 3) -> Path:
    """Write ``head`` into ``folder`` (created if need be) as ``layout``: ``config.json`` with the fields
    SpecForge/SGLang or speculators/vLLM read, and ``model.safetensors``. ``verifier`` (speculators
    only): the target's name or path, recorded in ``speculators_config.verifier``."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"unknown head layout {layout!r}; one of {', '.join(LAYOUTS)}")
    config = head.config
    dtype = head.fc.weight.dtype
    document = _specforge_config(config, dtype) if layout == "specforge" else _speculators_config(
        config, dtype, verifier, speculative_tokens)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in from_head_names(head.state_dict(), layout).items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / _SAFETENSORS), metadata={"format": "pt"})
    with open(folder / "config.json", "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")
    return folder


def _layer_fields(c: HeadConfig) -> dict:
    """The Llama fields both layouts spell the same way (rope in the old and the new spelling)."""
    rope = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
            "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling, "rope_parameters": rope,
            "vocab_size": c.vocab_size, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}


def _specforge_config(c: HeadConfig, dtype: torch.dtype) -> dict:
    return {"architectures": [SPECFORGE_ARCH], **_layer_fields(c), "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": hidden_to_specforge(c.aux_layers)},
            "torch_dtype": str(dtype).removeprefix("torch."), "specdec": {"target_model_type": c.target_model_type}}


def _speculators_config(c: HeadConfig, dtype: torch.dtype, verifier: str | None, tokens: int) -> dict:
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
