"""``eagle3``: a trained head drafts from the hidden states of the target's own verifying forward.

EAGLE-3 (docs/eagle3.md). The head (``head.py``), its published layouts (``layouts.py``: ``config.json``
in ``layout_config.py``, the tensors' names in ``layout_weights.py``), drafting (``generator.py``), the
training data (``data.py``) and training (``train.py``, ``specdec train-head``)."""

from .generator import Eagle3Generator
from .head import Eagle3Head, HeadConfig

__all__ = ["Eagle3Generator", "Eagle3Head", "HeadConfig"]
