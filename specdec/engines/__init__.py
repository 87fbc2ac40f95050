"""Engines: how one model's forward runs, behind one small protocol (docs/engines.md).

This module is the only part of ``specdec.engines`` that code outside the package may import
(``tests/test_layout.py`` checks it); an engine's own modules stay private to the package.

The protocol, for a batch of B rows feeding T columns each after the S slots their cache holds::

    engine.forward(input_ids [B, T], positions [B, T] (or [3, B, T]), *, layout=CAUSAL, cache=None,
                   attention_mask [B, N] = None, hidden_layers=(), logits_to_keep=None,
                   model_inputs=None) -> EngineOutput(logits [B, T, V], hidden {layer: [B, T, H]})

* :class:`Layout`: a causal block (``CAUSAL``) or a tree, ``Layout.tree(parents [B, K], start [B],
  lengths [B])`` with ``parents[b, i]`` node i's parent (-1: the pending token), parents before
  children, as ``Proposal.parents`` will carry it. A tree node sees the committed prefix and its
  ancestors only; its position is the root's plus its depth (``Layout.chain_columns``).
* :class:`EngineOutput`: the logits and the hidden states asked for, numbered as
  ``output_hidden_states`` numbers them.
* :class:`LayoutNotSupported`: an engine cannot run a layout on a model; it names the model and
  why. The caller runs a chain instead, never different logits.

Engines: ``"eager"``, the model's own ``forward`` and nothing else (:func:`make_engine`).
"""

from __future__ import annotations

from .base import CAUSAL, Engine, EngineOutput, Layout, LayoutNotSupported
from .eager import EagerEngine

#: engine name -> its class (constructed with the model it serves)
ENGINES = {EagerEngine.name: EagerEngine}


def make_engine(name: str, model) -> Engine:
    """The engine called ``name``, serving ``model``; an unknown name gets a ValueError with a hint."""
    from ..names import did_you_mean

    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}.{did_you_mean(name, ENGINES)} Known: {', '.join(ENGINES)}")
    return ENGINES[name](model)


__all__ = ["CAUSAL", "ENGINES", "EagerEngine", "Engine", "EngineOutput", "Layout", "LayoutNotSupported",
           "make_engine"]
