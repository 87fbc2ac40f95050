"""Issue 47, items 10 (bench) and 11: results read back from disk are checked against the config, and
a resume never pairs calls timed in different sessions.

Each test reproduces a defect on tiny random models (tests/test_bench.py's tiny config, two methods)
and shows it fixed: a row from another config or another question text, an edited row, a row of a
method the config lacks, a duplicate YAML key, a SpecDecoder setting misplaced in a method's
``options``, and a turn whose rows were timed in two sessions.
"""

from __future__ import annotations

import json

import pytest
import yaml

from specdec.bench import cli
from specdec.bench.config import ConfigError, load_config, parse_config
from specdec.bench.report import load_run, write_report
from specdec.bench.results import RESULTS_FILE, RUN_FILE, ResultStore, row_key
from test_bench import QUESTIONS, TURNS, TWO_METHODS, run, tiny_config


def _lines(out) -> list[dict]:
    return ResultStore(out / RESULTS_FILE).load()


def _write_lines(out, rows: list[dict]) -> None:
    (out / RESULTS_FILE).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _restamp(row: dict) -> dict:
    """``row`` with a digest that matches its (changed) content: a forgery a digest alone cannot tell."""
    from specdec.bench.provenance import stamped

    return stamped({k: v for k, v in row.items() if k != "digest"})


def _identical(report: str, method: str) -> str:
    """The "identical" cell of ``method`` in the report's outputs table."""
    line = next(x for x in report.splitlines() if x.startswith(f"| `{method}` |") and " of " in x)
    return line.split("|")[2].strip()


# -- item 10: a row of another config under the same key -----------------------------------------------
def test_a_row_from_another_config_is_not_reused_and_the_report_leaves_it_out(tmp_path):
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    out, other = tmp_path / "out", tmp_path / "other"
    run(config, out)
    other.mkdir()
    run(tiny_config(other, methods=TWO_METHODS, generation={"max_new_tokens": 3}), other / "out")
    foreign = next(r for r in _lines(other / "out") if row_key(r) == ("pl3", 1, 1))
    # results joined by hand: this folder's own pl3 row of (question 1, turn 1) replaced by the other run's
    _write_lines(out, [r for r in _lines(out) if row_key(r) != ("pl3", 1, 1)] + [foreign])
    write_report(out, log=None)
    report = (out / "report.md").read_text()
    # main: "3 of 4", a false lossless failure; the foreign row is left out, and said
    assert _identical(report, "pl3") == f"{TURNS - 1} of {TURNS - 1}"
    assert "1 row written under another config or question text" in report
    again = []
    result = run(config, out, on_row=lambda r: again.append(row_key(r)))
    # main: kept the foreign row, ran nothing. The turn runs again whole, and the question's later turn
    # (whose prompt carries the first turn's answer) with it
    assert again == [("baseline", 1, 1), ("pl3", 1, 1), ("baseline", 1, 2), ("pl3", 1, 2)]
    assert any("another config" in note for note in result.notes)
    _, rows = load_run(out)
    assert len(rows) == TURNS * 2 and _identical((out / "report.md").read_text(), "pl3") == f"{TURNS} of {TURNS}"
    baseline = {(r["question_id"], r["turn"]): r["output_ids"] for r in rows if r["method"] == "baseline"}
    assert all(r["output_ids"] == baseline[(r["question_id"], r["turn"])] for r in rows)


def test_a_question_whose_text_changed_is_run_again(tmp_path):
    """The same question ids (the config hash is unchanged) with another text: the row's fingerprint
    covers the question as asked."""
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    out = tmp_path / "out"
    run(config, out)
    data = yaml.safe_load(config.read_text())
    edited = [dict(q) for q in QUESTIONS]
    edited[1]["turns"] = ["Translate: Die Katze schläft."]
    (tmp_path / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in edited))
    assert data["dataset"]["path"] == str(tmp_path / "questions.jsonl")
    again = []
    run(config, out, on_row=lambda r: again.append(row_key(r)))
    assert sorted(again) == [("baseline", 101, 1), ("pl3", 101, 1)]  # main: nothing run again


def test_an_edited_row_is_flagged_and_run_again(tmp_path):
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    out = tmp_path / "out"
    run(config, out)
    rows = _lines(out)
    for r in rows:
        if row_key(r) == ("pl3", 501, 1):
            r["seconds"] = r["seconds"] / 100  # a hundredfold "speedup"
    _write_lines(out, rows)
    write_report(out, log=None)
    assert "1 row changed after being written (digest differs)" in (out / "report.md").read_text()
    again = []
    result = run(config, out, on_row=lambda r: again.append(row_key(r)))
    assert again == [("baseline", 501, 1), ("pl3", 501, 1)]  # main: the edited row was kept
    assert result.units.rerun == 1 and result.rows_done_before == TURNS * 2 - 2


def test_rows_of_a_method_the_config_lacks_are_ignored_with_a_note(tmp_path):
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    out = tmp_path / "out"
    run(config, out)
    stray = dict(_lines(out)[1], method="pl_old")
    with (out / RESULTS_FILE).open("a") as f:
        f.write(json.dumps(stray) + "\n")
    write_report(out, log=None)
    report = (out / "report.md").read_text()
    assert f"Rows: {TURNS * 2} of {TURNS * 2}" in report  # main: "Rows: 9 of 8"
    assert "1 row of a method this config does not have (pl_old)" in report
    result = run(config, out)
    assert result.rows_new == 0 and result.rows_done_before == TURNS * 2
    assert result.notes == ["1 row of a method this config does not have (pl_old)"]


def test_an_unstamped_row_is_taken_only_from_a_folder_written_before_fingerprints(tmp_path):
    """Results of an older specdec (no fingerprints, sessions or digests) still resume; a row without a
    fingerprint added after a checking run opened the folder is not reused."""
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    out = tmp_path / "out"
    produced = []

    def stop_after_two(row):
        produced.append(row)
        if len(produced) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(config, out, on_row=stop_after_two)
    old = [{k: v for k, v in r.items() if k not in ("fingerprint", "session", "digest")} for r in _lines(out)]
    _write_lines(out, old)
    meta = json.loads((out / RUN_FILE).read_text())
    for key in ("fingerprints", "legacy_rows"):
        meta.pop(key)
    (out / RUN_FILE).write_text(json.dumps(meta))
    result = run(config, out)
    assert result.rows_done_before == 2 and result.notes == []
    assert json.loads((out / RUN_FILE).read_text())["legacy_rows"] == 2
    unstamped = {k: v for k, v in _lines(out)[-1].items() if k not in ("fingerprint", "session", "digest")}
    _write_lines(out, [r for r in _lines(out) if row_key(r) != row_key(unstamped)] + [unstamped])
    again = []
    result = run(config, out, on_row=lambda r: again.append(row_key(r)))
    assert len(again) == 2 and row_key(unstamped) in again
    assert any("without a fingerprint" in note for note in result.notes)


# -- item 10: the config file --------------------------------------------------------------------------
def test_a_duplicate_yaml_key_is_an_error_naming_the_line(tmp_path, capsys):
    text = tiny_config(tmp_path, methods=TWO_METHODS).read_text()
    path = tmp_path / "dup.yaml"
    path.write_text(text + "threads: 4\n")  # tiny_config already set threads: 1
    line = len(text.splitlines()) + 1
    with pytest.raises(ConfigError, match=rf"dup.yaml:{line}: duplicate key 'threads' \(first given at line \d+\)"):
        load_config(path)  # main: threads 4, silently
    assert cli.main([str(path), "--out", str(tmp_path / "out")]) == 2
    assert f"dup.yaml:{line}: duplicate key 'threads'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    nested = tmp_path / "nested.yaml"
    nested.write_text("target: tiny-random:llama\nmethods:\n  - {generator: baseline}\n"
                      "  - {generator: prompt_lookup, options: {num_tokens: 3, num_tokens: 5}}\n")
    with pytest.raises(ConfigError, match="nested.yaml:4: duplicate key 'num_tokens'"):
        load_config(nested)
    merged = tmp_path / "merged.yaml"  # a YAML merge key is overridden by the mapping's own key, as YAML says
    merged.write_text("target: tiny-random:llama\nx: &pl {generator: prompt_lookup, name: a}\n"
                      "methods:\n  - {generator: baseline}\n  - {<<: *pl, name: b}\n")
    with pytest.raises(ConfigError, match="x: unknown field 'x'"):
        load_config(merged)


@pytest.mark.parametrize("method, expected", [
    ({"generator": "prompt_lookup", "options": {"fast_head": False}},
     "methods[1].options.fast_head: 'fast_head' is a key of the method (beside options), not an option of "
     "'prompt_lookup'"),
    ({"generator": "prompt_lookup", "options": {"fast_haed": False}},
     "methods[1].options.fast_haed: 'prompt_lookup' has no option 'fast_haed'. Did you mean 'fast_head', the "
     "method's own key"),
    ({"generator": "prompt_lookup", "options": {"cache_implementaton": "static"}},
     "methods[1].options.cache_implementaton: 'prompt_lookup' has no option 'cache_implementaton'. Did you mean "
     "'cache_implementation'"),
    ({"generator": "prompt_lookup", "fast_haed": False},
     "methods[1].fast_haed: unknown field 'fast_haed'; allowed: name, generator, draft, options, "
     "cache_implementation, compile, fast_head, engine. Did you mean 'fast_head'?"),
    ({"generator": "prompt_lookup", "decoder_options": {"fast_head": False}},
     "methods[1].decoder_options: unknown field 'decoder_options' (a bench method gives SpecDecoder's settings as "
     "its own keys (cache_implementation, compile, fast_head, engine)"),
    ({"generator": "prompt_lookup", "options": {"num_tokns": 3}}, "Did you mean 'num_tokens'?"),
])
def test_a_misplaced_or_misspelt_decoder_setting_names_the_method_key(method, expected):
    with pytest.raises(ConfigError) as err:
        parse_config({"target": "tiny-random:llama", "methods": [{"generator": "baseline"}, method]})
    assert expected in str(err.value) and len(str(err.value).splitlines()) == 1
    if "num_tokns" in str(method):  # a generator's own option misspelt: still named as the generator's
        assert "methods[1].options: unknown option(s) ['num_tokns'] for 'prompt_lookup'" in str(err.value)


def test_the_runtime_refusal_names_the_part_that_refused(monkeypatch):
    """A value only the generator (or only SpecDecoder) refuses is reported as that part's."""
    from specdec.bench import methods as bench_methods
    from specdec.models import load_model

    target, tokenizer = load_model("tiny-random:llama")
    config = parse_config({"target": "tiny-random:llama", "methods": [
        {"generator": "baseline"}, {"name": "pl", "generator": "prompt_lookup", "options": {"num_tokens": 0}}]})
    with pytest.raises(ConfigError, match=r"methods: 'pl': options: bad options for 'prompt_lookup'"):
        bench_methods.build_methods(config, target, tokenizer, {})
    good = parse_config({"target": "tiny-random:llama", "methods": [
        {"generator": "baseline"}, {"name": "pl", "generator": "prompt_lookup"}]})

    def refuse(*args, **kwargs):
        raise ValueError("no such cache")

    monkeypatch.setattr(bench_methods, "SpecDecoder", refuse)
    with pytest.raises(ConfigError, match=r"methods: 'pl': SpecDecoder refused its settings \(cache_implementation "
                                          r"'dynamic'.*\): no such cache"):
        bench_methods.build_methods(good, target, tokenizer, {})


# -- item 11: a speedup compares calls timed side by side -------------------------------------------------
def test_a_turn_begun_in_one_session_is_run_again_whole_on_resume(tmp_path):
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    out = tmp_path / "out"
    produced = []

    def interrupt_after_three(row):  # baseline (1, 1), pl3 (1, 1), baseline (1, 2): then the interruption
        produced.append(row_key(row))
        if len(produced) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(config, out, on_row=interrupt_after_three)
    again = []
    result = run(config, out, on_row=lambda r: again.append(row_key(r)))
    assert again[:2] == [("baseline", 1, 2), ("pl3", 1, 2)]  # main: pl3 (1, 2) alone, against an earlier baseline
    _, rows = load_run(out)
    sessions = {(r["question_id"], r["turn"]): set() for r in rows}
    for r in rows:
        sessions[(r["question_id"], r["turn"])].add(r["session"])
    assert all(len(s) == 1 for s in sessions.values()) and len(set().union(*sessions.values())) == 2
    assert (result.units.kept, result.units.rerun) == (1, 1)
    meta = json.loads((out / RUN_FILE).read_text())
    assert meta["sessions"][1]["kept_units"] == 1 and meta["sessions"][1]["rerun_units"] == 1
    assert "session 2 kept 1 turn(s) or batch(es) and ran 1 again whole" in (out / "report.md").read_text()


def test_rows_joined_from_two_sessions_are_left_out_of_speedups_and_run_again(tmp_path):
    config = tiny_config(tmp_path, methods=TWO_METHODS, batch_sizes=[1, 3])
    out = tmp_path / "out"
    run(config, out)
    rows = _lines(out)
    # a turn and a batch whose pl3 rows claim another session (a hand-joined file), digests made to match
    joined = {("pl3", 501, 1), ("pl3", "batch", 3, 0)}
    rows = [_restamp({**r, "session": "elsewhere"}) if row_key(r) in joined else r for r in rows]
    _write_lines(out, rows)
    write_report(out, log=None)
    report = (out / "report.md").read_text()
    assert "2 row(s) left out of the speedups: timed in another session" in report
    from specdec.bench.summary import batch_summaries, summaries

    meta, usable = load_run(out)
    by = {(s.method, s.subtask): s for s in summaries(meta, usable)}
    assert by[("pl3", "rag")].speedup is None and by[("pl3", "rag")].exact_match == 1.0
    assert next(b for b in batch_summaries(meta, usable) if (b.method, b.batch_size) == ("pl3", 3)).speedup is None
    again = []
    result = run(config, out, on_row=lambda r: again.append(row_key(r)))
    assert sorted(again, key=str) == sorted([("baseline", 501, 1), ("pl3", 501, 1), ("baseline", "batch", 3, 0),
                                             ("pl3", "batch", 3, 0)], key=str)
    assert result.units.rerun == 2
    write_report(out, log=None)
    assert "left out of the speedups" not in (out / "report.md").read_text()


def test_a_later_turn_follows_its_earlier_turn_when_that_one_runs_again(tmp_path):
    """A second turn's prompt carries the first turn's answer: when the first runs again, so does the second."""
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    out = tmp_path / "out"
    run(config, out)
    _write_lines(out, [r for r in _lines(out) if row_key(r) != ("pl3", 1, 1)])
    again = []
    run(config, out, on_row=lambda r: again.append(row_key(r)))
    assert again == [("baseline", 1, 1), ("pl3", 1, 1), ("baseline", 1, 2), ("pl3", 1, 2)]
