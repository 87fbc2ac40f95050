"""What one call asks for: the validated prompt and the settings it decodes with.

:class:`~specdec.decoder.SpecDecoder` makes both (from ``generate()``'s arguments, or from what
``model.generate(custom_generate=...)`` prepared) and hands them to a
:class:`~specdec.run.DecodeRun`, which owns everything else of the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .distributed import SOLO
from .kv import CacheSettings
from .multimodal import PrefillSpec, Prefix
from .processors import BlockProcessors
from .sampling import SamplingParams
from .stopping import Stopper


@dataclass
class Prompt:
    """A validated prompt on the target's device."""

    input_ids: torch.Tensor  # [B, P] as given (left padding included)
    rows: torch.Tensor  # [B, P] row b's tokens from column 0
    lengths: torch.Tensor  # [B] tokens per row
    spec: PrefillSpec  # the rows the prefill-only inputs describe (this prompt's, or the prefix's)
    prefix: Prefix | None = None

    def mask(self) -> torch.Tensor:
        """[B, P] the attention mask as given: 0 on each row's left padding."""
        width = self.input_ids.shape[1]
        cols = torch.arange(width, device=self.input_ids.device)[None, :]
        return (cols >= (width - self.lengths)[:, None]).long()


@dataclass
class CallSettings:
    max_new_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None
    pad: int
    stopper: Stopper
    streamer: Any = None
    cache: CacheSettings = CacheSettings()
    #: who takes the call's decisions: here (SOLO), or the decider among a sharded target's ranks
    ranks: Any = SOLO
    #: the call's logits processors (``generate()``'s list, warpers included when sampling); None: none
    processors: BlockProcessors | None = None
    output_scores: bool = False  # keep each committed token's processed scores
    output_logits: bool = False  # keep each committed token's raw logits
    stream_prompt: bool = True  # False where generate() already gave the streamer the prompt
