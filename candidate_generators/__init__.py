"""Built-in candidate generators: plugins only (every module here defines one registered generator).

Each is registered through the ``specdec.candidate_generators`` entry-point group in
``pyproject.toml`` (and by its decorator when imported), with no privilege that a third-party
plugin lacks: they import public modules of the core, as a third party may, and nothing of the
core imports them (``tests/test_layout.py`` checks both rules of the layout). What they use:

* all of them: ``specdec.generators`` (the plugin interface) and ``specdec.registry``;
* the model drafters (``draft_model``, ``cross_tokenizer``; ``self_draft`` through
  ``draft_model``): ``specdec.sampling`` to draw draft tokens and ``specdec.copies``
  for low-precision draft copies;
* ``cross_tokenizer``: ``specdec.alignment`` (text alignment between two tokenizers),
  ``specdec.modelinfo`` and ``specdec.multimodal``; ``self_draft``: ``specdec.modelinfo``.
"""
