"""EAGLE-3 draft heads: the head (``head.py``), its published layouts (``layouts.py``), drafting
(``generator.py``) and training (``train.py``). See docs/eagle3.md."""

from .generator import Eagle3Generator
from .head import Eagle3Head, HeadConfig

__all__ = ["Eagle3Generator", "Eagle3Head", "HeadConfig"]
