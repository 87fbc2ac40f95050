"""The CPU engine's name for what specdec does today on a CPU, and what it decided for a model.

Its forwards still live in ``specdec/forwards/`` (issue 46 moves them behind the protocol): the
decoder layers as one scripted function (``forwards/direct.py``), the linear layers through
weights packed for MKL (``forwards/packed.py``) and the output layer as ``W @ h.T``
(``forwards/head.py``), each decided per model by a probe and a timing. ``engine="auto"`` and
``engine="cpu"`` let them run where those decisions choose them; ``engine="eager"`` turns all of
them off for one decoder's forwards (``CacheSettings.engine``, read by ``forwards.head.model_logits``).

:func:`decisions` only reads what was decided: it never probes, times or packs, so reporting a
choice changes nothing another decoder of the same model does.
"""

from __future__ import annotations

from ..forwards.direct import DirectForward
from ..forwards.head import FastHead
from ..forwards.packed import PackedLinears

_UNDECIDED = object()


def _said(decided, used: str = "used") -> str:
    return "not decided yet" if decided is _UNDECIDED else (used if decided is not None else "not used")


def decisions(model) -> str:
    """What the CPU engine's forwards decided for ``model`` so far, in words: the scripted Llama
    stack, the packed weights and the fast output layer, each "used", "not used" or "not decided
    yet" (each is decided at its first use; the packed weights' reason is ``stats.choices
    ["packed_weights"]``)."""
    with DirectForward._lock:
        direct = DirectForward._decided.get(model, _UNDECIDED)
    with FastHead._lock:
        head = FastHead._decided.get(model, _UNDECIDED)
    with PackedLinears._lock:
        state = PackedLinears._state.get(model)
    packed = _UNDECIDED if state is None or state.decided is None else (state if state.decided else None)
    rows = "used for forwards of %d-%d rows" % state.rows if packed not in (None, _UNDECIDED) else ""
    return (f"scripted Llama stack {_said(direct)}; packed weights {_said(packed, rows)}; "
            f"fast output layer {_said(head)}")
