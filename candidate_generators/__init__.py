"""Built-in candidate generators.

Each is registered through the ``specdec.candidate_generators`` entry-point group in
``pyproject.toml`` (and by its decorator when imported), with no privilege that a third-party
plugin lacks: they use only ``specdec.generators`` and ``specdec.registry``.
"""
