"""An EAGLE-3 head's tensors as a checkpoint stores them: names in either layout, and the vocabulary maps.

Vocabulary: draft id ``d`` is target id ``d + d2t[d]`` (SGLang ``hot_token_id = d2t + arange``,
vLLM ``compute_logits``: ``targets = arange + draft_id_to_target_id``); ``t2d`` is redundant with
``d2t`` (both servers skip it), so one of them is derived from the other when only one is stored,
and both are the identity when neither is and the two vocabularies are the same size
(speculators stores neither then).

``embed_tokens.weight`` is skipped when present: the head embeds tokens with the target's own input
embeddings (``head.py``). SpecForge's training checkpoints have left it out since 2025-08 (commit
"do not save embedding layer", scripts/train_eagle3_{online,offline}.py, now scripts/train_eagle3.py)
but its HF export adds it back (specforge/export/to_hf.py); speculators' drafts save it.
"""

from __future__ import annotations

import torch

from .head import HeadConfig

#: names a checkpoint may carry that the head has no use for: the drafter's copy of the target's
#: embeddings, and speculators' training-only copies of the verifier's norm and head
_SKIPPED = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


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


def vocab_maps(state: dict, config: HeadConfig) -> None:
    """Fill in ``d2t``/``t2d`` where one or both are absent, and check that they agree, in place."""
    vocab, draft = config.vocab_size, config.draft_vocab_size
    d2t, t2d = state.get("d2t"), state.get("t2d")
    for name, tensor, size in (("d2t", d2t, draft), ("t2d", t2d, vocab)):
        if tensor is not None and tuple(tensor.shape) != (size,):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected ({size},)")
        if tensor is not None and (tensor.is_floating_point() or tensor.is_complex()):
            raise ValueError(f"{name} is {tensor.dtype}; a vocabulary map holds whole numbers")
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

