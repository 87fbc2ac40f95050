import os

import pytest
import torch

# One intra-op thread by default: tiny models gain nothing from more, and on a 2-core machine
# shared with other work two spinning threads per op were measured up to 10x slower.
# SPECDEC_TEST_THREADS overrides it.
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))
# Tests load the packaged models from their GGUF files and write nothing into the user's cache;
# tests/test_cli.py tests the weight cache in temporary folders.
os.environ.setdefault("SPECDEC_NO_WEIGHT_CACHE", "1")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from its PyPI package (loaded once per test session)."""
    from specdec import load_model

    return load_model("smollm2-135m")


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
