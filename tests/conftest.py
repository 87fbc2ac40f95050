"""The test session: one torch thread, the tests' own weight cache, real models de-quantized in the
background, real-model tests last.

* **Threads.** One intra-op thread by default: tiny models gain nothing from more, and on a 2-core
  machine shared with other work two spinning threads per op were much slower
  (``SPECDEC_TEST_THREADS`` overrides it).
* **Weight cache.** The packaged real models (``real_model`` tests) are GGUF files that take long
  to de-quantize; the tests keep the de-quantized checkpoints in a git-ignored folder of their own,
  ``.test-cache/`` at the repository root (``SPECDEC_TEST_CACHE`` overrides it), never in the
  user's cache. It is passed on as ``SPECDEC_CACHE``, so subprocesses the tests start find it too.
  A fresh clone fills it once; later sessions load in seconds. ``tests/test_cli.py`` tests the
  cache itself in temporary folders.
* **Prefetch.** When the session collects real-model tests whose models are not cached yet, one
  subprocess de-quantizes them into that folder at collection time, on the core the
  single-threaded tests leave idle, and the real-model tests run last: each waits for the
  subprocess before it starts (if it failed, the test's own ``load_model`` reports why).
* **Once per session.** ``smollm2`` and ``gemma3`` are session fixtures: each real model is
  loaded once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))
os.environ["SPECDEC_CACHE"] = os.environ.get("SPECDEC_TEST_CACHE") or str(ROOT / ".test-cache")

#: session fixture -> the packaged model it loads
REAL_MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
#: what the prefetch subprocess runs: load (de-quantize and cache) each model named on its command line
PREFETCH = ("import os, sys, torch; os.nice(5); torch.set_num_threads(1)\n"
            "from specdec import load_model\n"
            "for name in sys.argv[1:]: load_model(name)\n")
_prefetch: subprocess.Popen | None = None


def _is_real(item) -> bool:
    return item.get_closest_marker("real_model") is not None


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by parametrized fixtures
def pytest_collection_modifyitems(session, config, items):
    """Real-model tests last (a stable sort: their order among themselves is kept)."""
    items.sort(key=_is_real)


def _uncached(names: list[str]) -> list[str]:
    """Those of the packaged models ``names`` whose de-quantized weights are not cached yet (and
    whose package is installed: a missing one is the test's to report)."""
    from specdec.models import ModelNotAvailableError, check_model_name, weight_cache_path
    from specdec.weight_cache import is_complete

    missing = []
    for name in names:
        try:
            check_model_name(name)
            folder = weight_cache_path(name)
        except ModelNotAvailableError:
            continue
        if folder is not None and not is_complete(folder):
            missing.append(name)
    return missing


def pytest_collection_finish(session):
    """Start de-quantizing the real models the collected tests need, if any are not cached."""
    global _prefetch
    wanted = [name for fixture, name in REAL_MODELS.items()
              if any(fixture in getattr(item, "fixturenames", ()) for item in session.items if _is_real(item))]
    names = _uncached(wanted) if wanted else []
    if names:
        log = Path(os.environ["SPECDEC_CACHE"]) / "prefetch.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as err:
            _prefetch = subprocess.Popen([sys.executable, "-c", PREFETCH, *names], cwd=ROOT,
                                         stdout=subprocess.DEVNULL, stderr=err)


def wait_for_prefetch() -> None:
    """Block until the prefetch subprocess (if any) has finished."""
    if _prefetch is not None:
        _prefetch.wait()


@pytest.hookimpl(tryfirst=True)  # before the item's fixtures are set up
def pytest_runtest_setup(item):
    if _is_real(item):
        wait_for_prefetch()  # before the test's fixtures load a model the subprocess is still writing


def pytest_sessionfinish(session, exitstatus):
    if _prefetch is not None and _prefetch.poll() is None:  # an interrupted session: stop our subprocess
        _prefetch.terminate()
        _prefetch.wait()


def _load(name: str):
    from specdec import load_model

    wait_for_prefetch()
    return load_model(name)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from its PyPI package (loaded once per test session)."""
    return _load(REAL_MODELS["smollm2"])


@pytest.fixture(scope="session")
def gemma3():
    """Gemma-3-270M (base) from its PyPI package (loaded once per test session)."""
    return _load(REAL_MODELS["gemma3"])


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2):
    """Three real Spec-Bench prompts of 48+ tokens through the chat template."""
    from specdec.prompts import encode_chat, load_questions

    _, tokenizer = smollm2
    questions = load_questions()
    picked = [next(q for q in questions if q["category"] == c) for c in ("summarization", "rag", "coding")]
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
