"""Vision-language targets through ``model.generate(custom_generate=...)``, and prefixes that end in
an image (defects a randomized comparison against ``generate()`` found).

* ``generate()`` passes its pre-encoded media as ``mm_encoder_outputs``, ``{}`` for a prompt
  without an image: a text-only prompt to a vision-language target decodes as ``generate()`` does
  (it was refused as "image inputs given without placeholders");
* with an image, Llava- and Gemma-3-style targets equal ``generate()``; an mRoPE target
  (Qwen2-VL), whose grids ``generate()`` drops with the pixels, is refused naming them (its 3-D
  positions cannot be rebuilt, and the output differed from ``generate()``'s);
* a Qwen2-VL prefix that ends right after its image placeholders, continued by text: the text
  sits after the highest position on every axis, as ``get_rope_index`` over the whole prompt puts
  it (it continued each axis from the prefix's last position);
* a first forward (a late draft's) whose tokens after the prompt hold a placeholder id the target
  wrote prefills the prompt alone with the media (the model counted the id as an image slot);
* a late draft whose batch lost an image row before its first forward: its media, which do not
  split by row, are prefilled first ("Image features and image tokens do not match").
"""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec import SpecDecoder

from test_multimodal import (BLOCK_END, BLOCK_START, FAMILIES, IMAGE, batch_inputs, image_prompt, pixels, tiny_vlm,
                             token_types)

NEW = 12


@pytest.fixture(scope="module")
def targets():
    return {family: tiny_vlm(family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_text_only_prompt_through_custom_generate_equals_generate(targets, family):
    target = targets[family]
    ids = torch.tensor([[5, 17, 99, 5, 17, 99, 5, 17]])
    out = target.generate(ids, max_new_tokens=NEW, do_sample=False, custom_generate=specdec.generate,
                          draft="prompt_lookup")
    assert torch.equal(out, target.generate(ids, max_new_tokens=NEW, do_sample=False))


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_prompt_through_custom_generate(targets, family):
    target = targets[family]
    ids, inputs = image_prompt(family, seed=3)
    call = lambda **more: target.generate(ids, **inputs, max_new_tokens=NEW, do_sample=False, **more)  # noqa: E731
    if family == "qwen2_vl":
        with pytest.raises(ValueError, match="image_grid_thw"):
            call(custom_generate=specdec.generate, draft="prompt_lookup")
        assert torch.equal(SpecDecoder(target, "prompt_lookup").generate(ids, **inputs, max_new_tokens=NEW).sequences,
                           call())
    else:
        assert torch.equal(call(custom_generate=specdec.generate, draft="prompt_lookup"), call())


@pytest.mark.parametrize("draft", [None, "prompt_lookup"])
def test_a_prefix_ending_in_an_image_continued_by_text(targets, draft):
    target = targets["qwen2_vl"]
    prefix_ids = torch.tensor([[11, 22, 33, 44, 55, BLOCK_START] + [IMAGE] * 6])
    full = torch.cat([prefix_ids, torch.tensor([[BLOCK_END, 60, 61, 62, 63, 64, 11, 22]])], 1)
    image = pixels("qwen2_vl", 3)
    reference = target.generate(full, **image, **token_types("qwen2_vl", full), max_new_tokens=NEW, do_sample=False)
    decoder = SpecDecoder(target, draft)
    prefix = decoder.prefill(prefix_ids, **image, **token_types("qwen2_vl", prefix_ids))
    assert torch.equal(decoder.generate(full, prefix=prefix, max_new_tokens=NEW).sequences, reference)


def test_a_first_forward_after_a_written_placeholder_feeds_the_media_with_the_prompt_alone(targets):
    """A vision-language draft asked late feeds the prompt and the committed tokens in its first
    forward; a placeholder id the target wrote among them was counted as an image slot."""
    from specdec.multimodal import PrefillSpec
    from specdec.state import ModelState

    target = targets["qwen2_vl"]
    ids, inputs = image_prompt("qwen2_vl", seed=3)
    lengths = torch.tensor([ids.shape[1]])
    prefill, positions = PrefillSpec.from_call(ids, lengths, inputs).for_model(target)
    written = torch.tensor([[7, IMAGE, 9]])  # committed after the prompt, a placeholder id among them
    late = ModelState(target, ids, lengths, prefill_inputs=prefill, positions=positions)
    late.append(written)
    logits = late.forward(start=late.lengths - 1)  # raised "Image features and image tokens do not match"
    early = ModelState(target, ids, lengths, prefill_inputs=prefill, positions=positions)
    early.forward(start=early.lengths - 1)
    early.append(written)
    assert torch.allclose(logits, early.forward(start=early.lengths - 1), atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_late_draft_whose_batch_lost_an_image_row_prefills_its_media_first(targets, family):
    """Rows leave the batch once finished; a vision-language draft asked only after that fed its
    first forward the remaining rows with every row's media (a timing-dependent crash the policy's
    first steps decided). Its logits for the rows kept are those of a draft that prefilled early."""
    from specdec.multimodal import PrefillSpec
    from specdec.state import ModelState

    model = targets[family]
    ids, mask, inputs = batch_inputs(family, [image_prompt(family, seed=s) for s in (3, 4, 5)])
    lengths = mask.sum(1)
    rows = torch.stack([torch.cat([r[m.bool()], r[~m.bool()]]) for r, m in zip(ids, mask)])  # from column 0
    prefill, positions = PrefillSpec.from_call(rows, lengths, inputs).for_model(model)
    kept = torch.tensor([0, 2])
    written = torch.tensor([[7, 8], [9, 10]])  # what the kept rows committed meanwhile
    late = ModelState(model, rows, lengths, prefill_inputs=prefill, positions=positions)
    late.select_rows(kept)  # its first forward still to come
    late.append(written)
    early = ModelState(model, rows, lengths, prefill_inputs=prefill, positions=positions)
    early.forward(start=early.lengths - 1)
    early.select_rows(kept)
    early.append(written)
    logits = late.forward(start=late.lengths - 2)  # raised "Image features and image tokens do not match"
    assert logits.shape[:2] == (2, 2)
    assert torch.allclose(logits, early.forward(start=early.lengths - 2), atol=1e-5)
