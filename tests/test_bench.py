"""`specdec bench`: config validation, resumable JSONL results, reports, on tiny-random models.

One full run (every kind of method on a hand-made dataset in tmp_path) is shared by the tests
that only read its output; the tests that interrupt, resume or change a config make their own
small runs with two methods.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from specdec.bench import cli
from specdec.bench.config import ConfigError, load_config, method_kind, parse_config
from specdec.bench.methods import hf_cache_kwargs, warmup_batch_sizes
from specdec.bench.questions import (build_messages, load_selected_questions, longest_call, question_seed,
                                     select_questions, spread)
from specdec.bench.recorded import load_recorded_run
from specdec.bench.report import PLOTS_NEED_MATPLOTLIB, gain_ends, k_distribution, load_run, write_report
from specdec.bench.results import (RESULTS_FILE, RUN_FILE, Agreement, ResultStore, default_out_dir, first_difference,
                                   is_batched, reference_outputs, row_first_difference, row_key)
from specdec.bench.runner import ResultsMismatchError, config_hash, run_benchmark
from specdec.bench.summary import (batch_summaries, draft_cost_ratio, mean_forward_ms, median_run, method_stats,
                                   summaries, summarize)
from specdec.metrics import AcceptanceStats, theoretical_speedup
from specdec.models import load_model, resolve_device

REPO = Path(__file__).resolve().parent.parent

TINY_CONFIG = Path(__file__).parent / "data" / "bench_tiny.yaml"

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write about the sea, the sea, the sea.", "Again, the sea."]},
    {"question_id": 101, "category": "translation", "turns": ["Translate: Der Hund schläft. Der Hund schläft."]},
    {"question_id": 501, "category": "rag", "turns": ["Context: Paris is in France. Paris is big. Question: where is Paris?"]},
]
TURNS = 4  # 2 + 1 + 1


def write_dataset(folder: Path) -> Path:
    path = folder / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def tiny_config(folder: Path, *, methods: list[dict] | None = None, **overrides) -> Path:
    """The committed tests/data/bench_tiny.yaml, pointed at a dataset in ``folder``, with overrides."""
    data = yaml.safe_load(TINY_CONFIG.read_text())
    data["dataset"] = {"path": str(write_dataset(folder)), "subtasks": ["mt_bench", "translation", "rag"]}
    data["generation"] = {"max_new_tokens": 10}
    data["warmup_new_tokens"] = 2
    data["threads"] = 1  # tiny models: one thread avoids OpenMP hand-offs, which cost most on a busy machine
    if methods is not None:
        data["methods"] = methods
    for key, value in overrides.items():
        data[key] = value
    path = folder / "bench.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


TWO_METHODS = [{"name": "baseline", "generator": "baseline"},
               {"name": "pl3", "generator": "prompt_lookup", "options": {"num_tokens": 3}}]


def run(config_path: Path, out: Path, **kwargs):
    return run_benchmark(load_config(config_path), config_file=config_path, out_dir=out, progress=False,
                         log=lambda _: None, **kwargs)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench_full")
    config = tiny_config(folder)
    rows_seen = []

    def on_row(row):  # the row is on disk before the runner moves on
        on_disk = ResultStore(folder / "out" / RESULTS_FILE).load()
        rows_seen.append((row_key(row), [row_key(r) for r in on_disk]))

    result = run(config, folder / "out", on_row=on_row)
    return folder / "out", result, rows_seen


def test_a_recorded_run_reads_back_the_reference_turns_and_their_prompts(full_run):
    """``specdec.bench.recorded``, where the replay scripts start: the reference method's turns by
    question and turn, each with the prompt ids it was called with (a second turn's holding the
    method's own first answer)."""
    out, _, _ = full_run
    recorded = load_recorded_run(out.parent / "bench.yaml", out, tokenizer=load_model("tiny-random:llama")[1])
    keys = [(r["question_id"], r["turn"]) for r in recorded.turns]
    assert len(keys) == TURNS and keys == sorted(keys) and {r["method"] for r in recorded.turns} == {"baseline"}
    assert [len(p) for p in recorded.prompts] == [r["prompt_tokens"] for r in recorded.turns]
    assert recorded.config.methods[0].name == "baseline" and len(recorded.rows) == len(load_run(out)[1])


# -- config validation -------------------------------------------------------------------------
def test_committed_tiny_config_is_valid():
    config = load_config(TINY_CONFIG)
    assert [m.generator for m in config.methods] == ["baseline", "prompt_lookup", "draft_model", "hf_prompt_lookup",
                                                     "hf_assisted"]
    assert config.dataset_path(TINY_CONFIG.parent).is_file()


@pytest.mark.parametrize("patch, expected", [
    ({"speed": 1}, "speed: unknown field 'speed'; allowed: description, target"),
    ({"target": "smollm3"}, "target: unknown model 'smollm3'; allowed: smollm2-135m, gemma3-270m"),
    ({"methods": [{"generator": "baseline"}, {"generator": "prompt_lokup"}]},
     "methods[1].generator: unknown method 'prompt_lokup'. Did you mean 'prompt_lookup'? Allowed: baseline,"),
    ({"methods": [{"generator": "baseline"}, {"generator": "draft_model", "draft": "tiny-random:nope"}]},
     "methods[1].draft: unknown tiny-random architecture 'nope'; allowed: llama"),
    ({"methods": [{"generator": "baseline"}, {"generator": "prompt_lookup", "options": {"k": 2}}]},
     "methods[1].options: unknown option(s) ['k'] for 'prompt_lookup'; allowed: num_tokens"),
    ({"methods": [{"generator": "baseline"}, {"generator": "hf_assisted"}]},
     "methods[1].draft: method 'hf_assisted' needs a draft model"),
    ({"methods": [{"generator": "prompt_lookup"}]}, "methods: need a method with generator 'baseline'"),
    ({"dataset": {"per_subtask": -1}}, "dataset.per_subtask: Input should be greater than or equal to 1 (got -1)"),
    ({"generation": {"max_new_tokens": 0}}, "generation.max_new_tokens: Input should be greater than or equal to 1"),
    ({"dataset": {"subtasks": ["coding"]}}, "dataset.subtasks[0]: Input should be 'mt_bench', 'translation'"),
    ({"batch_sizes": [1, 0]}, "batch_sizes: batch sizes must be positive integers (allowed: 1, 2, 3, ...), got 0"),
    ({"batch_sizes": [-4]}, "batch_sizes: batch sizes must be positive integers (allowed: 1, 2, 3, ...), got -4"),
    ({"batch_sizes": []}, "batch_sizes: List should have at least 1 item"),
    ({"batch_sizes": [2, 2]}, "batch_sizes: duplicate batch size(s) [2]"),
    ({"batch_size": 0}, "batch_sizes: batch sizes must be positive integers"),
    ({"batch_size": 1, "batch_sizes": [1]}, "batch_size: give batch_sizes only"),
    ({"device": "gpu"}, "device: expected one of cpu, cuda, cuda:N, auto, got 'gpu'"),
    ({"device": "cuda:"}, "device: expected one of cpu, cuda, cuda:N, auto, got 'cuda:'"),
    ({"dtype": "fp16"}, "dtype: Input should be 'float32', 'bfloat16' or 'float16' (got 'fp16')"),
    ({"methods": [{"generator": "baseline", "cache_implementation": "paged"}]},
     "methods[0].cache_implementation: Input should be 'dynamic' or 'static' (got 'paged')"),
    ({"methods": [{"generator": "baseline", "compile": True}]},
     "methods[0].compile: needs cache_implementation: static"),
    ({"methods": [{"generator": "baseline"}, {"generator": "prompt_lookup", "compile": "yes"}]},
     "methods[1].compile: expected true, false or a mapping of compile options (e.g. {backend: aot_eager}), got 'yes'"),
    ({"methods": [{"generator": "baseline"}, {"generator": "prompt_lookup", "cache_implementation": "static",
                                              "compile": {"bakend": "aot_eager"}}]},
     "methods[1].compile: unknown option(s) ['bakend']; allowed: fullgraph, dynamic, backend, mode"),
    ({"methods": [{"generator": "baseline", "cache_implementation": "static", "compile": {"disable": True}}]},
     "methods[0].compile: unknown option(s) ['disable']; allowed: fullgraph, dynamic, backend, mode, options"),
    ({"methods": [{"generator": "baseline"}, {"generator": "hf_prompt_lookup", "cache_implementation": "static"}]},
     "methods[1].cache_implementation: 'hf_prompt_lookup' takes the dynamic cache only"),
    ({"methods": [{"generator": "baseline"}, {"name": "b2", "generator": "baseline"}]},
     "reference: 2 baseline methods (baseline, b2); name the one speedups are measured against"),
    ({"methods": TWO_METHODS, "reference": "pl3"}, "reference: 'pl3' is not a method with generator 'baseline'"),
    ({"methods": [{"generator": "baseline"}, {"generator": "none", "options": {"num_tokens": 3}}]},
     "methods[1].options: unknown option(s) ['num_tokens'] for 'none'; allowed: (none)"),
    ({"dataset": {"first_per_category": 2}}, "dataset.first_per_category: needs categories"),
    ({"dataset": {"categories": ["rag"], "first_per_category": 2, "per_subtask": 1}},
     "dataset.first_per_category: give per_subtask or first_per_category, not both"),
    ({"dataset": {"max_turns": 0}}, "dataset.max_turns: Input should be greater than or equal to 1"),
])
def test_bad_config_one_clear_line_nothing_written(tmp_path, capsys, patch, expected):
    data = {"target": "tiny-random:llama", "methods": TWO_METHODS, **patch}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert expected in str(err.value)
    assert cli.main([str(path), "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdec bench: error: ") and expected in lines[0]
    assert not (tmp_path / "out").exists()


def test_missing_dataset_is_reported_before_anything_is_written(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"target": "tiny-random:llama", "methods": TWO_METHODS,
                                    "dataset": {"path": "nowhere.jsonl"}}))
    assert cli.main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "dataset.path: file not found" in err and "nowhere.jsonl" in err
    assert not (tmp_path / "out").exists()


def test_not_a_mapping_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="must hold a YAML mapping"):
        parse_config(["x"])
    bad = tmp_path / "b.yaml"
    bad.write_text("target: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


# -- pure helpers ------------------------------------------------------------------------------
def test_selection_is_deterministic_and_spread():
    assert spread(list(range(10)), 3) == [0, 3, 6]
    assert spread([1, 2], 5) == [1, 2]
    rows = [{"question_id": i, "category": c, "turns": ["t"]} for i, c in
            [(5, "qa"), (1, "writing"), (2, "coding"), (3, "qa"), (4, "roleplay")]]
    picked = select_questions(rows, ["qa", "mt_bench"], None, 2)
    assert [(q.question_id, q.subtask) for q in picked] == [(3, "qa"), (5, "qa"), (1, "mt_bench"), (2, "mt_bench")]
    assert [q.question_id for q in select_questions(rows, ["mt_bench"], ["coding"], None)] == [2]
    # the demo's selection: the first ones by id of each category, in the order listed, first turns only
    rows += [{"question_id": 6, "category": "writing", "turns": ["a", "b"]}, {"question_id": 0, "category": "qa",
                                                                              "turns": ["c"]}]
    picked = select_questions(rows, ["qa", "mt_bench"], ["writing", "qa"], None, first_per_category=2, max_turns=1)
    assert [(q.question_id, q.subtask, q.turns) for q in picked] == [(1, "mt_bench", ("t",)), (6, "mt_bench", ("a",)),
                                                                     (0, "qa", ("c",)), (3, "qa", ("t",))]


def test_the_packaged_demo_config_asks_what_the_demo_always_asked(tmp_path):
    """``specdec demo``'s questions: the first ``--per-category`` of each category in file order, first turns."""
    from specdec.bench.demo import DEMO_CONFIG, DemoSettings, default_categories, demo_config

    categories = ["extraction", "rag", "summarization", "translation"]
    rows = [{"question_id": i, "category": c, "turns": [f"{c} {i}", "again"] if c == "extraction" else [f"{c} {i}"]}
            for i, c in enumerate(["writing", "rag", "extraction", "translation", "rag", "summarization", "rag",
                                   "extraction", "extraction", "summarization", "translation", "translation"])]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert default_categories() == categories and DEMO_CONFIG.is_file()
    method = {"name": "prompt_lookup", "generator": "prompt_lookup"}
    for per_category in (None, 1, 3):
        config = demo_config(DemoSettings(method, dataset=str(path), per_category=per_category))
        n = per_category or 2
        before = [r for c in categories for r in [r for r in rows if r["category"] == c][:n]]  # the old loop
        asked = load_selected_questions(config, tmp_path)
        assert [(q.question_id, q.turns) for q in asked] == [(r["question_id"], tuple(r["turns"][:1])) for r in before]
    assert [m.generator for m in config.methods] == ["baseline", "prompt_lookup"] and config.reference is None
    compiled = demo_config(DemoSettings(method, dataset=str(path), threads=1, device="auto", dtype="bfloat16",
                                        cache_implementation="static", compile=True, max_new_tokens=7,
                                        categories=["rag"], target="tiny-random:llama"))
    assert all(m.cache_implementation == "static" and m.compile is True for m in compiled.methods)
    assert (compiled.threads, compiled.device, compiled.dtype, compiled.generation.max_new_tokens,
            compiled.dataset.categories, compiled.target) == (1, "auto", "bfloat16", 7, ["rag"], "tiny-random:llama")
    with pytest.raises(ConfigError, match="unknown category"):
        demo_config(DemoSettings(method, categories=["poetry"]))


def test_messages_and_seeds():
    assert build_messages(("a", "b"), ["A"]) == [{"role": "user", "content": "a"},
                                                 {"role": "assistant", "content": "A"},
                                                 {"role": "user", "content": "b"}]
    assert question_seed(0, 7, 1) == question_seed(0, 7, 1) != question_seed(0, 7, 2)


def test_summary_formulas_on_hand_made_rows():
    stats = AcceptanceStats(steps=4, drafted_tokens=8, accepted_tokens=4, committed_tokens=8,
                            accepted_at_position=[3, 1], draft_seconds=0.08, verify_seconds=0.4, total_seconds=0.5)
    row = lambda m, q, ids, s, st=None, fw=None: {  # noqa: E731
        "method": m, "question_id": q, "turn": 1, "subtask": "qa", "new_tokens": len(ids), "seconds": s,
        "output_ids": ids, "stats": st, "target_forwards": fw if fw is not None else len(ids)}
    base = {(1, 1): row("b", 1, [1] * 8, 1.0), (2, 1): row("b", 2, [2] * 8, 1.0)}
    mine = [row("m", 1, [1] * 8, 0.5, stats.as_dict()), row("m", 2, [3] * 8, 0.5, stats.as_dict())]
    s = summarize("m", "prompt_lookup", "qa", mine, base, greedy=True, is_reference=False)
    assert s.speedup == pytest.approx(2.0)  # (16 / 1.0) / (16 / 2.0)
    assert s.exact_match == 0.5 and s.agreement.first_differences == (0,)  # question 2 differs from its first token
    assert s.mean_accepted_length == pytest.approx(2.0)  # merged: 16 committed / 8 steps
    assert s.acceptance_rate == 0.5 and s.k_per_step == 2.0
    c = (0.16 / 16) / (0.8 / 8)
    assert draft_cost_ratio(s.stats) == pytest.approx(c)
    assert s.theoretical_speedup == pytest.approx(theoretical_speedup(0.5, 2.0, c))
    assert s.efficiency == pytest.approx(2.0 / theoretical_speedup(0.5, 2.0, c))
    hf = summarize("h", "hf_prompt_lookup", "qa", [row("h", 1, [1] * 8, 0.5, fw=4)], base, greedy=False,
                   is_reference=False)
    assert hf.mean_accepted_length == 2.0 and hf.forwards_only
    assert hf.acceptance_rate is None and hf.theoretical_speedup is None and hf.exact_match is None


# -- a full run --------------------------------------------------------------------------------
def test_full_run_rows_exactness_and_report(full_run):
    out, result, _ = full_run
    meta, rows = load_run(out)
    methods = [m["name"] for m in meta["config"]["methods"]]
    assert result.rows_total == TURNS * len(methods) == len(rows) == result.rows_new
    assert {row_key(r) for r in rows} == {(m, q["question_id"], t) for m in methods for q in QUESTIONS
                                          for t in range(1, len(q["turns"]) + 1)}
    # interleaved: every method answers a question before the next question starts
    order = [(r["question_id"], r["method"]) for r in ResultStore(out / RESULTS_FILE).load()]
    assert [q for q, _ in order] == sorted((q for q, _ in order), key=[1, 101, 501].index)
    # the second MT-Bench turn follows the method's own first answer
    for m in methods:
        t1, t2 = (next(r for r in rows if r["method"] == m and r["question_id"] == 1 and r["turn"] == t) for t in (1, 2))
        assert t2["prompt_tokens"] > t1["prompt_tokens"] + 2
    greedy = summaries(meta, rows)
    for s in greedy:
        if s.method != "baseline":
            assert s.exact_match == 1.0, (s.method, s.subtask)
        assert s.speedup is not None and s.tokens_per_second > 0
    overall = {s.method: s for s in greedy if s.subtask == "overall"}
    assert overall["baseline"].mean_accepted_length == 1.0
    assert overall["dm3"].acceptance_rate == 1.0  # the draft is the target's twin
    assert overall["hf_dm3"].mean_accepted_length > 1.0 and overall["hf_dm3"].acceptance_rate is None
    report = (out / "report.md").read_text()
    for text in ("## Overall", "## Speedup over baseline by subtask", "## Per subtask", "## Acceptance by draft position",
                 "`pl4` / `hf_pl4`", "| `dm3` |", "![speedup.png](speedup.png)", "## Draft lengths chosen",
                 "![forward_cost.png](forward_cost.png)"):
        assert text in report
    for name in ("speedup.png", "acceptance_by_position.png", "forward_cost.png"):
        assert (out / name).stat().st_size > 1000


def test_each_row_is_on_disk_before_the_next_starts(full_run):
    _, result, seen = full_run
    assert len(seen) == result.rows_new
    for i, (key, on_disk) in enumerate(seen):
        assert len(on_disk) == i + 1 and on_disk[-1] == key


def test_report_rebuilds_from_the_json_lines(full_run, capsys):
    out, _, _ = full_run
    before = (out / "report.md").read_text()
    for name in ("report.md", "speedup.png", "acceptance_by_position.png", "forward_cost.png"):
        (out / name).unlink()
    assert cli.main(["report", str(out)]) == 0
    assert (out / "report.md").read_text() == before
    assert all((out / name).exists() for name in ("speedup.png", "acceptance_by_position.png", "forward_cost.png"))
    assert cli.main(["report", str(out / "nothing")]) == 2
    assert "no run.json" in capsys.readouterr().err


def test_the_first_calls_are_set_apart_when_asked(full_run, tmp_path):
    """``first_calls: N`` adds the methods over the rows after the run's first N calls (questions in
    order, turns in order); the rows themselves do not depend on it."""
    from specdec.bench.report import first_calls_of

    out, _, _ = full_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    meta = json.loads((copy / "run.json").read_text())
    assert "## After the first" not in (copy / "report.md").read_text()  # 0, the default: no section
    meta["config"]["first_calls"] = 2
    (copy / "run.json").write_text(json.dumps(meta))
    first = first_calls_of(meta)
    order = [(q["question_id"], t) for q in meta["questions"] for t in range(1, q["turns"] + 1)]
    assert first == set(order[:2]) and len(first) == 2
    write_report(copy, log=None)
    section = (copy / "report.md").read_text().split("## After the first 2 calls", 1)[1].split("\n## ", 1)[0]
    turns = len(order) - 2
    for m in meta["config"]["methods"]:
        assert f"| `{m['name']}` | {turns} |" in section, m["name"]


# -- interruption, resume, changed config ------------------------------------------------------
def test_resume_after_interruption(tmp_path):
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    out = tmp_path / "out"
    produced = []

    def interrupt_after_three(row):
        produced.append(row_key(row))
        if len(produced) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(config, out, on_row=interrupt_after_three)
    assert len(ResultStore(out / RESULTS_FILE).load()) == 3
    with (out / RESULTS_FILE).open("a") as f:  # a write torn by the interruption
        f.write('{"method": "baseline", "question_')
    again = []
    result = run(config, out, on_row=lambda r: again.append(row_key(r)))
    # the first turn was timed whole and is kept; the interrupted one (the baseline's row only) runs again
    # whole, so that its speedup compares calls timed side by side (issue 47, item 11)
    assert result.rows_done_before == 2 and result.rows_new == TURNS * 2 - 2
    assert (result.units.kept, result.units.rerun) == (1, 1)
    assert not set(again) & set(produced[:2]) and again[:2] == [produced[2], ("pl3", 1, 2)]
    assert len(ResultStore(out / RESULTS_FILE).load()) == TURNS * 2 + 1  # the file is appended to, never rewritten
    _, rows = load_run(out)
    assert len(rows) == len({row_key(r) for r in rows}) == TURNS * 2
    assert len({r["session"] for r in rows if (r["question_id"], r["turn"]) == (1, 2)}) == 1
    assert len(json.loads((out / RUN_FILE).read_text())["sessions"]) == 2
    report = (out / "report.md").read_text()
    assert "incomplete" not in report and "session 2 kept 1 turn(s) or batch(es) and ran 1 again whole" in report
    assert run(config, out).rows_new == 0  # a finished run has nothing left to do


def test_changed_config_is_refused_or_started_fresh(tmp_path, capsys):
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    out = tmp_path / "out"
    run(config, out)
    changed = tiny_config(tmp_path, methods=TWO_METHODS, generation={"max_new_tokens": 6})
    with pytest.raises(ResultsMismatchError, match="different config"):
        run(changed, out)
    assert cli.main([str(changed), "--out", str(out), "--no-progress"]) == 2
    assert "--fresh" in capsys.readouterr().err
    result = run(changed, out, fresh=True)
    assert result.rows_done_before == 0 and result.rows_new == TURNS * 2
    assert all(r["new_tokens"] <= 6 for r in ResultStore(out / RESULTS_FILE).load())


def test_sampling_is_reproducible_and_exact_match_is_na(tmp_path):
    config = tiny_config(tmp_path, methods=TWO_METHODS,
                         generation={"max_new_tokens": 8, "do_sample": True, "temperature": 0.8, "seed": 3})
    first, second = run(config, tmp_path / "a"), run(config, tmp_path / "b")
    rows_a, rows_b = (ResultStore(r.out_dir / RESULTS_FILE).load() for r in (first, second))
    ids = lambda rows: {row_key(r): r["output_ids"] for r in rows}  # noqa: E731
    assert ids(rows_a) == ids(rows_b)
    assert all(r["seed"] is not None for r in rows_a)
    meta, rows = load_run(first.out_dir)
    assert all(s.exact_match is None for s in summaries(meta, rows))
    assert "exact match is n/a" in (first.out_dir / "report.md").read_text()


def test_malformed_dataset_is_a_config_error(tmp_path):
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    (tmp_path / "questions.jsonl").write_text('{"question_id": 1, "category": "qa"\n')
    with pytest.raises(ConfigError, match="is not Spec-Bench JSONL"):
        run(config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("turns", ['"hello"', "[]", "[5]"])
def test_turns_that_are_not_a_list_of_strings_are_a_config_error(tmp_path, turns):
    """A string was read as one turn per character, an empty list failed after the models loaded
    (as a method that "cannot compile"), a number crashed in the chat template mid-run."""
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    (tmp_path / "questions.jsonl").write_text(f'{{"question_id": 1, "category": "translation", "turns": {turns}}}\n')
    with pytest.raises(ConfigError, match="question 1: turns must be a non-empty list of strings"):
        run(config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("below", ["", "sub"])
def test_an_output_folder_that_is_a_file_is_refused_before_any_model_loads(tmp_path, below):
    """It failed with a traceback after every model had loaded and warmed up."""
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="afile is a file, not a folder"):
        run(config, tmp_path / "afile" / below)


def test_bad_inputs_outside_a_run_are_one_line_errors(tmp_path):
    """A run.json that is not JSON (report), an empty category list (no question, said as such),
    a baseline given options (its allowed ones were listed as nothing)."""
    (tmp_path / "run.json").write_text("{bad")
    with pytest.raises(ConfigError, match="run.json is not JSON"):
        write_report(tmp_path)
    data = {"target": "tiny-random:llama", "dataset": {"path": "q.jsonl"}, "methods": [{"name": "b", "generator": "baseline"}]}
    with pytest.raises(ConfigError, match="categories: an empty list selects no question"):
        parse_config({**data, "dataset": {"path": "q.jsonl", "categories": []}})
    with pytest.raises(ConfigError, match="unknown field 'x'; allowed: none"):
        parse_config({**data, "methods": [{"name": "b", "generator": "baseline", "options": {"x": 1}}]})


def test_a_question_id_selected_twice_is_a_config_error(tmp_path):
    """Rows are keyed by question id: the second question of an id was skipped as done, silently."""
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    (tmp_path / "questions.jsonl").write_text("".join(
        f'{{"question_id": 7, "category": "translation", "turns": ["{text}"]}}\n' for text in ("one", "two")))
    with pytest.raises(ConfigError, match="selects question_id 7 more than once"):
        run(config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("grammar, message", [({"json_schema": 5}, "a JSON schema is a dict"),
                                              ({"regex": "("}, "the regex grammar does not compile")])
def test_a_grammar_that_cannot_compile_stops_the_run_before_a_file_is_written(tmp_path, grammar, message):
    """A schema of the wrong type was a TypeError traceback from the config's validation; a regex
    that does not parse passed it and failed on the first question, after run.json was written."""
    config = tiny_config(tmp_path, methods=TWO_METHODS)
    data = yaml.safe_load(config.read_text())
    data["generation"]["grammar"] = grammar
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=f"generation.grammar.*{message}"):
        run(config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_median_run_keeps_the_middle_run_and_every_time():
    runs = [{"seconds": t, "output_ids": [1, 2], "tag": t} for t in (3.0, 1.0, 2.0, 9.0)]
    row = median_run(runs)
    assert row["tag"] == 2.0  # the lower of the two middle runs
    assert row["seconds"] == 2.0 and row["seconds_runs"] == [3.0, 1.0, 2.0, 9.0] and row["runs_identical"]
    runs[3]["output_ids"] = [1, 3]
    assert median_run(runs[1:])["runs_identical"] is False and median_run(runs[1:])["seconds"] == 2.0
    assert median_run(runs[:1]) is runs[0]  # one run: the row as it is, no extra fields


def test_repeats_interleave_methods_and_keep_median_rows(tmp_path, monkeypatch):
    from specdec.bench import runner as bench_runner

    calls = []
    run_one, run_batch = bench_runner._run_one, bench_runner._run_batch
    monkeypatch.setattr(bench_runner, "_run_one", lambda r, q, turn, *a: (
        calls.append((r.config.name, q.question_id, turn)), run_one(r, q, turn, *a))[1])
    monkeypatch.setattr(bench_runner, "_run_batch", lambda r, g, p, size, i, *a: (
        calls.append((r.config.name, "batch", i)), run_batch(r, g, p, size, i, *a))[1])
    once = load_config(tiny_config(tmp_path, methods=TWO_METHODS, batch_sizes=[1, 2]))
    config = tiny_config(tmp_path, methods=TWO_METHODS, repeats=3, batch_sizes=[1, 2])
    assert config_hash(load_config(config), []) != config_hash(once, [])
    # repeats: 1 is hashed as before the field existed, so earlier results still resume
    assert "repeats" not in bench_runner._without_later_defaults(once.model_dump(mode="json"))
    result = run(config, tmp_path / "out")
    # each call three times, the methods taking turns: baseline, pl3, baseline, pl3, ...
    assert calls[:6] == [("baseline", 1, 1), ("pl3", 1, 1)] * 3 and calls[6:8] == [("baseline", 1, 2), ("pl3", 1, 2)]
    assert calls[-6:] == [("baseline", "batch", 1), ("pl3", "batch", 1)] * 3
    rows = ResultStore(result.out_dir / RESULTS_FILE).load()
    assert len(calls) == 3 * len(rows) and len(rows) == TURNS * 2 + 2 * 2
    for row in rows:
        assert len(row["seconds_runs"]) == 3 and row["runs_identical"]
        assert row["seconds"] == sorted(row["seconds_runs"])[1]
    assert "each call run 3 times" in (result.out_dir / "report.md").read_text()
    with pytest.raises(ConfigError, match="repeats"):
        load_config(tiny_config(tmp_path, methods=TWO_METHODS, repeats=0))


# -- batch sizes -------------------------------------------------------------------------------
BATCH_METHODS = TWO_METHODS + [
    # a draft as large as its target never pays under the cost-aware default: a fixed K makes it draft
    {"name": "dm3", "generator": "draft_model", "draft": "tiny-random:llama", "options": {"num_tokens": 3, "schedule": "fixed"}},
    {"name": "hf_pl4", "generator": "hf_prompt_lookup", "options": {"num_tokens": 4}}]
BATCHED = ["baseline", "pl3", "dm3"]  # hf_* are not run at batch size > 1


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench_batches")
    config = tiny_config(folder, methods=BATCH_METHODS, batch_sizes=[1, 3])
    return config, folder / "out", run(config, folder / "out")


def test_batch_sizes_default_and_old_field_keep_the_hash(tmp_path):
    plain = load_config(tiny_config(tmp_path, methods=TWO_METHODS))
    old = load_config(tiny_config(tmp_path, methods=TWO_METHODS, batch_size=1))
    batched = load_config(tiny_config(tmp_path, methods=TWO_METHODS, batch_sizes=[1, 3]))
    assert plain.batch_sizes == old.batch_sizes == [1] and batched.batch_sizes == [1, 3]
    questions = load_selected_questions(plain, tmp_path)
    assert config_hash(plain, questions) == config_hash(old, questions) != config_hash(batched, questions)
    # a config without batch sizes hashes as the single-size schema did (results written then still resume)
    import hashlib
    legacy = {**plain.model_dump(mode="json", exclude={"description", "batch_sizes", "device", "dtype", "reference",
                                                 "repeats", "distributed", "first_calls"}),
              "batch_size": 1}
    legacy["methods"] = [{k: v for k, v in m.items() if k not in ("cache_implementation", "compile", "fast_head",
                                                                  "engine")}
                         for m in legacy["methods"]]  # the schema before devices, compilation, the fast head, engines
    legacy["dataset"] = {k: v for k, v in legacy["dataset"].items() if k not in ("first_per_category", "max_turns")}
    legacy["generation"] = {k: v for k, v in legacy["generation"].items()  # before the processor settings and grammars
                            if k not in ("min_p", "repetition_penalty", "encoder_repetition_penalty",
                                         "no_repeat_ngram_size", "min_new_tokens", "bad_words_ids", "suppress_tokens", "grammar")}
    payload = json.dumps({"config": legacy, "questions": [q.question_id for q in questions]}, sort_keys=True)
    assert config_hash(plain, questions) == hashlib.sha256(payload.encode()).hexdigest()[:16]


def test_batch_rows_recorded_and_exact(batch_run):
    _, out, result = batch_run
    meta, rows = load_run(out)
    singles = [r for r in rows if not is_batched(r)]
    batched = [r for r in rows if is_batched(r)]
    assert len(singles) == TURNS * len(BATCH_METHODS)
    assert all("batch_size" not in r for r in singles)  # batch-size-1 rows keep their format
    # 3 questions in batches of 3: one batch, first turns only, for each method that runs batches
    assert sorted(row_key(r) for r in batched) == sorted((m, "batch", 3, 0) for m in BATCHED)
    assert result.rows_total == result.rows_new == len(rows)
    for r in batched:
        assert r["question_ids"] == [1, 101, 501] and r["turn"] == 1 and r["seconds"] > 0
        assert len(r["output_ids"]) == len(r["new_tokens"]) == 3
        assert [len(o) for o in r["output_ids"]] == r["new_tokens"]
        assert (r["stats"] is None) == (r["method"] == "baseline")
    alone = {r["question_id"]: r["output_ids"] for r in singles if r["method"] == "baseline" and r["turn"] == 1}
    for r in batched:  # each row equals decoding it alone, for every method
        assert r["output_ids"] == [alone[q] for q in r["question_ids"]], r["method"]
    by = {(b.method, b.batch_size): b for b in batch_summaries(meta, rows)}
    assert set(by) == {(m["name"], 1) for m in BATCH_METHODS} | {(m, 3) for m in BATCHED}
    for m in ("pl3", "dm3"):
        for size in (1, 3):
            assert by[(m, size)].exact_match == 1.0 and by[(m, size)].speedup is not None
    assert by[("baseline", 3)].exact_match == 1.0 and by[("baseline", 3)].speedup == 1.0
    assert by[("dm3", 3)].mean_accepted_length > 1.0
    assert by[("pl3", 1)].prompts == by[("pl3", 3)].prompts == 3  # the same prompts in every column
    # the per-question tables are unchanged by the batched rows
    assert {s.method for s in summaries(meta, rows)} == {m["name"] for m in BATCH_METHODS}


def test_batch_report_table_and_skipped_notes(batch_run):
    _, out, _ = batch_run
    report = (out / "report.md").read_text()
    assert "## Throughput by batch size" in report and "| method | batch 1 | batch 3 |" in report
    line = next(x for x in report.splitlines() if x.startswith("| `hf_pl4` |") and "not run" in x)
    assert line.endswith("| not run |")
    assert "`hf_pl4` not run" in report and "transformers refuses" in report
    assert "first turns only" in report and "Where the gain ends" in report
    assert "incomplete" not in report


def test_batch_run_resumes(tmp_path):
    config = tiny_config(tmp_path, methods=TWO_METHODS, batch_sizes=[1, 3], generation={"max_new_tokens": 6})
    out = tmp_path / "out"
    produced = []

    def interrupt_in_the_batches(row):
        produced.append(row_key(row))
        if is_batched(row):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(config, out, on_row=interrupt_in_the_batches)
    assert produced[-1] == ("baseline", "batch", 3, 0) and len(produced) == TURNS * 2 + 1
    again = []
    result = run(config, out, on_row=lambda r: again.append(row_key(r)))
    # the batch's baseline row alone was written: the batch runs again whole, every method in one session
    assert result.rows_done_before == TURNS * 2 and again == [("baseline", "batch", 3, 0), ("pl3", "batch", 3, 0)]
    assert result.rows_total == TURNS * 2 + 2
    assert run(config, out).rows_new == 0


def test_batches_without_size_one_compare_with_the_batched_baseline(tmp_path):
    config = tiny_config(tmp_path, methods=TWO_METHODS, batch_sizes=[2], generation={"max_new_tokens": 6})
    result = run(config, tmp_path / "out")
    meta, rows = load_run(tmp_path / "out")
    assert result.rows_total == 4 and all(is_batched(r) for r in rows)  # batches [1, 101], [501]
    assert [r["question_ids"] for r in rows if r["method"] == "pl3"] == [[1, 101], [501]]
    by = {(b.method, b.batch_size): b for b in batch_summaries(meta, rows)}
    assert by[("pl3", 2)].exact_match == 1.0 and by[("baseline", 2)].exact_match is None
    assert "## Throughput by batch size" in (tmp_path / "out" / "report.md").read_text()


def test_gain_ends_sentences():
    from specdec.bench.summary import BatchSummary
    row = lambda m, b, s: BatchSummary(m, "baseline" if m == "base" else "x", b, 8, 80, 1.0, s, 2.0, 1.0)  # noqa: E731
    lines = gain_ends([row("base", 1, 1.0), row("pl", 1, 1.6), row("pl", 4, 1.2), row("pl", 8, 0.9),
                       row("dm", 1, 1.5), row("dm", 8, 1.1), row("hf", 1, 1.3), row("slow", 4, 0.8)])
    assert len(lines) == 3  # hf ran at batch size 1 only: nothing to say about batches
    assert lines[0].startswith("- `pl`: the gain ends between batch size 4 and 8")
    assert "faster than the batched baseline at every batch size measured (largest: 8)" in lines[1]
    assert lines[2] == "- `slow`: no faster than the batched baseline at any batch size measured (speedup by batch size: 4: 0.80x)."


# -- devices, static caches, compilation, identical outputs --------------------------------------
GPU_CONFIG = REPO / "benchmarks" / "configs" / "gpu_smollm2.yaml"


def test_device_dtype_cache_and_compile_fields_parse():
    plain = parse_config({"target": "tiny-random:llama", "methods": TWO_METHODS})
    assert (plain.device, plain.dtype, plain.torch_dtype, plain.reference) == ("cpu", "float32", torch.float32, None)
    assert plain.reference_method.name == "baseline"
    assert all(m.cache_implementation == "dynamic" and m.compile is False and not m.compiles for m in plain.methods)
    config = parse_config({"target": "tiny-random:llama", "device": "cuda:1", "dtype": "bfloat16", "reference": "fast",
                           "methods": [{"name": "slow", "generator": "baseline"},
                                       {"name": "fast", "generator": "baseline", "cache_implementation": "static",
                                        "compile": {"backend": "aot_eager"}},
                                       {"name": "plain", "generator": "none", "cache_implementation": "static",
                                        "compile": True}]})
    assert (config.device, config.torch_dtype, config.reference_method.name) == ("cuda:1", torch.bfloat16, "fast")
    assert [m.compiles for m in config.methods] == [False, True, True]
    assert config.methods[1].compile == {"backend": "aot_eager"} and config.methods[2].kind == method_kind("x")


def test_the_gpu_config_validates_here():
    config = load_config(GPU_CONFIG)
    assert (config.target, config.device, config.dtype) == ("smollm2-135m", "cuda", "bfloat16")
    assert config.dataset.per_subtask == 2 and config.generation.max_new_tokens == 128
    assert config.reference_method.name == "baseline_compiled"
    shape = [(m.generator, m.cache_implementation, m.compiles) for m in config.methods]
    lookup = [("prompt_lookup", "static", True)] * 3 + [("prompt_lookup", "dynamic", False)] * 3
    assert shape == [("baseline", "dynamic", False), ("baseline", "static", True), ("none", "static", True),
                     *lookup, ("hf_prompt_lookup", "dynamic", False)]
    # the policy's choice against K fixed at 4 and 10, compiled and eager, with the same n-grams
    fixed = [(m.options.get("schedule", "auto"), m.options.get("num_tokens")) for m in config.methods[3:9]]
    assert fixed == [("auto", None), ("fixed", 4), ("fixed", 10)] * 2
    assert all(set(m.options) <= {"schedule", "num_tokens"} for m in config.methods[3:9])
    header = GPU_CONFIG.read_text().split("description:")[0]
    assert header.startswith("# Needs a CUDA GPU") and "under 8 minutes" in header


def test_a_missing_cuda_device_is_refused_when_the_run_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    path = tiny_config(tmp_path, methods=TWO_METHODS, device="cuda")
    config = load_config(path)  # parses on a machine without a GPU
    with pytest.raises(ConfigError, match=r"^device: 'cuda' needs a CUDA GPU, but torch.cuda.is_available\(\) is False"):
        run(path, tmp_path / "out")
    assert cli.main([str(path), "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("specdec bench: error: device: 'cuda' needs a CUDA GPU") and len(lines) == 2
    assert not (tmp_path / "out").exists() and config.device == "cuda"


def test_new_fields_hash_only_when_set(tmp_path):
    plain = load_config(tiny_config(tmp_path, methods=TWO_METHODS))
    questions = load_selected_questions(plain, tmp_path)
    spelled = load_config(tiny_config(tmp_path, methods=[{**m, "cache_implementation": "dynamic", "compile": False}
                                                         for m in TWO_METHODS], device="cpu", dtype="float32"))
    assert config_hash(spelled, questions) == config_hash(plain, questions)  # defaults spelled out: same results
    dataset = {"path": str(tmp_path / "questions.jsonl"), "subtasks": ["mt_bench", "translation", "rag"]}
    for changed in ({"dtype": "bfloat16"}, {"device": "auto"}, {"dataset": {**dataset, "max_turns": 1}},
                    {"dataset": {**dataset, "categories": ["rag"], "first_per_category": 1}},
                    {"methods": [TWO_METHODS[0], {**TWO_METHODS[1], "cache_implementation": "static"}]}):
        other = load_config(tiny_config(tmp_path, **{"methods": TWO_METHODS, **changed}))
        assert config_hash(other, questions) != config_hash(plain, questions), changed


def test_first_difference_and_agreement():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None and first_difference([], []) is None
    assert first_difference([1, 2, 4], [1, 2, 3]) == 2 and first_difference([9], [1, 2]) == 0
    assert first_difference([1, 2], [1, 2, 3]) == 2 == first_difference([1, 2, 3], [1, 2])  # one stopped early
    agreement = Agreement.of([([1, 2], [1, 2]), ([1, 5], [1, 2]), ([7], [1]), ([3, 3, 3, 3], [3, 3, 3]), ([1], None)])
    assert (agreement.compared, agreement.identical, agreement.first_differences) == (4, 1, (1, 0, 3))
    assert (agreement.share, agreement.earliest, agreement.median) == (0.25, 0, 1)
    assert Agreement.of([]).share is None and Agreement.of([]).median is None


def test_reference_outputs_prefer_the_reference_decoding_alone():
    single = lambda m, q, ids: {"method": m, "question_id": q, "turn": 1, "output_ids": ids}  # noqa: E731
    batch = lambda m, ids: {"method": m, "batch_size": 2, "batch_index": 0, "question_ids": [1, 2],  # noqa: E731
                            "output_ids": ids}
    rows = [single("ref", 1, [1, 1]), single("m", 1, [1, 2]), batch("ref", [[1, 1], [2, 2]]), batch("m", [[1, 1], [2, 3]])]
    by_key = {row_key(r): r for r in rows}
    assert reference_outputs(rows[1], by_key, "ref") == [[1, 1]]
    assert reference_outputs(rows[0], by_key, "ref") == [None]  # never compared with itself
    assert reference_outputs(rows[3], by_key, "ref") == [[1, 1], [2, 2]]  # alone for question 1, the batch for 2
    assert reference_outputs(rows[2], by_key, "ref") == [[1, 1], None]
    assert row_first_difference(rows[1], by_key, "ref") == 1 and row_first_difference(rows[3], by_key, "ref") == [None, 1]
    with pytest.raises(LookupError):
        row_first_difference(rows[2], by_key, "ref")


def test_warm_up_sizes_and_the_cache_transformers_is_given():
    assert warmup_batch_sizes([1], 5) == [1] and warmup_batch_sizes([1, 4], 3) == [1, 2, 3]
    assert warmup_batch_sizes([2], 10) == [1, 2]
    assert hf_cache_kwargs() == {} and hf_cache_kwargs("dynamic", False) == {}
    assert hf_cache_kwargs("static") == {"cache_implementation": "static", "disable_compile": True}
    compiled = hf_cache_kwargs("static", {"backend": "aot_eager"})
    config = compiled["compile_config"]
    assert compiled["cache_implementation"] == "static" and config._compile_all_devices
    assert (config.backend, config.mode) == ("aot_eager", None)  # reduce-overhead is an inductor mode
    assert hf_cache_kwargs("static", True)["compile_config"].mode == "reduce-overhead"  # transformers' default


COMPILED_METHODS = [
    {"name": "baseline", "generator": "baseline"},
    {"name": "base_c", "generator": "baseline", "cache_implementation": "static", "compile": {"backend": "eager"}},
    {"name": "pl_s", "generator": "prompt_lookup", "cache_implementation": "static", "options": {"num_tokens": 3}},
    {"name": "pl_c", "generator": "prompt_lookup", "cache_implementation": "static",
     "options": {"num_tokens": 1, "schedule": "fixed"}, "compile": {"backend": "eager"}},  # widths 1, 2
    {"name": "plain_c", "generator": "none", "cache_implementation": "static", "compile": {"backend": "eager"}},
    {"name": "hf_pl4", "generator": "hf_prompt_lookup", "options": {"num_tokens": 4}}]
WARMUP_PAUSE = 60.0  # seconds the calls' clock jumps at each SpecDecoder.warmup that compiles: they must reach no row


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    """A run with static caches and compiled forwards (the eager backend: dynamo captures, no code is
    generated), the compiled baseline as the reference, at batch sizes 1 and 2; SpecDecoder.warmup made
    longer and watched, the target kept, and the number of graphs dynamo compiled noted at every row. A
    warm-up is made longer on the clock the calls are timed with (a jump of WARMUP_PAUSE, not a sleep):
    one inside a timed call would show in its row."""
    import types

    import torch._dynamo.utils as dynamo_utils

    import specdec.bench.runner as runner_module
    import specdec.bench.runner_calls as calls_module
    from specdec.decoder import SpecDecoder

    folder = tmp_path_factory.mktemp("bench_compiled")
    config = tiny_config(folder, methods=COMPILED_METHODS, reference="base_c", batch_sizes=[1, 2])
    warmups, targets, graphs, jumped = [], [], [], [0.0]
    real_warmup, real_load = SpecDecoder.warmup, runner_module.load_model
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + jumped[0])

    def slow_warmup(self, batch_size=1, max_length=1024):  # a warm-up that compiles takes WARMUP_PAUSE longer
        warmups.append((batch_size, max_length, len(graphs)))
        spent = real_warmup(self, batch_size, max_length)
        if spent > 0:
            jumped[0] += WARMUP_PAUSE
            spent += WARMUP_PAUSE
        return spent

    def keep_target(name, **kwargs):
        loaded = real_load(name, **kwargs)
        targets.append(loaded[0])
        return loaded

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SpecDecoder, "warmup", slow_warmup)
        patch.setattr(calls_module, "time", clock)
        patch.setattr(runner_module, "load_model", keep_target)
        result = run(config, folder / "out", on_row=lambda row: graphs.append(dynamo_utils.counters["stats"]["unique_graphs"]))
    return load_config(config), result, warmups, targets[0], graphs


def test_compiled_methods_are_warmed_up_before_any_timed_call(compiled_run):
    config, result, warmups, _, graphs = compiled_run
    meta, rows = load_run(result.out_dir)
    questions = load_selected_questions(config, result.out_dir.parent)
    longest = longest_call(questions, load_model("tiny-random:llama")[1], config.generation.max_new_tokens)
    # every SpecDecoder method (pl_s, pl_c, plain_c) at batch sizes 1 and 2, with a cache for the longest
    # call, before the first row; pl_s compiles nothing, so its warm-up takes no time
    assert [(b, n) for b, n, _ in warmups] == [(1, longest), (2, longest)] * 3
    assert all(rows_before == 0 for _, _, rows_before in warmups)
    assert all(r["prompt_tokens"] + r["new_tokens"] <= longest for r in rows if not is_batched(r))
    assert len(set(graphs)) == 1  # every graph was compiled during the warm-up: none inside a timed call
    seconds = meta["sessions"][-1]["warmup_seconds"]
    assert sorted(seconds) == ["base_c", "pl_c", "plain_c"] and seconds["base_c"] > 0
    assert seconds["pl_c"] >= 2 * WARMUP_PAUSE and seconds["plain_c"] >= 2 * WARMUP_PAUSE
    assert max(r["seconds"] for r in rows) < WARMUP_PAUSE  # the pauses are in no row's time
    overall = {s.method: s for s in summaries(meta, rows) if s.subtask == "overall"}
    assert overall["pl_c"].seconds == pytest.approx(sum(r["seconds"] for r in rows
                                                        if r["method"] == "pl_c" and not is_batched(r)))
    report = (result.out_dir / "report.md").read_text()
    section = report.split("## Warm-up (compile) seconds", 1)[1].split("\n## ", 1)[0]
    assert f"| `pl_c` | {seconds['pl_c']:.1f} s |" in section and "| `base_c` |" in section
    assert "`pl_s`" not in section and "no tokens/s above includes it" in section


def test_compiled_and_static_runs_are_exact_and_record_first_differences(compiled_run):
    config, result, _, target, _ = compiled_run
    meta, rows = load_run(result.out_dir)
    assert result.rows_new == result.rows_total == TURNS * 6 + 2 * 5  # 2 batches for the 5 methods that batch
    for r in rows:
        compiled = next(m for m in config.methods if m.name == r["method"]).compiles
        assert (r["target_forwards"] is None) == compiled, r["method"]
        if r["method"] == "base_c" and not is_batched(r):
            assert "first_difference" not in r  # the reference is not compared with itself
        elif is_batched(r):
            assert r["first_difference"] == [None] * len(r["question_ids"]), r["method"]
        else:
            assert r["first_difference"] is None, r["method"]
    overall = {s.method: s for s in summaries(meta, rows) if s.subtask == "overall"}
    assert overall["base_c"].reference and overall["base_c"].speedup == 1.0 and overall["base_c"].agreement is None
    assert overall["base_c"].mean_accepted_length == 1.0  # compiled: by definition, no forwards counted
    for name in ("baseline", "pl_s", "pl_c", "plain_c", "hf_pl4"):
        assert overall[name].exact_match == 1.0 and overall[name].agreement.identical == TURNS, name
    assert overall["plain_c"].mean_accepted_length == 1.0
    by = {(b.method, b.batch_size): b for b in batch_summaries(meta, rows)}
    assert all(by[(m, 2)].exact_match == 1.0 for m in ("baseline", "base_c", "pl_s", "pl_c", "plain_c"))
    report = (result.out_dir / "report.md").read_text()
    assert "- Reference (speedup 1.00x, exact match `ref`): `base_c`." in report
    assert "`pl_c` = prompt_lookup {'num_tokens': 1, 'schedule': 'fixed'}, static cache, compiled {'backend': 'eager'}" in report
    section = report.split("## Identical to the reference", 1)[1].split("\n## ", 1)[0]
    assert f"| `pl_s` | {TURNS} of {TURNS} | n/a | n/a |" in section and "`base_c` |" not in section
    assert "- Compiled: `base_c`, `pl_c`, `plain_c`." in report
    # the user's model: transformers compiled on copies of its generation config
    assert target.generation_config.compile_config is None and target.generation_config.cache_implementation is None


def test_report_counts_identical_outputs_and_first_differences(tmp_path):
    out = _synthetic_run(tmp_path, [s.as_dict() for s in _policy_stats()])
    store = ResultStore(out / RESULTS_FILE)
    rows = store.load()
    rows[1]["output_ids"] = [1] * 5 + [9] * 3  # `auto` differs from the baseline at position 5 of question 1
    (out / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta, rows = load_run(out)
    overall = next(s for s in summaries(meta, rows) if s.method == "auto" and s.subtask == "overall")
    assert overall.agreement == Agreement(2, (5,)) and overall.exact_match == 0.5
    write_report(out, log=None)
    section = (out / "report.md").read_text().split("## Identical to the reference", 1)[1].split("\n## ", 1)[0]
    assert "| `auto` | 1 of 2 | 5 | 5 |" in section


# -- method kinds, where results go, without matplotlib, signals --------------------------------
# -- draft lengths and the cost curve, from hand-made rows ---------------------------------------
def _synthetic_run(folder: Path, stats: list[dict]) -> Path:
    """run.json + results.jsonl in ``folder``: ``baseline`` and ``auto`` (prompt lookup) on two questions at
    batch size 1 (``auto``'s rows carry ``stats[0]``, ``stats[1]``) and one batch of 2 (``stats[2]``)."""
    meta = {"config_file": "synthetic.yaml", "config_hash": "0", "created": "now", "environment": {}, "sessions": [],
            "questions": [{"question_id": q, "subtask": "qa", "turns": 1} for q in (1, 2)],
            "config": {"target": "tiny-random:llama", "threads": 1, "batch_sizes": [1, 2],
                       "generation": {"do_sample": False, "max_new_tokens": 8},
                       "methods": [{"name": "baseline", "generator": "baseline", "options": {}},
                                   {"name": "auto", "generator": "prompt_lookup", "options": {}}]}}
    single = lambda m, q, s, st: {"method": m, "question_id": q, "turn": 1, "subtask": "qa", "new_tokens": 8,  # noqa: E731
                                   "seconds": s, "output_ids": [q] * 8, "stats": st, "target_forwards": 8}
    batch = lambda m, s, st: {"method": m, "question_id": 1, "turn": 1, "subtask": "qa", "batch_size": 2,  # noqa: E731
                              "batch_index": 0, "question_ids": [1, 2], "new_tokens": [8, 8], "seconds": s,
                              "output_ids": [[1] * 8, [2] * 8], "stats": st, "target_forwards": 8}
    rows = [single("baseline", 1, 1.0, None), single("auto", 1, 0.5, stats[0]),
            single("baseline", 2, 1.0, None), single("auto", 2, 0.5, stats[1]),
            batch("baseline", 1.5, None), batch("auto", 1.0, stats[2])]
    (folder / RUN_FILE).write_text(json.dumps(meta))
    store = ResultStore(folder / RESULTS_FILE)
    for r in rows:
        store.append(r)
    return folder


def _policy_stats() -> list[AcceptanceStats]:
    a = AcceptanceStats(steps=4, drafted_tokens=6, accepted_tokens=4, committed_tokens=8, accepted_at_position=[3, 1],
                        draft_seconds=0.05, verify_seconds=0.3, total_seconds=0.5, drafts_verified=[1, 0, 2, 1],
                        skipped_steps=1, calibration_seconds=0.25, generator={"lookups": 4})
    a.record_forward(1, 0.010)
    a.record_forward(4, 0.012)
    a.record_forward(4, 0.014)
    b = AcceptanceStats(steps=4, drafted_tokens=4, accepted_tokens=4, committed_tokens=8, accepted_at_position=[4],
                        draft_seconds=0.05, verify_seconds=0.3, total_seconds=0.5, drafts_verified=[2, 0, 2])
    b.record_forward(3, 0.011)
    batched = AcceptanceStats(steps=8, drafted_tokens=8, accepted_tokens=8, committed_tokens=16,
                              accepted_at_position=[8], draft_seconds=0.1, verify_seconds=0.6, total_seconds=1.0,
                              drafts_verified=[0, 8], calibration_seconds=0.5)
    batched.record_forward(4, 0.013)
    batched.record_forward(16, 0.030)
    return [a, b, batched]


def test_report_shows_draft_lengths_skipped_share_and_cost_curve(tmp_path):
    pytest.importorskip("matplotlib")
    out = _synthetic_run(tmp_path, [s.as_dict() for s in _policy_stats()])  # JSON: forward_costs keys are strings
    meta, rows = load_run(out)
    merged = method_stats(meta, rows)
    assert list(merged) == ["auto"]  # the baseline's rows carry no stats
    assert merged["auto"].forward_costs == {1: [1, 0.010], 3: [1, 0.011], 4: [3, pytest.approx(0.039)], 16: [1, 0.030]}
    assert merged["auto"].calibration_seconds == pytest.approx(0.75)  # batches included
    assert mean_forward_ms(merged["auto"]) == {1: pytest.approx(10.0), 3: pytest.approx(11.0),
                                               4: pytest.approx(13.0), 16: pytest.approx(30.0)}
    overall = next(s for s in summaries(meta, rows) if s.method == "auto" and s.subtask == "overall")
    assert overall.stats.drafts_verified == [3, 0, 4, 1] and overall.stats.skipped_share == 1 / 8
    assert k_distribution(overall.stats) == "0: 38%, 2: 50%, 3: 12%"
    assert k_distribution(overall.stats, shown=2) == "0: 38%, ≥2: 62%"
    write_report(out, log=None)
    report = (out / "report.md").read_text()
    section = report.split("## Draft lengths chosen", 1)[1].split("\n## ", 1)[0]
    assert "| method | mean K | drafting skipped | K distribution | calibration |" in section
    assert "| `auto` | 1.25 | 12.5% | 0: 38%, 2: 50%, 3: 12% | 0.75 s |" in section
    assert "`baseline`" not in section  # only methods that draft
    assert "[forward_cost.png](forward_cost.png)" in section and "![forward_cost.png](forward_cost.png)" in report
    assert (out / "forward_cost.png").stat().st_size > 1000
    assert "## Throughput by batch size" in report


def test_report_from_rows_without_the_policy_counters_still_builds(tmp_path):
    old_keys = ("drafts_verified", "skipped_steps", "skipped_share", "forward_costs", "calibration_seconds", "generator")
    old = [{k: v for k, v in s.as_dict().items() if k not in old_keys} for s in _policy_stats()]
    out = _synthetic_run(tmp_path, old)
    meta, rows = load_run(out)
    assert method_stats(meta, rows)["auto"].forward_costs == {}
    write_report(out, log=None)
    report = (out / "report.md").read_text()
    assert "## Overall" in report and "| `auto` |" in report and "## Acceptance by draft position" in report
    assert "Draft lengths chosen" not in report and "forward_cost.png" not in report
    assert not (out / "forward_cost.png").exists()


def test_method_kinds_are_data():
    assert method_kind("baseline").baseline and method_kind("baseline").batched
    assert not method_kind("hf_assisted").batched and method_kind("hf_assisted").reference
    assert method_kind("hf_prompt_lookup").compared_with == "prompt_lookup"
    assert method_kind("prompt_lookup") == method_kind("any_registered_plugin")  # drafting, batched, not a reference


def test_default_results_directory(tmp_path):
    assert default_out_dir(tmp_path / "exp" / "a.yaml") == tmp_path / "exp" / "results" / "a"
    assert default_out_dir(tmp_path / "exp" / "configs" / "a.yaml") == tmp_path / "exp" / "results" / "a"
    # the committed configs keep writing where their committed results are
    assert default_out_dir(REPO / "benchmarks" / "configs" / "quick.yaml") == REPO / "benchmarks" / "results" / "quick"
    assert (REPO / "benchmarks" / "results" / "quick" / RUN_FILE).is_file()


def test_results_go_beside_a_config_outside_the_repository(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "experiment"
    folder.mkdir()
    config = tiny_config(folder, methods=TWO_METHODS, generation={"max_new_tokens": 4})
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli.main([str(config), "--no-progress"]) == 0
    expected = folder / "results" / "bench"
    captured = capsys.readouterr()
    assert f"results: {expected}" in captured.err.splitlines()
    assert f"report: {expected / 'report.md'}" in captured.out
    assert (expected / "report.md").is_file() and len(ResultStore(expected / RESULTS_FILE).load()) == TURNS * 2
    assert list(elsewhere.iterdir()) == []


def test_without_matplotlib_the_report_is_written_and_the_run_says_so_first(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib(.pyplot)` raises ImportError
    config = tiny_config(tmp_path, methods=TWO_METHODS, generation={"max_new_tokens": 4})
    out = tmp_path / "out"
    assert cli.main([str(config), "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err.count(PLOTS_NEED_MATPLOTLIB) == 1 and 'pip install "specdec[bench]"' in PLOTS_NEED_MATPLOTLIB
    assert err.index(PLOTS_NEED_MATPLOTLIB) < next(i for i, line in enumerate(err) if line.startswith("loading"))
    report = (out / "report.md").read_text()
    assert "## Overall" in report and "No figures" in report and "## Figures" not in report
    assert not list(out.glob("*.png"))
    (out / "report.md").unlink()
    assert cli.main(["report", str(out)]) == 0
    assert (out / "report.md").read_text() == report
    assert capsys.readouterr().err.splitlines() == [PLOTS_NEED_MATPLOTLIB]


def _interrupted_run(tmp_path: Path, signals: list[int], gap: float = 0.05) -> tuple[subprocess.CompletedProcess, Path]:
    """``specdec bench`` in a subprocess on a long tiny run; once its first row is on disk, send ``signals``
    ``gap`` seconds apart; return the finished process and the output directory."""
    questions = [{"question_id": 1000 + i, "category": "qa", "turns": [f"Question {i}: say it, say it again."]}
                 for i in range(200)]
    config = tiny_config(tmp_path, methods=TWO_METHODS, generation={"max_new_tokens": 8})
    data = yaml.safe_load(config.read_text())
    (tmp_path / "many.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    data["dataset"] = {"path": str(tmp_path / "many.jsonl"), "subtasks": ["qa"]}
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "specdec.bench.cli", str(config), "--out", str(out), "--no-progress"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ResultStore(out / RESULTS_FILE).load() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()
        for i, sig in enumerate(signals):
            if i:
                time.sleep(gap)
            proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), out


def _assert_partial_report(done: subprocess.CompletedProcess, out: Path) -> None:
    assert done.returncode == 130, done.stderr
    rows = ResultStore(out / RESULTS_FILE).load()
    assert 1 <= len(rows) < 400
    report = (out / "report.md").read_text()
    assert f"- Rows: {len(rows)} of 400 " in report and "incomplete run" in report
    assert "| `baseline` |" in report
    assert "interrupted; writing the report" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT, signal.SIGINT]], ids=["sigterm", "sigint-twice"])
def test_interrupted_run_writes_a_partial_report(tmp_path, signals):
    _assert_partial_report(*_interrupted_run(tmp_path, signals))


def test_report_shows_tree_size_and_accepted_depth(tmp_path):
    a = AcceptanceStats(steps=4, drafted_tokens=12, accepted_tokens=5, committed_tokens=9, accepted_at_position=[3, 2],
                        total_seconds=0.5, tree_steps=2, tree_nodes=10, tree_depth=3)
    b = AcceptanceStats(steps=2, drafted_tokens=6, accepted_tokens=2, committed_tokens=4, accepted_at_position=[2],
                        total_seconds=0.2, tree_steps=1, tree_nodes=6, tree_depth=2)
    out = _synthetic_run(tmp_path, [a.as_dict(), b.as_dict(), AcceptanceStats(steps=1).as_dict()])
    write_report(out, log=None)
    section = (out / "report.md").read_text().split("## Token trees", 1)[1].split("\n## ", 1)[0]
    assert "| `auto` | 3 of 6 | 5.33 | 1.67 |" in section  # single rows only (as every section but batches)
