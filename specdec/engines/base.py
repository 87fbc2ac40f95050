"""The engine protocol's types: what a forward is fed (:class:`Layout`) and what it returns.

Re-exported by ``specdec.engines``, the only module of this package the core may import; engines
import these from here (not from the package root), so the root can import every engine without
an import cycle.

A forward feeds ``T`` columns per row after the ``S`` slots its cache holds. The *layout* says
which fed columns each fed column attends to:

* **causal** (the default): column j sees columns 0..j, as a plain chain.
* **tree**: the columns before ``start[b]`` are a causal chain (the row's pending tokens, the last
  of which, column ``start[b] - 1``, is the tree's root); columns ``start[b] .. start[b] + K - 1``
  hold the row's draft nodes 0..K-1, node i having ``parents[b, i]`` as its parent (-1: the root),
  parents before children. A node sees the chain and its own ancestors, never a sibling or a
  cousin. Nodes at or past ``lengths[b]`` are padding: each sees the chain and itself only.
  Columns after the nodes, if any, are padding too and see everything before them (their outputs
  are filler).

Positions are the caller's (``positions [B, T]``, or ``[3, B, T]`` for mRoPE models): a tree
node's position is the position its token would have in its own root-to-node chain, i.e. the
root's plus its depth. :meth:`Layout.chain_columns` gives, for each fed column, the column it
would occupy in that chain; a caller that computes positions from token indices feeds
``index + (chain_columns - arange(T))``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch


class LayoutNotSupported(NotImplementedError):
    """An engine cannot run this layout for this model (it says which model and why); the caller
    falls back to what it can run (a chain), never to different logits."""


@dataclass(frozen=True)
class Layout:
    """Which fed columns each fed column attends to; see the module docstring.

    ``parents [B, K]`` long (None: causal), ``start [B]`` long (the fed column of each row's node 0;
    None: the nodes are the last K columns), ``lengths [B]`` long (nodes per row; None: all K)."""

    parents: torch.Tensor | None = None
    start: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    @classmethod
    def tree(cls, parents: torch.Tensor, start: torch.Tensor | None = None,
             lengths: torch.Tensor | None = None) -> "Layout":
        """A tree layout, checked: refuses a malformed ``parents`` with a ValueError."""
        layout = cls(parents=parents, start=start, lengths=lengths)
        layout.check()
        return layout

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    # -- checks -----------------------------------------------------------------------------------
    def check(self, width: int | None = None, batch: int | None = None) -> None:
        """Raise ValueError unless the tree is well formed (and fits ``width`` fed columns of
        ``batch`` rows): ``parents`` a ``[B, K]`` integer tensor, every real node's parent in
        ``-1 .. i-1`` (an index past the row is out of range; one at or after its child would
        make the child come first, or a cycle), ``start`` and ``lengths`` ``[B]`` within range."""
        if self.parents is None:
            if self.start is not None or self.lengths is not None:
                raise ValueError("a causal layout takes no start or lengths (give parents for a tree)")
            return
        parents = self.parents
        if parents.dim() != 2 or parents.dtype.is_floating_point or parents.dtype == torch.bool:
            raise ValueError(f"tree parents must be an integer tensor [batch, nodes], got {parents.dtype} "
                             f"{tuple(parents.shape)}")
        rows, nodes = parents.shape
        if batch is not None and rows != batch:
            raise ValueError(f"tree parents have {rows} rows for a batch of {batch}")
        lengths = self._lengths()
        if self.lengths is not None and (lengths.shape != (rows,) or bool(((lengths < 0) | (lengths > nodes)).any())):
            raise ValueError(f"tree lengths must be [{rows}] within 0..{nodes}, got {self.lengths.tolist()}")
        index = torch.arange(nodes, device=parents.device)  # [K]
        real = index[None, :] < lengths[:, None]  # [B, K]
        for problem, bad in (("out of range (below -1 or past the row's nodes)", (parents < -1) | (parents >= nodes)),
                             ("at or after its child (parents must come first; a cycle otherwise)",
                              (parents >= index[None, :]) & (parents < nodes))):
            bad = bad & real
            if bool(bad.any()):
                b, i = (int(v) for v in bad.nonzero()[0])
                raise ValueError(f"malformed tree: row {b}, node {i} has parent {int(parents[b, i])}, {problem}")
        if width is not None:
            start = self._start(width)
            if start.shape != (rows,) or bool(((start < 0) | (start + nodes > width)).any()):
                raise ValueError(f"tree start must be [{rows}] with start + {nodes} nodes <= {width} fed columns, "
                                 f"got {start.tolist()}")

    def _lengths(self) -> torch.Tensor:
        rows, nodes = self.parents.shape
        if self.lengths is None:
            return torch.full((rows,), nodes, dtype=torch.long, device=self.parents.device)
        return self.lengths.to(self.parents.device).long()

    def _start(self, width: int) -> torch.Tensor:
        rows, nodes = self.parents.shape
        if self.start is None:
            return torch.full((rows,), width - nodes, dtype=torch.long, device=self.parents.device)
        return self.start.to(self.parents.device).long()

    # -- what a forward needs (pure functions of the layout) --------------------------------------
    def depths(self) -> torch.Tensor:
        """``[B, K]`` long: each node's depth (1 for a child of the root; padding nodes 1)."""
        parents = self._real_parents()
        depth = torch.ones_like(parents)
        for i in range(parents.shape[1]):  # parents come first: their depth is final
            p = parents[:, i]
            has = p >= 0
            if bool(has.any()):
                depth[:, i] = torch.where(has, depth.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1, depth[:, i])
        return depth

    def deepest(self) -> torch.Tensor:
        """``[B]`` long: the depth of each row's deepest node (0 for a row without nodes)."""
        rows, nodes = self.parents.shape
        real = torch.arange(nodes, device=self.parents.device)[None, :] < self._lengths()[:, None]
        depth = torch.where(real, self.depths(), 0)
        return depth.amax(dim=1) if nodes else torch.zeros(rows, dtype=torch.long, device=self.parents.device)

    def ancestors(self) -> torch.Tensor:
        """``[B, K, K]`` bool: ``[b, i, j]`` when node j is node i or one of its ancestors."""
        parents = self._real_parents()
        rows, nodes = parents.shape
        eye = torch.eye(nodes, dtype=torch.bool, device=parents.device)
        seen = eye[None].repeat(rows, 1, 1)
        for i in range(nodes):
            p = parents[:, i]
            up = seen[torch.arange(rows, device=parents.device), p.clamp(min=0)]  # [B, K]: the parent's row
            seen[:, i] = eye[i][None, :] | (up & (p >= 0)[:, None])
        return seen

    def _real_parents(self) -> torch.Tensor:
        """``parents`` with every padding node made a child of the root."""
        index = torch.arange(self.parents.shape[1], device=self.parents.device)
        return torch.where(index[None, :] < self._lengths()[:, None], self.parents.long(), -1)

    def visible(self, width: int, batch: int, device=None) -> torch.Tensor:
        """``[B, T, T]`` bool: fed column q attends to fed column k (see the module docstring)."""
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        seen = causal[None].repeat(batch, 1, 1)
        if self.parents is None:
            return seen
        self.check(width, batch)
        start, nodes = self._start(width).to(device), self.parents.shape[1]
        cols = start[:, None] + torch.arange(nodes, device=device)[None, :]  # [B, K] node columns
        rows = torch.arange(batch, device=device)[:, None, None]
        # among the nodes, only ancestors (a node's later columns are causal-invisible already)
        seen[rows, cols[:, :, None], cols[:, None, :]] = self.ancestors().to(device)
        return seen

    def chain_columns(self, width: int, batch: int, device=None) -> torch.Tensor:
        """``[B, T]`` long: the column each fed column would occupy in its own chain (the root's
        column plus its depth for a node; itself otherwise). Positions and sliding windows follow it."""
        columns = torch.arange(width, device=device)[None, :].repeat(batch, 1)
        if self.parents is None:
            return columns
        self.check(width, batch)
        start, nodes = self._start(width).to(device), self.parents.shape[1]
        cols = start[:, None] + torch.arange(nodes, device=device)[None, :]  # [B, K]
        columns.scatter_(1, cols, start[:, None] - 1 + self.depths().to(device))
        return columns


CAUSAL = Layout()


def tree_visibility(layout: Layout, cached: int, attention_mask: torch.Tensor | None, batch: int, width: int,
                    device) -> torch.Tensor:
    """``[B, T, N]`` bool: fed column q of a tree forward sees key slot n when the slot holds a real
    token of the row (``attention_mask [B, N]``, None: every slot up to ``cached + T``) and either
    precedes the fed block (the ``cached`` slots of the committed prefix) or is a fed column that
    ``layout`` lets q see (its chain and its ancestors)."""
    keys = attention_mask.shape[1] if attention_mask is not None else cached + width  # N
    if keys < cached + width:
        raise ValueError(f"attention_mask spans {keys} slots; the cache holds {cached} and {width} are fed")
    real = (torch.ones(batch, keys, dtype=torch.bool, device=device) if attention_mask is None
            else attention_mask.to(device=device).bool())  # [B, N]
    visible = torch.zeros(batch, width, keys, dtype=torch.bool, device=device)  # [B, T, N]
    visible[:, :, :cached] = True
    visible[:, :, cached: cached + width] = layout.visible(width, batch, device)
    return visible & real[:, None, :]


@dataclass
class EngineOutput:
    """``logits [B, T', V]`` (T' = T, or the last ``logits_to_keep`` columns) and ``hidden``: the
    hidden states asked for, layer -> ``[B, T, H]``, layer numbered as ``output_hidden_states``
    numbers them (0: the embeddings' output, i: decoder layer i's, as the model reports it)."""

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """How one model's forward runs. One engine instance serves one model."""

    #: the name ``engine=`` takes
    name: str

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *, layout: Layout = CAUSAL,
                cache: Any = None, attention_mask: torch.Tensor | None = None,
                hidden_layers: Sequence[int] = (), logits_to_keep: int | None = None,
                model_inputs: Mapping[str, Any] | None = None) -> EngineOutput:
        """Feed ``input_ids [B, T]`` at ``positions [B, T]`` (``[3, B, T]`` for mRoPE) after the
        ``S = cache.get_seq_length()`` slots the ``cache`` (a transformers ``Cache``, updated in
        place) holds.

        ``attention_mask [B, N]`` (1: the slot holds a real token of the row) spans every key slot
        the forward attends over: N = S + T for a growing cache, the cache's length for a static
        one (the fed columns at slots S .. S+T-1); None when every slot is real. ``layout`` says
        which fed columns see which; ``hidden_layers`` which hidden states to return (empty: none);
        ``logits_to_keep`` keeps only the last columns' logits (None: all); ``model_inputs`` go to
        the model's forward as they are (a first iteration's pixel values and the like).
        Raises :class:`LayoutNotSupported` for a layout it cannot run on this model."""
        ...


def model_kwargs(input_ids: torch.Tensor, positions: torch.Tensor, cache_key: str, cache: Any = None,
                 attention_mask: torch.Tensor | None = None, logits_to_keep: int | None = None,
                 model_inputs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The protocol's arguments as the keywords a ``transformers`` model's forward takes (the
    cache under ``cache_key``, ``modelinfo.cache_argument``)."""
    kwargs: dict[str, Any] = dict(model_inputs or {})
    kwargs.update(input_ids=input_ids, position_ids=positions, use_cache=cache is not None)
    if cache is not None:
        kwargs[cache_key] = cache
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if logits_to_keep is not None:
        kwargs["logits_to_keep"] = logits_to_keep
    return kwargs


#: the keywords of a model's forward that are the protocol's own arguments (the cache's is the model's)
_PROTOCOL_KEYWORDS = ("input_ids", "position_ids", "use_cache", "attention_mask", "logits_to_keep")


def forward_kwargs(engine: Engine, kwargs: Mapping[str, Any], cache_key: str, *, layout: Layout = CAUSAL,
                   hidden_layers: Sequence[int] = ()) -> EngineOutput:
    """``engine.forward`` on the keywords of a model's forward (the inverse of :func:`model_kwargs`):
    what a cache backend holds as it prepares a forward. Keywords other than the protocol's go as
    ``model_inputs``."""
    cache_keys = (cache_key, "past_key_values")  # the old name too: a caller may still pass it
    cache = next((kwargs[k] for k in cache_keys if k in kwargs), None)
    return engine.forward(kwargs["input_ids"], kwargs["position_ids"], layout=layout, cache=cache,
                          attention_mask=kwargs.get("attention_mask"), hidden_layers=hidden_layers,
                          logits_to_keep=kwargs.get("logits_to_keep"),
                          model_inputs={k: v for k, v in kwargs.items() if k not in _PROTOCOL_KEYWORDS + cache_keys})
