"""The CPU engine's parts: cheaper forwards of the same model, fewer bytes or fewer FLOPs, the same tokens.

What belongs here is a way to run a model that specdec can use in place of the model's own
forward, because it predicts the same tokens (exactly, or as a draft that the target's verifier
checks):

* ``stack``: the Llama layout's decoder layers as one module, its linears float, packed, int8 or
  int4; ``direct``: the target's forward through it, decided per model;
* ``packed``: float32 linear layers through MKL-packed weights, where a timing finds them faster;
* ``head``: the output layer as ``W @ h.T`` (the model's own logits up to rounding), used by
  the target's and the drafts' eager forwards where it pays (``CacheSettings.fast_head``), and
  ``model_logits``, a cache backend's forward through all of these;
* ``attention``: grouped-query attention without a copy of the cache per query head, for the
  copies and for specdec's own eager forwards of the user's model on a CPU;
* ``lowbit``: ``build_copy``, a copy of a model at lower precision (cast, torchao, or int8/int4
  products) for drafting (``specdec.copies`` drafts with it and measures which one ``"auto"`` takes);
* ``int8``, ``int4``: a CPU copy's low-bit linear layers;
* ``rotation``: an orthogonal change of basis of the residual stream folded into the weights,
  so a copy's activations quantize better while it computes the same function;
* ``lean``: the eager forward of a low-bit copy's draft steps through the stack, where the copy
  has Llama's layout.

Invariants: the model a forward is built from is only read (copies are deep copies, the output
layer is recomputed, never replaced), and nothing here chooses tokens: a faster forward that
rounds differently can change which drafts are accepted, never the output. What is decided for
a model is kept in its plan (``specdec.model_plan``).

Why each pays, with the measurements: docs/performance.md and docs/self_draft.md. The core and
the plugins reach these modules through ``specdec.engines`` only; this package re-exports nothing,
so that importing one does not load the others.
"""
