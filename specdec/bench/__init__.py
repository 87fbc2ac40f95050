"""YAML-configured benchmarks: ``specdec bench CONFIG.yaml`` and ``specdec bench report DIR``.

One job per module: :mod:`.config` the schema; :mod:`.questions` which questions and prompts;
:mod:`.methods` the methods run (SpecDecoder and transformers' own ``generate``); :mod:`.runner`
the run loop (:mod:`.runner_hash` what results depend on, :mod:`.runner_outdir` the output
directory and resume, :mod:`.runner_calls` one timed call); :mod:`.results` the files and row keys;
:mod:`.provenance` what each row was measured under and whether a row read back may be used;
:mod:`.summary` the statistics; :mod:`.report` (:mod:`.report_frame`, :mod:`.report_tables`,
:mod:`.report_methods`) and :mod:`.plots` the Markdown and figures; :mod:`.grammar_check` a
structured output checked against its grammar;
:mod:`.cli` the command line; :mod:`.demo` ``specdec demo``, a packaged config run by the runner.

The names below are imported on first use (PEP 562), not with the package: ``specdec bench
--help`` imports :mod:`.cli` alone, without the torch and transformers the others import.
"""

import importlib

_EXPORTS = {"REFERENCE_METHODS": "config", "BenchConfig": "config", "ConfigError": "config", "load_config": "config",
            "parse_config": "config", "write_report": "report", "ResultsMismatchError": "runner",
            "run_benchmark": "runner"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
