"""YAML-configured benchmarks: ``specdec bench CONFIG.yaml`` and ``specdec bench report DIR``.

* :mod:`.config`: the pydantic schema (unknown fields refused, one-line errors);
* :mod:`.runner`: runs every method on the same prompts, interleaved per question, one JSON line
  per (method, question, turn), resumable;
* :mod:`.results`: the output directory (where it is, its files, row keys), shared by both below;
* :mod:`.report`: Markdown tables and PNG plots rebuilt from the JSON lines (plots need matplotlib);
* :mod:`.cli`: the command line.
"""

from .config import REFERENCE_METHODS, BenchConfig, ConfigError, load_config, parse_config
from .report import write_report
from .runner import ResultsMismatchError, run_benchmark

__all__ = ["REFERENCE_METHODS", "BenchConfig", "ConfigError", "ResultsMismatchError", "load_config", "parse_config",
           "run_benchmark", "write_report"]
