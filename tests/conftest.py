"""The test session: one torch thread, the tests' own weight cache, two processes, a prefetch.

* **Threads.** One intra-op thread by default: tiny models gain nothing from more, and on a 2-core
  machine shared with other work two spinning threads per op were much slower
  (``SPECDEC_TEST_THREADS`` overrides it).
* **Weight cache.** The packaged real models (``real_model`` tests) are GGUF files that take long
  to de-quantize; the tests keep the de-quantized checkpoints in a git-ignored folder of their own,
  ``.test-cache/`` at the repository root (``SPECDEC_TEST_CACHE`` overrides it), never in the
  user's cache. It is passed on as ``SPECDEC_CACHE``, so subprocesses the tests start find it too.
  A fresh clone fills it once; later sessions load in seconds. ``tests/test_cli.py`` tests the
  cache itself in temporary folders. ``smollm2`` and ``gemma3`` are session fixtures: each real
  model is loaded once per process.
* **Two processes.** The tests are single-threaded, so on a machine of two or more cores the
  session runs the long tests that depend on nothing else (the real-model tests, the modules that
  compile, those using ``fresh_dynamo``, and the modules marked ``split_second``, chosen so that
  both processes end at about the same time) in a second pytest process, while this one runs the
  rest. The second process starts with the session, on the same arguments, and collects while
  this one does; it runs nothing until this one, once collected, hands it the ids of its tests
  (or stops it). They are ordered last here, and when this process reaches them it reports what
  the second one reported (pytest's own report serialization), so selection, ``-x``,
  ``--durations`` and the exit status work as in one process. ``SPECDEC_TEST_PROCESSES=1`` runs
  everything in this process (as do a one-core machine, ``-s``, ``--pdb`` and ``--trace``, and a
  selection with nothing, or nothing but, for the second process).
* **Allocator.** Under glibc, freed blocks are kept for reuse (``mallopt``: blocks up to 32 MiB
  from the heap, which is trimmed only past 1 GiB free): the sampling tests allocate and free the
  same tensors of 20,000 rows many times, and by default each of those came back as fresh pages
  the kernel had to zero (a fifth of their time, in system time). Only the test processes do this;
  specdec leaves its users' allocator alone.
* **Bytecode.** The session writes compiled bytecode (``__pycache__``, git-ignored) even where
  ``PYTHONDONTWRITEBYTECODE`` is set, for itself and the processes it starts: otherwise every
  process compiles specdec's modules and rewrites the test modules' assertions anew (about 6 s a
  process on 2 cores).
* **Prefetch.** When the process that runs the real-model tests finds their models not cached
  yet, it starts one more subprocess at collection that de-quantizes them into that folder while
  the other tests run; the real-model tests run last and each waits for it before it starts (if
  it failed, the test's own ``load_model`` reports why).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from pytest import TestReport

ROOT = Path(__file__).resolve().parent.parent


def _keep_freed_memory() -> None:
    """glibc's ``mallopt``: serve blocks up to 32 MiB from the heap and trim it only past 1 GiB free
    (the module docstring's "Allocator"); nothing where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 1 << 30)
    mallopt(m_top_pad, 256 << 20)


_keep_freed_memory()
sys.dont_write_bytecode = False  # the module docstring's "Bytecode"
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))
os.environ["SPECDEC_CACHE"] = os.environ.get("SPECDEC_TEST_CACHE") or str(ROOT / ".test-cache")
# every host value a step computes for itself is compared with the tensor it describes (specdec/host.py)
os.environ.setdefault("SPECDEC_CHECK_HOST", "1")

#: set in the second process: the file it writes its reports to (one JSON object a line)
REPORTS_ENV = "SPECDEC_TEST_REPORTS"
#: "1": run every test in this process
PROCESSES_ENV = "SPECDEC_TEST_PROCESSES"
#: the file, beside the reports, in which the first process hands the second its tests (JSON)
HANDED = "handed.json"
#: session fixture -> the packaged model it loads
REAL_MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
#: what the prefetch subprocess runs: load (de-quantize and cache) each model named on its command line
PREFETCH = ("import sys, torch; torch.set_num_threads(1)\n"
            "from specdec import load_model\n"
            "for name in sys.argv[1:]: load_model(name)\n")


class _Session:
    """This process's helpers: the second test process (its tests, their reports once it has
    ended, its folder) and the prefetch subprocess."""

    config: pytest.Config | None = None
    second: subprocess.Popen | None = None
    folder: Path | None = None
    second_ids: set[str] = set()
    handed: bool = False
    reports: dict[str, list[TestReport]] | None = None
    prefetch: subprocess.Popen | None = None


def _is_real(item) -> bool:
    return item.get_closest_marker("real_model") is not None


def _goes_second(item) -> bool:
    """Long, and independent of the other modules: a real model, a module that compiles, or one
    marked ``split_second``."""
    return (_is_real(item) or "fresh_dynamo" in getattr(item, "fixturenames", ())
            or item.get_closest_marker("split_second") is not None)


def pytest_configure(config):
    _Session.config = config


def pytest_sessionstart(session):
    if _may_split(session.config):
        _start_second(session.config)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (parametrized fixtures) and deselection
def pytest_collection_modifyitems(session, config, items):
    """Real-model tests last; in a split session, everything the second process runs last
    (stable sorts: the order among those is kept), and the second process told which those are.
    In the second process, only those are kept. Then start the prefetch where it is needed."""
    items.sort(key=_is_real)
    if os.environ.get(REPORTS_ENV):
        _keep_only_handed(config, items)
    elif _Session.second is not None:
        second = [item for item in items if _goes_second(item)]
        split = 0 < len(second) < len(items)
        _hand_over(second if split else None)
        if split:
            items.sort(key=_goes_second)
            return
    if not config.option.collectonly:
        _start_prefetch([item for item in items if _is_real(item)])


def pytest_sessionfinish(session, exitstatus):
    if _Session.second is not None and not _Session.handed:
        _hand_over(None)  # collection failed or was interrupted: nothing to hand over
    for process in (_Session.second, _Session.prefetch):
        if process is not None and process.poll() is None:  # stopped early (-x, Ctrl-C)
            process.terminate()
            process.wait()
    if _Session.folder is not None:
        shutil.rmtree(_Session.folder, ignore_errors=True)


# -- the second process ------------------------------------------------------------------------
def _may_split(config) -> bool:
    """Whether this session may run some tests in a second process: not in the second process
    itself, on one core, when asked not to, when only collecting, or when a test's output or
    debugger is wanted here (``-s``, ``--pdb``, ``--trace``)."""
    if os.environ.get(REPORTS_ENV) or os.environ.get(PROCESSES_ENV) == "1" or (os.cpu_count() or 1) < 2:
        return False
    if config.option.collectonly or config.getvalue("capture") == "no":
        return False
    return not (config.getvalue("usepdb") or config.getvalue("trace"))


def _start_second(config) -> None:
    """The second process, on this session's arguments (with a cache folder of its own, if the
    cache is on): it collects while this one does."""
    _Session.folder = Path(tempfile.mkdtemp(prefix="specdec-tests-"))
    env = {**os.environ, REPORTS_ENV: str(_Session.folder / "reports.jsonl")}
    own_cache = ["-o", f"cache_dir={_Session.folder / 'cache'}"] if config.pluginmanager.has_plugin("cacheprovider") else []
    command = [sys.executable, "-m", "pytest", *config.invocation_params.args, *own_cache]
    with open(_Session.folder / "output.log", "w") as log:
        _Session.second = subprocess.Popen(command, cwd=config.invocation_params.dir, env=env, stdout=log,
                                           stderr=subprocess.STDOUT)


def _hand_over(items) -> None:
    """Hand the second process the tests ``items`` (it waits for them); or, with None, stop it."""
    _Session.handed = True
    if items is None:
        _Session.second.terminate()  # it has started nothing before it is handed its tests
        _Session.second.wait()
        return
    _Session.second_ids = {item.nodeid for item in items}
    handed = _Session.folder / HANDED
    handed.with_suffix(".tmp").write_text(json.dumps(sorted(_Session.second_ids)))
    handed.with_suffix(".tmp").replace(handed)  # whole, or not there


def _keep_only_handed(config, items) -> None:
    """In the second process: wait for the tests the first one hands over, and keep only those."""
    handed, parent = Path(os.environ[REPORTS_ENV]).with_name(HANDED), os.getppid()
    while not handed.is_file():
        if os.getppid() != parent:  # the first process is gone
            pytest.exit("the first test process ended before it handed over any test", returncode=1)
        time.sleep(0.02)
    wanted = set(json.loads(handed.read_text()))
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
    items[:] = [item for item in items if item.nodeid in wanted]


def pytest_runtest_logreport(report):
    """In the second process: write each report for the first one."""
    path = os.environ.get(REPORTS_ENV)
    if path:
        config = _Session.config
        with open(path, "a") as out:
            out.write(json.dumps(config.hook.pytest_report_to_serializable(config=config, report=report)) + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """A test of the second process: report what it reported, instead of running it here."""
    if item.nodeid not in _Session.second_ids:
        return None
    reports = _second_reports(item.config).get(item.nodeid, [])
    if not reports or reports[-1].when != "teardown":  # the second process died before it finished the test
        reports = [*reports, _unfinished(item)]
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _second_reports(config) -> dict[str, list[TestReport]]:
    """The second process's reports by test id, once it has ended."""
    if _Session.reports is None:
        _Session.second.wait()
        path, reports = _Session.folder / "reports.jsonl", {}
        for line in path.read_text().splitlines() if path.is_file() else []:
            report = config.hook.pytest_report_from_serializable(config=config, data=json.loads(line))
            reports.setdefault(report.nodeid, []).append(report)
        _Session.reports = reports
    return _Session.reports


def _unfinished(item) -> TestReport:
    """A failure for a test the second process did not finish (it crashed, say)."""
    output = (_Session.folder / "output.log").read_text(errors="replace")[-4000:]
    return TestReport(item.nodeid, item.location, {}, "failed", when="call",
                      longrepr=f"the second test process (exit status {_Session.second.returncode}) did not "
                               f"finish this test; its output ends with:\n{output}")


# -- the prefetch ------------------------------------------------------------------------------
def _start_prefetch(real_items) -> None:
    """De-quantize the real models ``real_items`` need that are not cached yet, in a subprocess."""
    wanted = [name for fixture, name in REAL_MODELS.items()
              if any(fixture in getattr(item, "fixturenames", ()) for item in real_items)]
    names = _uncached(wanted)
    if names:
        log = Path(os.environ["SPECDEC_CACHE"]) / "prefetch.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as err:
            _Session.prefetch = subprocess.Popen([sys.executable, "-c", PREFETCH, *names], cwd=ROOT,
                                                 stdout=subprocess.DEVNULL, stderr=err)


def _uncached(names: list[str]) -> list[str]:
    """Those of the packaged models ``names`` whose de-quantized weights are not cached yet (and
    whose package is installed: a missing one is the test's to report)."""
    from specdec.models import check_model_name, weight_cache_path
    from specdec.weight_cache import is_complete

    missing = []
    for name in names:
        try:
            check_model_name(name)
            folder = weight_cache_path(name)
        except Exception:  # noqa: BLE001 - a model that cannot be located is its tests' to report
            continue
        if folder is not None and not is_complete(folder):
            missing.append(name)
    return missing


@pytest.hookimpl(tryfirst=True)  # before the item's fixtures are set up
def pytest_runtest_setup(item):
    if _is_real(item) and _Session.prefetch is not None:
        _Session.prefetch.wait()  # before the test's fixtures load a model the subprocess is still writing


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pairs():
    """arch -> (target, draft, tokenizer) of a tiny architecture (``helpers.tiny_pair``), each built on
    first use and kept for the module."""
    from helpers import tiny_pair

    built = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = tiny_pair(arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from its PyPI package (loaded once per test process)."""
    from specdec import load_model

    return load_model(REAL_MODELS["smollm2"])


@pytest.fixture(scope="session")
def gemma3():
    """Gemma-3-270M (base) from its PyPI package (loaded once per test process)."""
    from specdec import load_model

    return load_model(REAL_MODELS["gemma3"])


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2):
    """Three real Spec-Bench prompts of 48+ tokens through the chat template: the shortest
    summarization question (193 tokens; the first is 769, and every real-model test prefills each
    prompt), the first extraction question (210: a document to copy from, as rag's, which are 650+)
    and the first coding question (56)."""
    from specdec.prompts import encode_chat, load_questions

    _, tokenizer = smollm2
    questions = load_questions()
    picked = [min((q for q in questions if q["category"] == "summarization"), key=lambda q: len(q["turns"][0]))]
    picked += [next(q for q in questions if q["category"] == c) for c in ("extraction", "coding")]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in picked]
    assert all(p.shape[1] >= 48 for p in prompts)
    return prompts


@pytest.fixture(scope="module")
def fresh_dynamo():
    """Start a compiling test module from an empty dynamo cache: earlier modules compile the same
    model classes with other backends (the bench and CLI tests), and dynamo's per-process state
    must not leak in (seen as "fullgraph=True found no compiled frames")."""
    torch._dynamo.reset()
    yield
