"""YAML-configured benchmarks: ``specdec bench CONFIG.yaml`` and ``specdec bench report DIR``.

One job per module: :mod:`.config` the schema; :mod:`.questions` which questions and prompts;
:mod:`.methods` the methods run (SpecDecoder and transformers' own ``generate``); :mod:`.runner`
the run loop, its output directory and resume; :mod:`.results` the files and row keys;
:mod:`.summary` the statistics; :mod:`.report` and :mod:`.plots` the Markdown and figures;
:mod:`.cli` the command line; :mod:`.demo` ``specdec demo``, a packaged config run by the runner.
"""

from .config import REFERENCE_METHODS, BenchConfig, ConfigError, load_config, parse_config
from .report import write_report
from .runner import ResultsMismatchError, run_benchmark

__all__ = ["REFERENCE_METHODS", "BenchConfig", "ConfigError", "ResultsMismatchError", "load_config", "parse_config",
           "run_benchmark", "write_report"]
