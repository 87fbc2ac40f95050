"""Cheaper forwards of the same model: fewer bytes or fewer FLOPs, the same tokens.

What belongs here is a way to run a model that the rest of specdec can use in place of the
model's own forward, because it predicts the same tokens (exactly, or as a draft that the
target's verifier checks):

* ``head``: the output layer as ``W @ h.T`` (the model's own logits up to rounding), used by
  the target's and the drafts' eager forwards where it pays (``CacheSettings.fast_head``);
* ``attention``: grouped-query attention without a copy of the cache per query head, for the
  copies and for specdec's own eager forwards of the user's model on a CPU;
* ``lowbit``: a copy of a model at lower precision (cast, torchao, or int8 products), built for
  drafting, and :class:`~specdec.forwards.lowbit.LowPrecisionDraft`, the option a generator
  mixes in to draft with such a copy;
* ``int8``: int8-weight, uint8-activation linear layers for a CPU copy;
* ``rotation``: an orthogonal change of basis of the residual stream folded into the weights,
  so a copy's activations quantize better while it computes the same function;
* ``lean``: the eager forward of a w8a8 copy's draft steps in fewer tensor operations (stacked
  products, direct cache writes), its decoder layers scripted, where the copy has Llama's layout;
* ``choose``: ``weights="auto"``, the copy measured best on this machine.

Invariants: the model a forward is built from is only read (copies are deep copies, the output
layer is recomputed, never replaced), and nothing here chooses tokens: a faster forward that
rounds differently can change which drafts are accepted, never the output.

Why each pays, with the measurements: docs/performance.md (the output layer) and
docs/self_draft.md (the copies). Nothing here imports a plugin; the modules are imported by
name (``from specdec.forwards.lowbit import build_copy``), this package re-exports nothing so
that importing one does not load the others.
"""
