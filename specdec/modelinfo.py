"""Facts about a model that every part of specdec reads the same way: one definition each.

* :func:`token_id_list`: an id setting as configs and tokenizers spell it -> ``list[int]``;
* :func:`vocab_size`: the width of the model's logits (its output embedding rows);
* :func:`eos_token_ids`: the ids generation stops on (an explicit argument, else the model's
  ``generation_config``);
* :func:`pad_token_id`: the filler id (``pad_token_id``, else the first EOS id, else 0);
* :func:`cache_argument`: the keyword a model's forward takes its cache by;
* :class:`ForwardTimer`: counts a module's forward calls and the wall time spent inside them.

None of them modifies the model.
"""

from __future__ import annotations

import numbers
import time

import torch

#: the default of ``eos_token_id`` arguments: "not given", as distinct from an explicit None
UNSET = object()


def token_id_list(ids) -> list[int]:
    """An id setting as found in configs and tokenizers (None, an int, a list or a tensor) -> list.

    Strings, floats and booleans are refused: ``"12"`` is not the ids ``[1, 2]``."""
    if ids is None:
        return []
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    values = [ids] if not isinstance(ids, (list, tuple, set)) else list(ids)
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"token ids must be ints, got {ids!r}")
        if value < 0:
            raise ValueError(f"token ids must be >= 0, got {ids!r}")
        out.append(int(value))
    return out


def vocab_size(model) -> int:
    """Rows of the model's output embedding: the width of its logits."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (a language-modelling head is needed)")
    weight = getattr(head, "weight", None)  # torch.ao's quantized layers have a weight() method instead
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    features = getattr(head, "out_features", None)  # a quantized head keeps out_features
    # a pipeline stage without the head (transformers' PipelineIdentityLayer): the config's size
    return int(features) if features is not None else int(model.config.get_text_config().vocab_size)


def eos_token_ids(model, explicit=UNSET) -> list[int]:
    """The EOS ids to stop on: ``explicit`` when given (None or [] meaning "none"), else the
    model's ``generation_config.eos_token_id``, as ``transformers``' ``generate`` does."""
    if explicit is UNSET:
        explicit = getattr(model.generation_config, "eos_token_id", None)
    return token_id_list(explicit)


def pad_token_id(model, eos: list[int] | None = None) -> int:
    """The id written where a row has no token: the model's pad id, else its first EOS id, else 0."""
    pad = token_id_list(getattr(model.generation_config, "pad_token_id", None))
    if pad:
        return pad[0]
    eos = eos_token_ids(model) if eos is None else eos
    return eos[0] if eos else 0


def cache_argument(model) -> str:
    """The keyword its forward takes a cache by: ``cache`` where declared (``past_key_values`` is
    deprecated there, and a StaticCache passed by that name runs slower: docs/performance.md), else
    ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class ForwardTimer:
    """Counts ``module``'s forward calls and sums the wall time spent inside them.

    ``with ForwardTimer(model) as timer: ...`` then ``timer.calls``, ``timer.seconds``; hooks are
    removed on exit (or by :meth:`remove`)."""

    observes_only = True  # its hooks neither read nor change outputs (``head.model_logits`` relies on it)

    def __init__(self, module: torch.nn.Module):
        self.calls, self.seconds, self._start = 0, 0.0, 0.0
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *_) -> None:
        self._start = time.perf_counter()

    def _post(self, *_) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "ForwardTimer":
        return self

    def __exit__(self, *_) -> None:
        self.remove()


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers as stored (quantized tensors by their parts)."""
    seen: set[int] = set()

    def size(t: torch.Tensor) -> int:
        if callable(getattr(t, "to_local", None)):  # a DTensor: the shard this process holds (and reads)
            return size(t.to_local())
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
            names, _ = t.__tensor_flatten__()
            return sum(size(getattr(t, name)) for name in names)
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:  # tied weights are stored once
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    total = sum(size(t) for t in (*module.parameters(), *module.buffers()))
    for sub in module.modules():  # torch.ao's quantized layers keep int8 weights packed, outside both
        if type(sub).__module__.startswith("torch.ao.nn.quantized") and hasattr(sub, "in_features"):
            total += sub.in_features * sub.out_features + 4 * sub.out_features  # int8 weights, a scale per row
    return total


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decoding step reads: :func:`tensor_bytes` less the input embedding
    table, of which a step reads one row per token, unless the output head shares it (and so
    reads all of it). What the policy prices a model's forward by relative to another's."""
    total = tensor_bytes(model)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    table = getattr(embed, "weight", None)
    if not isinstance(table, torch.Tensor) or getattr(head, "weight", None) is table:  # tied: one parameter
        return max(total, 1)
    return max(total - tensor_bytes(embed), 1)


def kv_layout(model) -> tuple:
    """(layers, key/value heads, head size) of ``model``'s cache, from its config: two models
    with the same layout can read each other's keys and values. Where the config gives heads or
    head sizes per layer (transformers' heterogeneous configs, Gemma 4), those two are tuples
    with one entry a layer."""
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "is_heterogeneous", False):
        layers = [_heads_and_size(layer) for layer in config.per_layer_config]
        return (int(config.num_hidden_layers), tuple(h for h, _ in layers), tuple(d for _, d in layers))
    return (int(config.num_hidden_layers), *_heads_and_size(config))


def _heads_and_size(config) -> tuple[int, int]:
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    return int(kv_heads or 0), int(head_dim or 0)
