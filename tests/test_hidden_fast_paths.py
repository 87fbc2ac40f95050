"""Hidden states asked by a generator (``DraftingInfo.hidden_layers``) come from the fast paths.

A causal target forward that keeps hidden states runs where one that does not would
(``specdec/engines/forwards/head.py`` ``model_logits``): the scripted decoder stack
(``specdec/engines/forwards/direct.py``), the model with the fast output layer, or the model's own call;
never the eager engine's. Whichever runs, the states a generator hears (``feedback.hidden``) are
``model(seq, output_hidden_states=True).hidden_states[i]`` of the committed sequence (index 0 the
embeddings, the last one after the final norm), greedy output stays ``generate``'s, and a
compiled static cache runs such forwards uncompiled."""

from __future__ import annotations

import pytest
import torch
from helpers import left_pad, reference

from specdec import SpecDecoder
from specdec.kv import new_dynamic_cache
from specdec.engines import EagerEngine
from specdec.engines.forwards.direct import DirectForward
from specdec.engines.forwards.stack import scripted_layers
from specdec.engines.forwards.head import FastHead, model_logits
from specdec.generators import CandidateGenerator, DraftingInfo, Proposal
from specdec.growing import GrowingLayer
from specdec.tiny import tiny_random

NEW_TOKENS = 12


@pytest.fixture
def target():
    """A tiny Llama of three layers (so that a state asked and its neighbours differ), its direct
    forward and fast head decided by each test (forgotten after)."""
    model, _ = tiny_random("llama", seed=3, num_hidden_layers=3)
    yield model.eval()
    DirectForward.forget(model)
    FastHead.forget(model)


@pytest.fixture
def calls(monkeypatch):
    """Counts of the direct forwards that kept hidden states, and of the eager engine's forwards."""
    counts = {"direct": 0, "eager": 0}
    direct_call, eager_forward = DirectForward.__call__, EagerEngine.forward

    def direct(self, kwargs, head, packed=False, tensors=None, hidden_layers=()):
        counts["direct"] += bool(hidden_layers)
        return direct_call(self, kwargs, head, packed, tensors, hidden_layers)

    def eager(self, *args, **kwargs):
        counts["eager"] += 1
        return eager_forward(self, *args, **kwargs)

    monkeypatch.setattr(DirectForward, "__call__", direct)
    monkeypatch.setattr(EagerEngine, "forward", eager)
    return counts


def layers_of(model) -> tuple[int, ...]:
    """The embeddings, the first layer's output and the last (after the final norm): not every
    state, so that one taken a layer early or late is told apart."""
    return (0, 1, model.config.num_hidden_layers)


class Recorder(CandidateGenerator):
    """Drafts a fixed block (sometimes right) and keeps every step's ``feedback.hidden`` in ``seen``
    (a list given to the constructor: each call's session is built again from its arguments)."""

    name = "recorder"

    def __init__(self, layers: tuple[int, ...], seen: list | None = None):
        self.layers, self.seen = layers, seen if seen is not None else []

    def drafting(self):
        return DraftingInfo(max_drafts=None, hidden_layers=self.layers)

    def propose(self, ctx, max_drafts):
        return Proposal.from_rows([[7, 8, 9]] * ctx.batch_size)

    def observe(self, ctx, feedback):
        self.seen.append(feedback.hidden)


def check_heard(model, recorder: Recorder, rows: list[torch.Tensor]) -> None:
    """Each row's hidden states, as the generator heard them, are the model's own over the row's
    greedy sequence, and every committed token but the newest was reported."""
    for b, row in enumerate(rows):
        sequence = reference(model, row[None], NEW_TOKENS)  # [1, P+N]
        assert sequence.shape[1] == row.numel() + NEW_TOKENS, "a row stopped early: pick another prompt"
        with torch.no_grad():
            full = model(sequence, output_hidden_states=True).hidden_states
        covered = set()
        for hidden in recorder.seen:
            assert set(hidden.states) == set(recorder.layers)
            for j in range(int(hidden.count[b])):
                position = int(hidden.start[b]) + j
                covered.add(position)
                for layer in recorder.layers:
                    torch.testing.assert_close(hidden.states[layer][b, j], full[layer][0, position],
                                               atol=1e-5, rtol=1e-5, msg=f"row {b}, layer {layer}, token {position}")
        assert covered == set(range(sequence.shape[1] - 1)), b


def prompt_rows(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 250, (n,), generator=g) % vocab for n in (9, 5)]


@pytest.mark.parametrize("batch", [1, 2])
def test_the_direct_forward_serves_hidden_states_as_the_model_computes_them(target, calls, batch):
    assert scripted_layers() is not None  # the scripted stack, not its Python fallback, is what runs
    assert DirectForward.pin(target, True) is not None
    rows = prompt_rows(target.config.vocab_size)[:batch]
    padded, mask = left_pad(rows, pad_id=257)  # the second row left-padded by four
    recorder = Recorder(layers_of(target), [])
    out = SpecDecoder(target, recorder).generate(padded, mask, max_new_tokens=NEW_TOKENS)
    for b, row in enumerate(rows):
        want = reference(target, row[None], NEW_TOKENS)[0, row.numel():]
        assert torch.equal(out.sequences[b, padded.shape[1]:], want), b
    check_heard(target, recorder, rows)
    steps = len(recorder.seen)
    assert calls["direct"] >= steps - 1  # every verification (the prefill may be the model's own)
    assert calls["eager"] == 0


@pytest.mark.parametrize("fast_head", [True, False])
def test_a_static_cache_keeps_hidden_states_through_the_models_call(target, calls, fast_head):
    """A static cache is not the direct forward's: the model runs, with the fast output layer or its
    own, and the states are the same."""
    DirectForward.pin(target, True)
    FastHead.pin(target, fast_head)
    head_calls = []
    original = FastHead.__call__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FastHead, "__call__", lambda self, hidden: head_calls.append(1) or original(self, hidden))
        rows = prompt_rows(target.config.vocab_size)
        padded, mask = left_pad(rows, pad_id=257)
        recorder = Recorder(layers_of(target), [])
        out = SpecDecoder(target, recorder, cache_implementation="static").generate(padded, mask,
                                                                                     max_new_tokens=NEW_TOKENS)
    for b, row in enumerate(rows):
        assert torch.equal(out.sequences[b, padded.shape[1]:], reference(target, row[None], NEW_TOKENS)[0, row.numel():])
    check_heard(target, recorder, rows)
    assert calls == {"direct": 0, "eager": 0}
    assert bool(head_calls) == fast_head


def test_a_compiled_static_cache_runs_forwards_that_keep_hidden_states_uncompiled(target, calls, monkeypatch):
    from specdec import kv

    def never(model, options, owned=False):
        def compiled(*args, **kwargs):
            raise AssertionError("a compiled graph ran a forward that keeps hidden states")
        return compiled

    monkeypatch.setattr(kv, "compiled_forward", never)
    row = prompt_rows(target.config.vocab_size)[0]
    recorder = Recorder(layers_of(target), [])
    out = SpecDecoder(target, recorder, cache_implementation="static", compile=True).generate(
        row[None], max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, reference(target, row[None], NEW_TOKENS))
    check_heard(target, recorder, [row])
    assert calls["eager"] == 0


def test_model_logits_gives_each_path_the_same_states(target):
    """``model_logits`` with ``hidden_layers``: (logits, states) from the direct forward, the fast
    head and the model's own call alike, every fed column; without them, the logits alone."""
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    count = target.config.num_hidden_layers
    asked = (count, 0, -1, 1)  # any order, a negative index as a tuple takes it
    with torch.no_grad():
        full = target(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    results = {}
    for name, (direct, head, own) in {"direct": (True, False, False), "fast head": (False, True, False),
                                      "plain": (False, False, False), "own": (False, False, True)}.items():
        DirectForward.pin(target, direct)
        FastHead.pin(target, head)
        cache = new_dynamic_cache()
        with torch.no_grad():
            target.forward(input_ids=ids[:, :8], attention_mask=mask[:, :8], position_ids=positions[:, :8],
                           cache=cache, use_cache=True)
            kwargs = {"input_ids": ids[:, 8:], "position_ids": positions[:, 8:], "past_key_values": cache,
                      "use_cache": True, "attention_mask": mask, "logits_to_keep": 1}
            if direct:
                assert DirectForward.of(target).serves(target, kwargs, direct=False)
            logits, states = model_logits(target, dict(kwargs), own=own, hidden_layers=asked)
        assert logits.shape == (2, 1, target.config.vocab_size), name
        assert list(states) == list(asked), name
        for index in asked:
            assert states[index].shape == (2, 4, target.config.hidden_size), (name, index)
            torch.testing.assert_close(states[index], full.hidden_states[index][:, 8:], atol=1e-5, rtol=1e-5,
                                       msg=f"{name}: hidden state {index}")
            assert not states[index].is_inference(), (name, index)
        torch.testing.assert_close(logits, full.logits[:, -1:], atol=1e-4, rtol=1e-4, msg=name)
        results[name] = logits
    # asking for nothing returns the logits alone, as before
    DirectForward.pin(target, True)
    cache = new_dynamic_cache()
    with torch.no_grad():
        target.forward(input_ids=ids[:, :8], attention_mask=mask[:, :8], position_ids=positions[:, :8],
                       cache=cache, use_cache=True)
        plain = model_logits(target, {"input_ids": ids[:, 8:], "position_ids": positions[:, 8:],
                                      "past_key_values": cache, "use_cache": True, "attention_mask": mask,
                                      "logits_to_keep": 1})
    assert isinstance(plain, torch.Tensor)
    torch.testing.assert_close(plain, results["direct"], atol=1e-6, rtol=1e-6)


def test_the_stack_keeps_nothing_unless_asked():
    """The stack's capture (``LlamaStack.forward``): the input, each layer's input and the last layer's output (the
    final norm is the caller's), in order; an empty capture keeps nothing."""
    model, _ = tiny_random("llama", seed=5, num_hidden_layers=3)
    forward = DirectForward.pin(model, True)
    assert forward is not None
    ids = torch.randint(0, 250, (1, 6), generator=torch.Generator().manual_seed(2))
    count = model.config.num_hidden_layers
    try:
        with torch.no_grad():
            own = model(ids, output_hidden_states=True).hidden_states
            hidden = model.model.embed_tokens(ids)
            stack = forward.stack
            like = hidden.new_empty(1, stack.kv_heads, 6, stack.head_dim)
            for capture in ([], [1], [0, 2, count], list(range(count + 1))):
                buffers = [GrowingLayer(0).reserve(like, 6) for _ in range(count)]  # causal: no mask given
                last, captured = stack(hidden, torch.arange(6)[None], [k for k, _ in buffers],
                                       [v for _, v in buffers], 0, capture=capture)
                assert len(captured) == len(capture)
                for index, state in zip(capture, captured):
                    got = model.model.norm(state) if index == count else state
                    torch.testing.assert_close(got, own[index], atol=1e-5, rtol=1e-5, msg=f"index {index}")
                if 0 in capture:
                    assert captured[0] is hidden  # the input itself: nothing copied
                if count in capture:
                    assert captured[-1] is last  # the last layer's output, before the final norm
    finally:
        DirectForward.forget(model)
