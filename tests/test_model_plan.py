"""One plan per model (``specdec.model_plan``): every decision and measurement kept for a model is a
field of its plan, shared by the model's decoders, forgotten at once, never keeping the model alive."""

from __future__ import annotations

import gc
import weakref

import torch

from specdec import SpecDecoder
from specdec.compiled import agrees, checked, miscompiled
from specdec.engines import engine_report
from specdec.engines.forwards.direct import DirectForward
from specdec.engines.forwards.head import FastHead
from specdec.engines.forwards.packed import PackedLinears
from specdec.model_plan import UNDECIDED, plan_of, planned
from specdec.models import tiny_random
from specdec.policy.costs import CostModel
from specdec.policy.memory import DraftingMemory

from helpers import TINY_COSTS, pin_costs, repetitive_prompt


def test_each_decision_and_measurement_is_a_field_of_the_one_plan():
    model = tiny_random("llama", seed=21)[0]
    assert planned(model) is None  # reading makes none
    plan = plan_of(model)
    assert plan_of(model) is plan and planned(model) is plan
    assert plan.direct is UNDECIDED and plan.head is UNDECIDED and plan.packed is None

    direct = DirectForward.pin(model, True)
    FastHead.pin(model, False)
    packed = PackedLinears.pin(model, False)
    costs = CostModel(list(TINY_COSTS))
    CostModel.pin(model, costs)
    DraftingMemory.learn(model, 0.25)
    logits = torch.zeros(1, 2, 5)
    logits[..., 0] = 1.0
    assert agrees(model, (2, 64), logits, logits)
    assert (plan.direct, plan.head, plan.packed) == (direct, None, packed) and direct is not None
    assert list(plan.costs.values()) == [costs] and DraftingMemory.share(model) == 0.25
    assert checked(model, (2, 64)) and not miscompiled(model)
    report = engine_report(model, "auto")
    assert "scripted Llama stack used" in report and "fast output layer not used" in report

    plan.forget()  # everything decided and measured again at the next use
    assert plan.direct is UNDECIDED and plan.head is UNDECIDED and plan.packed is None
    assert plan.costs == {} and DraftingMemory.share(model) is None and not checked(model, (2, 64))
    assert "not decided yet" in engine_report(model, "auto")


def test_two_decoders_of_one_model_share_its_plan_and_its_packed_weights():
    target = pin_costs(tiny_random("llama", seed=22)[0])
    ids = repetitive_prompt(16, seed=22)
    SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=4)
    state = plan_of(target).packed
    assert state is not None and state.calls == 1
    SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=4)  # another decoder, the same model
    assert plan_of(target).packed is state and state.calls == 2  # counted once per call, on one state


def test_a_plan_does_not_keep_its_model_alive():
    model = tiny_random("llama", seed=23)[0]
    DirectForward.pin(model, True)
    FastHead.pin(model, True)
    pin_costs(model)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
