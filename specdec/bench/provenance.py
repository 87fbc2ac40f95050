"""What a result row was measured under, and whether a row read back from disk may be used.

Every row the runner writes carries three fields besides its measurements:

* ``fingerprint``: a digest of the method's definition, the settings every call shares (target,
  device, dtype, generation, threads, repeats, ...) and the question as asked (its id, category,
  grammar and turns so far; for a batch, every question of the batch). :class:`Fingerprints`
  computes the one a row of each planned key must carry; ``run.json`` records them.
* ``session``: the id of the run (one ``specdec bench`` process) that timed it.
* ``digest``: a digest of the row's own content as written (:func:`row_digest`), so an edited row
  is told from a written one.

Invariants: a row read back is used (by a resume, by the report) only when its method is one of
the config's, its key is one the config plans, its digest matches and its fingerprint is the
config's (:func:`check_rows`; rows written before rows carried fingerprints are taken unchecked,
only while the folder has never been opened by a checking run, see ``legacy_rows``); and a
*unit* of rows timed side by side (one question's turn, or one batch, every method that runs it)
is kept only when all its rows are there and were timed in one session (:func:`whole_units`),
so a speedup never divides times from two sessions. Pure functions of rows and these digests;
nothing here reads a file. How a resume uses them: docs/benchmarks.md, "Resume".
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import Counter
from dataclasses import dataclass, field

from .results import batch_groups, row_key

FINGERPRINT = "fingerprint"
SESSION = "session"
DIGEST = "digest"

#: why a row read back is not used (the counts a run logs and the report lists)
OTHER_METHOD = "of a method this config does not have"
NOT_PLANNED = "of a question, turn or batch this config does not ask"
OTHER_CONFIG = "written under another config or question text (fingerprint differs)"
EDITED = "changed after being written (digest differs)"
UNSTAMPED = "without a fingerprint, added after this folder's rows were fingerprinted"
MALFORMED = "malformed (no method, question, turn or batch)"


def new_session_id() -> str:
    """A fresh id for one run's rows (random: two runs never share one)."""
    return uuid.uuid4().hex[:12]


def digest_of(data) -> str:
    """A short, stable digest of JSON-able ``data`` (keys sorted)."""
    payload = json.dumps(data, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def row_digest(row: dict) -> str:
    """The digest of a row's content, its ``digest`` field aside; ``row`` as JSON gives it back (string
    keys, lists: :func:`stamped`)."""
    return digest_of({k: v for k, v in row.items() if k != DIGEST})


def stamped(row: dict) -> dict:
    """``row`` as it reads back from JSON (int keys become strings, tuples lists), with its ``digest``:
    what the runner appends, so that reading it back gives the same digest."""
    line = json.loads(json.dumps(row, ensure_ascii=False))
    line[DIGEST] = row_digest(line)
    return line


@dataclass(frozen=True)
class Fingerprints:
    """The fingerprint each planned row must carry. ``methods``: name -> digest of its definition and the
    shared settings; ``questions``: question id -> digest of each turn as asked (turn t: the first t
    turns); ``order``: the question ids in run order (batches group them so)."""

    methods: dict[str, str]
    questions: dict[int, tuple[str, ...]]
    order: tuple[int, ...]

    @classmethod
    def build(cls, methods: dict[str, object], questions: list[tuple[int, list[object]]]) -> "Fingerprints":
        """From each method's definition (JSON-able) and each question's turns as asked (one JSON-able
        object per turn), questions in run order."""
        return cls({name: digest_of(m) for name, m in methods.items()},
                   {qid: tuple(digest_of(t) for t in turns) for qid, turns in questions},
                   tuple(qid for qid, _ in questions))

    def of(self, key: tuple) -> str | None:
        """The fingerprint of the row with :func:`~specdec.bench.results.row_key` ``key``, or None when the
        config plans no such row (an unknown method, question, turn or batch)."""
        method = self.methods.get(key[0])
        if method is None:
            return None
        if key[1] == "batch":  # (method, "batch", size, index): every question of the batch, first turns
            groups = batch_groups(list(self.order), int(key[2]))
            index = int(key[3])
            if not 0 <= index < len(groups):
                return None
            return digest_of([method, [self.questions[qid][0] for qid in groups[index]]])
        turns = self.questions.get(int(key[1]), ())
        turn = int(key[2])
        return digest_of([method, turns[turn - 1]]) if 1 <= turn <= len(turns) else None

    def to_json(self) -> dict:
        return {"methods": self.methods, "questions": {str(q): list(t) for q, t in self.questions.items()},
                "order": list(self.order)}

    @classmethod
    def from_json(cls, data: dict | None) -> "Fingerprints | None":
        """From ``run.json``'s ``fingerprints``; None for a folder written before rows carried them."""
        if not data:
            return None
        return cls(dict(data["methods"]), {int(q): tuple(t) for q, t in data["questions"].items()},
                   tuple(int(q) for q in data["order"]))


# -- rows read back ------------------------------------------------------------------------------
@dataclass
class RowCheck:
    """Rows read back, sorted: ``rows`` the usable ones (row key -> the last usable row of that key),
    ``left_out`` reason -> rows not used, ``other_methods`` the method names of rows of no config method."""

    rows: dict[tuple, dict] = field(default_factory=dict)
    left_out: Counter = field(default_factory=Counter)
    other_methods: set[str] = field(default_factory=set)

    def notes(self) -> list[str]:
        """One sentence per reason a row was not used (nothing when every row was)."""
        out = []
        for reason, count in self.left_out.items():
            named = f" ({', '.join(sorted(self.other_methods))})" if reason == OTHER_METHOD else ""
            out.append(f"{count} row{'s' if count != 1 else ''} {reason}{named}")
        return out


def row_problem(row: dict, index: int, methods: set[str], planned: set, fingerprints: Fingerprints | None,
                legacy_rows: int) -> str | None:
    """Why the ``index``-th row read back may not be used (one of this module's reasons), or None.
    ``fingerprints`` None: the folder predates fingerprints, rows are checked against the plan only;
    a row without a fingerprint is taken among the first ``legacy_rows`` rows only (those a checking run
    found there, written before)."""
    try:
        key = row_key(row)
    except (KeyError, TypeError, ValueError):
        return MALFORMED
    if key[0] not in methods:
        return OTHER_METHOD
    if key not in planned:
        return NOT_PLANNED
    if fingerprints is None:
        return None
    if FINGERPRINT not in row:
        return None if index < legacy_rows else UNSTAMPED
    if row.get(DIGEST) != row_digest(row):
        return EDITED
    if row[FINGERPRINT] != fingerprints.of(key):
        return OTHER_CONFIG
    return None


def check_rows(rows: list[dict], methods: set[str], planned: set, fingerprints: Fingerprints | None,
               legacy_rows: int = 0) -> RowCheck:
    """Rows read back (file order) -> :class:`RowCheck`; of two usable rows of one key the later one is used
    (a unit run again after an interruption appends its new rows)."""
    check = RowCheck()
    for index, row in enumerate(rows):
        problem = row_problem(row, index, methods, planned, fingerprints, legacy_rows)
        if problem is None:
            check.rows[row_key(row)] = row
            continue
        check.left_out[problem] += 1
        if problem == OTHER_METHOD:
            check.other_methods.add(str(row.get("method")))
    return check


# -- units timed side by side --------------------------------------------------------------------
def unit_of(key: tuple) -> tuple:
    """The calls timed side by side that a row belongs to: ``("turn", question_id, turn)`` or
    ``("batch", size, index)``; every method's row of one unit is timed in one session."""
    return ("batch", key[2], key[3]) if key[1] == "batch" else ("turn", key[1], key[2])


def same_session(a: dict, b: dict) -> bool:
    """Whether two rows were timed in one session (rows written before sessions were recorded: both
    unknown, taken as one)."""
    return a.get(SESSION) == b.get(SESSION)


@dataclass(frozen=True)
class Units:
    """What a resume does with the units already begun: ``kept`` whole in one session; ``rerun``
    begun but incomplete or timed across sessions (run again whole, every method)."""

    kept: int = 0
    rerun: int = 0


def whole_units(done: dict[tuple, dict], planned: set) -> tuple[dict[tuple, dict], Units]:
    """The rows of ``done`` a resume keeps: those of units (:func:`unit_of`) whose every planned row is
    there, all timed in one session. A question's later turns follow its earlier answers, so after a
    turn that is not kept, that question's later turns are not kept either."""
    members: dict[tuple, list[tuple]] = {}
    for key in planned:
        members.setdefault(unit_of(key), []).append(key)
    kept: dict[tuple, dict] = {}
    units, rerun, broken = 0, 0, set()
    for unit in sorted(members, key=lambda u: (u[0] == "batch", u[1], u[2])):  # a question's turns in order
        keys = members[unit]
        present = [k for k in keys if k in done]
        question = unit[1] if unit[0] == "turn" else None
        whole = (len(present) == len(keys) and len({done[k].get(SESSION) for k in present}) == 1
                 and question not in broken)
        if whole:
            kept.update((k, done[k]) for k in keys)
            units += 1
            continue
        if question is not None:
            broken.add(question)
        rerun += bool(present)
    return kept, Units(units, rerun)

