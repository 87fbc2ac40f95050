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

What each layout's ``config.json`` says, and how each numbers the aux layers, is
``layout_config.py``'s; the tensors' names and the vocabulary maps are ``layout_weights.py``'s.
Every tensor name outside the module is refused, except copies the head has no use for (the
target's embeddings, speculators' training-only copies of the verifier's norm and head).

Invariants: ``load_head(save_head(head, d, layout))`` has every parameter and buffer of ``head``;
``check_fit`` refuses a head that does not fit a target before any forward, naming the mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .head import Eagle3Head, HeadConfig
from .layout_config import (check_fit, head_config_of, hidden_to_specforge, specforge_config, specforge_to_hidden,
                            speculators_config)
from .layout_weights import from_head_names, to_head_names, vocab_maps

__all__ = ["LAYOUTS", "check_fit", "hidden_to_specforge", "load_head", "read_config", "read_weights", "save_head",
           "specforge_to_hidden"]

LAYOUTS = ("specforge", "speculators")

#: weight files, in the order they are looked for
_SAFETENSORS, _SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
_BIN, _BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


# -- config.json -> HeadConfig ----------------------------------------------------------------------
def read_config(folder, target_config=None) -> HeadConfig:
    """The :class:`HeadConfig` that ``folder``'s ``config.json`` describes (``target_config`` resolves
    defaults the file leaves to the target: aux layers, and the target's model type)."""
    return head_config_of(_read_json(_folder(folder)), target_config)[1]


# -- the folder's files ------------------------------------------------------------------------------
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


# -- load and save ----------------------------------------------------------------------------------
def load_head(folder, target_config=None, *, dtype: torch.dtype | None = None) -> Eagle3Head:
    """The head in ``folder`` (either layout), checked against ``target_config`` when given (before its
    weights are read). ``dtype``: its parameters' dtype (default: the checkpoint's, ``fc.weight``'s)."""
    folder = _folder(folder)
    layout, config = head_config_of(_read_json(folder), target_config)
    if target_config is not None:
        check_fit(config, target_config)
    state = to_head_names(read_weights(folder), layout)
    vocab_maps(state, config)
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
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; "
                             f"this config needs {tuple(expected[name].shape)}")
        if expected[name].is_floating_point() and not tensor.is_floating_point():
            raise ValueError(f"{layout} head in {str(folder)!r}: {name} is {tensor.dtype}; a head's weights are "
                             "floating point")
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
    document = specforge_config(config, dtype) if layout == "specforge" else speculators_config(
        config, dtype, verifier, speculative_tokens)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in from_head_names(head.state_dict(), layout).items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / _SAFETENSORS), metadata={"format": "pt"})
    with open(folder / "config.json", "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")
    return folder

