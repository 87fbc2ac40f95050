"""What the process learns of each drafting model across calls: its measured drafting cost."""

from __future__ import annotations

import threading
import weakref

import torch


class DraftingMemory:
    """What the process learnt of a drafting model (an assistant a policy priced) over its calls:
    its last measured drafting cost per token, as a share of the target's one-token forward at
    the batch and context it was measured at. A later call of the same assistant starts from it
    instead of the bytes prior (its own measurements then correct it), and does not try the
    assistant in a short block as if its drafts were of unknown worth. Kept per model object,
    forgotten with it."""

    _shares: "weakref.WeakKeyDictionary[torch.nn.Module, float]" = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    @classmethod
    def share(cls, assistant) -> float | None:
        with cls._lock:
            return cls._shares.get(assistant) if assistant is not None else None

    @classmethod
    def learn(cls, assistant, share: float) -> None:
        if assistant is not None:
            with cls._lock:
                cls._shares[assistant] = share

