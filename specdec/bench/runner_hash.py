"""What a benchmark's results depend on: the config hash a rerun must match to resume, and the
fingerprint each row carries (what its method and question were when it was measured).

Fields added to the config after results were first written hash only when set to something other
than their default, so those results still resume.
"""

from __future__ import annotations

import hashlib
import json

from .config import BenchConfig, DatasetConfig, GenerationSettings, MethodConfig
from .provenance import Fingerprints
from .questions import Question


def config_hash(config: BenchConfig, questions: list[Question]) -> str:
    """Identifies what the results depend on: the config (its free-text description and what the report
    sets apart aside) and the questions.

    ``batch_sizes: [1]`` is hashed as the single-size field it replaced (``batch_size: 1``), so results
    written before batch sizes existed still resume."""
    dumped = _without_later_defaults(config.model_dump(mode="json", exclude={"description", "batch_sizes",
                                                                             "first_calls"}))
    if config.batch_sizes == [1]:
        dumped["batch_size"] = 1
    else:
        dumped["batch_sizes"] = config.batch_sizes
    content = {"config": dumped, "questions": [q.question_id for q in questions]}
    if any(q.grammar for q in questions):  # questions that carry their own grammar
        content["grammars"] = [q.grammar for q in questions]
    payload = json.dumps(content, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


#: fields added after results were first written: hashed only when set to something other than their
#: default, so those results still resume
_LATER_FIELDS = {"config": ("device", "dtype", "reference", "repeats", "distributed"),
                 "dataset": ("first_per_category", "max_turns"),
                 "method": ("cache_implementation", "compile", "fast_head", "engine"),
                 "generation": ("min_p", "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
                                "min_new_tokens", "bad_words_ids", "suppress_tokens", "grammar")}


def _without_later_defaults(dumped: dict) -> dict:
    """``dumped`` (a config's ``model_dump``) without the :data:`_LATER_FIELDS` at their defaults."""
    def strip(data: dict, model, names) -> dict:
        return {k: v for k, v in data.items() if not (k in names and v == model.model_fields[k].default)}

    out = strip(dumped, BenchConfig, _LATER_FIELDS["config"])
    out["dataset"] = strip(dumped["dataset"], DatasetConfig, _LATER_FIELDS["dataset"])
    out["methods"] = [strip(m, MethodConfig, _LATER_FIELDS["method"]) for m in dumped["methods"]]
    out["generation"] = strip(dumped["generation"], GenerationSettings, _LATER_FIELDS["generation"])
    return out


#: config fields a row does not depend on: the methods (each row has its own), which questions are asked and
#: in what batches (the question part of a fingerprint covers what one row asks), the reference (whose row
#: is a row of its own), the free text, what the report sets apart
_NOT_PER_ROW = ("methods", "dataset", "batch_sizes", "batch_size", "reference", "description", "first_calls")


def row_fingerprints(config: BenchConfig, questions: list[Question]) -> Fingerprints:
    """What each row of this config must carry (:class:`~specdec.bench.provenance.Fingerprints`): per
    method, its definition and every setting its calls share; per question and turn, the question as
    asked so far (category, grammar, turn texts). Fields added later hash only when set, as in
    :func:`config_hash`."""
    dumped = _without_later_defaults(config.model_dump(mode="json"))
    shared = {k: v for k, v in dumped.items() if k not in _NOT_PER_ROW}
    methods = {m["name"]: {"method": m, "settings": shared} for m in dumped["methods"]}
    asked = [(q.question_id, [{"question_id": q.question_id, "category": q.category, "grammar": q.grammar,
                               "turns": list(q.turns[:turn])} for turn in range(1, len(q.turns) + 1)])
             for q in questions]
    return Fingerprints.build(methods, asked)
