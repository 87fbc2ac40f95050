"""The residual-stream rotation of a ``self_draft`` copy (``specdec/engines/forwards/rotation.py``).

Rotated in full precision the copy computes the target's logits (norm scales folded, weights
rotated, head untied); layouts it does not know are left alone; a copy whose rotated logits differ
is dropped for a plain one; and with an outlier channel in the residual stream, the rotated w8a8
copy is closer to the target than the unrotated one (the reason it exists)."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec.engines.forwards.int8 import quantize_linears
from specdec.engines.forwards.lowbit import build_copy
from specdec.engines.forwards.rotation import kron_orthogonal, rotatable, rotate_residual
from specdec.models import tiny_random


def with_scaled_norms(model, seed: int = 0):
    """``model`` with random norm scales (a fresh model's are all one, which folding would not test)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.arange(3, 40, 3)[None, :]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("tied", [False, True])
def test_a_rotated_copy_computes_the_targets_logits(arch, tied):
    target = with_scaled_norms(tiny_random(arch, seed=3, tie_word_embeddings=tied)[0])
    before = {k: v.clone() for k, v in target.state_dict().items()}
    draft = copy.deepcopy(target)
    assert rotatable(draft) is None
    assert rotate_residual(draft, reference=target)
    torch.testing.assert_close(logits(draft, IDS), logits(target, IDS), rtol=1e-4, atol=1e-4)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # the target is only read
    assert draft.get_output_embeddings().weight.data_ptr() != draft.get_input_embeddings().weight.data_ptr()
    assert not torch.allclose(draft.get_input_embeddings().weight, target.get_input_embeddings().weight)
    folded = [p for n, p in draft.named_parameters() if n.endswith(("layernorm.weight", "model.norm.weight"))]
    assert len(folded) == 2 * len(draft.model.layers) + 1 and all(bool((p == 1).all()) for p in folded)


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt2", "phi3"])
def test_other_layouts_are_left_alone(arch):
    model = tiny_random(arch, seed=3)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert rotatable(model) is not None
    assert not rotate_residual(model, reference=copy.deepcopy(model))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_copy_that_fails_the_check_is_replaced_by_a_plain_one(monkeypatch):
    target = with_scaled_norms(tiny_random("llama", seed=3)[0])
    norm_type = type(target.model.norm)
    plain = norm_type.forward
    monkeypatch.setattr(norm_type, "forward", lambda self, x: plain(self, x) + 0.1)  # no longer rotation-equivariant
    assert rotatable(target) is None
    assert not rotate_residual(copy.deepcopy(target), reference=target)
    draft = build_copy(target, "w8a8")
    torch.testing.assert_close(draft.get_input_embeddings().weight, target.get_input_embeddings().weight)


def test_the_rotation_helps_quantize_a_residual_stream_with_an_outlier_channel():
    target = with_scaled_norms(tiny_random("llama", seed=5, hidden_size=128, intermediate_size=256)[0])
    with torch.no_grad():
        target.get_input_embeddings().weight[:, 7] *= 40.0  # one channel far larger than the rest
    want = logits(target, IDS)
    plain = quantize_linears(copy.deepcopy(target))
    rotated = copy.deepcopy(target)
    assert rotate_residual(rotated, reference=target)
    quantize_linears(rotated)
    error = {name: float((logits(m, IDS) - want).norm() / want.norm()) for name, m in (("plain", plain), ("rotated", rotated))}
    assert error["rotated"] < 0.85 * error["plain"], error  # 0.68x here; 0.67x-0.79x over seeds 0-5
    assert build_copy(target, "w8a8").get_input_embeddings().weight[0, 7] != target.get_input_embeddings().weight[0, 7]


@pytest.mark.parametrize("size", [576, 64, 7, 1])
def test_the_rotation_is_orthogonal(size):
    a, b = kron_orthogonal(size, seed=1)
    assert a.shape[0] * b.shape[0] == size and a.shape[0] <= b.shape[0]
    q = torch.kron(a.double(), b.double())
    torch.testing.assert_close(q @ q.T, torch.eye(size, dtype=torch.float64), rtol=0, atol=1e-5)



def test_rotating_in_chunks_of_rows_is_rotating_whole(monkeypatch):
    """Large weights are rotated a few rows at a time (``CHUNK_ROWS``): the product over the whole
    weight, up to rounding (the norm's scale folded in), into ``out`` or in place."""
    from specdec.engines.forwards import rotation

    a, b = kron_orthogonal(12)
    weight = torch.randn(10, 12, generator=torch.Generator().manual_seed(0))
    scale = torch.rand(12, generator=torch.Generator().manual_seed(1)) + 0.5
    whole = lambda w: torch.matmul(torch.matmul(a.T, w.reshape(10, a.shape[0], b.shape[0])), b).reshape(10, 12)  # noqa: E731
    monkeypatch.setattr(rotation, "CHUNK_ROWS", 3)
    out = rotation.rotate_columns(weight, a, b, scale, torch.empty_like(weight))
    torch.testing.assert_close(out, whole(weight * scale[None, :]))
    torch.testing.assert_close(out, (weight * scale[None, :]) @ torch.kron(a, b))  # the rotation it stands for
    want = whole(weight)
    assert rotation.rotate_columns(weight, a, b) is weight
    torch.testing.assert_close(weight, want)
