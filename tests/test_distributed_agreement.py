"""What ranks compare before a call (``specdec/distributed/fingerprint.py``), in one process.

The torchrun launch (tests/test_distributed.py) checks that ranks given different calls are
refused and that failures keep them in step; these check the fingerprint itself, quickly: every
part it covers changes it (processors and their settings, stopping criteria, generator seeds
under sampling, the prompt, model inputs), what differs between processes by nature does not
(object addresses, ``MaxTimeCriteria``'s start time, a generator under greedy decoding), and the
call paths a sharded target takes still decode exactly on a target held whole.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import (LogitsProcessor, MaxLengthCriteria, RepetitionPenaltyLogitsProcessor,
                          SuppressTokensLogitsProcessor)
from transformers.generation.stopping_criteria import MaxTimeCriteria

from specdec.distributed import SOLO, Fingerprint, call_fingerprint
from specdec.distributed.fingerprint import describe, settings_of

IDS = torch.tensor([[5, 6, 7, 8, 5, 6]])


def _fingerprint(**kw) -> Fingerprint:
    args = dict(model_inputs={}, processors=[], criteria=[], generator=None, sampled=False)
    args.update(kw)
    settings = args.pop("settings", (24, "greedy"))
    return call_fingerprint(args.pop("ids", IDS), None, *settings, **args)


class Holds(LogitsProcessor):
    """A user processor holding a setting and an object whose repr carries its address."""

    def __init__(self, token, thing=None):
        self.token, self.thing = token, thing if thing is not None else object()

    def __call__(self, input_ids, scores):
        return scores


def test_every_part_changes_the_fingerprint_and_is_named():
    base = _fingerprint(processors=[RepetitionPenaltyLogitsProcessor(1.5)], criteria=[MaxLengthCriteria(30)])
    changed = {
        "prompt": _fingerprint(ids=IDS + 1, processors=[RepetitionPenaltyLogitsProcessor(1.5)],
                               criteria=[MaxLengthCriteria(30)]),
        "settings": _fingerprint(settings=(25, "greedy"), processors=[RepetitionPenaltyLogitsProcessor(1.5)],
                                 criteria=[MaxLengthCriteria(30)]),
        "logits processors": _fingerprint(processors=[RepetitionPenaltyLogitsProcessor(5.0)],
                                          criteria=[MaxLengthCriteria(30)]),
        "stopping criteria": _fingerprint(processors=[RepetitionPenaltyLogitsProcessor(1.5)],
                                          criteria=[MaxLengthCriteria(31)]),
        "model inputs": _fingerprint(processors=[RepetitionPenaltyLogitsProcessor(1.5)],
                                     criteria=[MaxLengthCriteria(30)], model_inputs={"pixel_values": torch.ones(2, 3)}),
    }
    for part, other in changed.items():
        assert other.value != base.value, part
        assert base.differing([other]) == [part]
    same = _fingerprint(processors=[RepetitionPenaltyLogitsProcessor(1.5)], criteria=[MaxLengthCriteria(30)])
    assert same.value == base.value and base.differing([same]) == []


def test_processors_by_class_and_settings_never_by_address():
    assert settings_of(Holds(5)) == settings_of(Holds(5))  # two objects: no address in the description
    assert "0x" not in repr(settings_of(Holds(5)))
    assert settings_of(Holds(5)) != settings_of(Holds(7))
    suppress = lambda tokens: settings_of(SuppressTokensLogitsProcessor(tokens, device="cpu"))  # noqa: E731
    assert suppress([3, 4]) == suppress([3, 4]) and suppress([3, 4]) != suppress([3, 5])  # a tensor, by its bytes
    big = torch.zeros(1 << 17)
    assert describe(big) == ("tensor", "torch.float32", (1 << 17,))  # past the limit: shape and dtype only
    assert describe(lambda x: x)[0] == "callable" and "0x" not in repr(describe(lambda x: x))


def test_numpy_arrays_enums_and_held_objects_are_described_by_their_values():
    """A processor's settings may sit in a numpy array, an Enum or an object it holds: two calls
    that differ there must not fingerprint alike (one rank's settings would silently give way)."""
    import enum

    import numpy as np

    class Mode(enum.Enum):
        A = 1
        B = 2

    class Knobs:
        def __init__(self, level):
            self.level = level

    assert settings_of(Holds(np.array([1, 2]))) == settings_of(Holds(np.array([1, 2])))
    assert settings_of(Holds(np.array([1, 2]))) != settings_of(Holds(np.array([7, 9])))
    assert settings_of(Holds(Mode.A)) != settings_of(Holds(Mode.B))
    assert settings_of(Holds(Knobs(3))) == settings_of(Holds(Knobs(3)))
    assert settings_of(Holds(Knobs(3))) != settings_of(Holds(Knobs(4)))
    assert "0x" not in repr(settings_of(Holds(Knobs(Knobs(Knobs(3))))))  # past the depth: the class alone


def test_a_criterion_made_at_another_moment_is_the_same_call():
    first = _fingerprint(criteria=[MaxTimeCriteria(3.0)])
    time.sleep(0.01)
    assert _fingerprint(criteria=[MaxTimeCriteria(3.0)]).value == first.value  # its start time is no setting
    assert _fingerprint(criteria=[MaxTimeCriteria(4.0)]).value != first.value


def test_the_generator_counts_under_sampling_only():
    seeded = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731
    sampled = lambda g: _fingerprint(generator=g, sampled=True)  # noqa: E731
    assert sampled(seeded(0)).value == sampled(seeded(0)).value
    assert sampled(seeded(0)).differing([sampled(seeded(1))]) == ["generator state"]
    drawn = seeded(0)
    torch.rand(3, generator=drawn)  # the draws since the seed count too
    assert sampled(drawn).value != sampled(seeded(0)).value
    greedy = lambda g: _fingerprint(generator=g)  # noqa: E731
    assert greedy(seeded(0)).value == greedy(seeded(1)).value == greedy(None).value


def test_a_grammar_is_its_text():
    pytest.importorskip("xgrammar")
    from specdec.grammar import Grammar, GrammarConstraint, compile_grammar
    from specdec.tiny import tiny_random

    target, tokenizer = tiny_random("llama")
    constraint = lambda pattern: GrammarConstraint(  # noqa: E731
        compile_grammar(Grammar.regex(pattern), tokenizer, target.config.vocab_size, []))
    assert settings_of(constraint("[a-z]+")) == settings_of(constraint("[a-z]+"))
    assert settings_of(constraint("[a-z]+")) != settings_of(constraint("[0-9]+"))


def test_one_process_takes_every_decision_in_place():
    assert SOLO.processors("p") == "p" and SOLO.streamer("s") == "s"
    with pytest.raises(RuntimeError, match="held nowhere"):
        SOLO.fail(RuntimeError("held nowhere: raised at once"))


def test_a_target_held_whole_decodes_exactly_through_the_coordinated_paths():
    """generate(), prefill() and custom_generate enter a call's context before their checks; a
    target held whole meets SOLO there: the output is generate()'s, and a check still raises."""
    import specdec
    from specdec import SpecDecoder
    from specdec.tiny import tiny_random

    torch.set_num_threads(1)
    target, _ = tiny_random("llama")
    decoder = SpecDecoder(target, "prompt_lookup")
    expected = target.generate(IDS, max_new_tokens=8, do_sample=False, eos_token_id=None, repetition_penalty=1.3)
    assert decoder.generate(IDS, max_new_tokens=8, eos_token_id=None, repetition_penalty=1.3).sequences.tolist() \
        == expected.tolist()
    assert target.generate(IDS, max_new_tokens=8, do_sample=False, eos_token_id=None, repetition_penalty=1.3,
                           custom_generate=specdec.generate, draft="prompt_lookup").tolist() == expected.tolist()
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        decoder.generate(torch.tensor([[5, 10**6]]), max_new_tokens=8)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        decoder.prefill(torch.tensor([[5, 10**6]]))


def test_broken_groups_stay_refused_until_the_process_starts_new_ones(tmp_path):
    """After an abort every call is refused with a clear error; a process that starts its groups
    again (init_process_group once more) can decode again."""
    import torch.distributed as dist

    from specdec.distributed import DistributedDecodeError, check_usable
    from specdec.distributed import ranks as ranks_module

    assert not dist.is_initialized()
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/first", rank=0, world_size=1)
        ranks_module.mark_broken("a test's abort")
        with pytest.raises(DistributedDecodeError, match="a test's abort"):
            check_usable()
        dist.destroy_process_group()
        with pytest.raises(DistributedDecodeError):  # no groups at all: still refused
            check_usable()
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/second", rank=0, world_size=1)
        check_usable()  # new groups: usable
        assert ranks_module.broken() is None
    finally:
        ranks_module._BROKEN.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
