"""Vision-language targets and drafts: prefill-only inputs reach each model exactly once (issue 3).

Three families, built as tiny random models from their ``transformers`` configs (no download),
sharing the byte-level test tokenizer of ``specdec.models`` (ids 0-255 bytes, 256 <eos>, 257
<pad>, vocabulary 320, image placeholders at 300+):

* ``llava``: LlavaForConditionalGeneration (CLIP tower, Llama text); 16 image tokens in the prompt;
* ``qwen2_vl``: Qwen2VLForConditionalGeneration; a 4x6 patch grid merged to 2x3 = 6 image tokens;
  3-D mRoPE positions, ``image_grid_thw`` and ``mm_token_type_ids`` (and Qwen2.5-VL in one test);
* ``gemma3``: Gemma3ForConditionalGeneration (SigLIP tower, sliding-window text layers); 16 image
  tokens; ``token_type_ids`` drive the bidirectional image mask.

Drafts: (a) ``vlm``: a perturbed copy of the target (it sees the image); (b) ``text``: a text-only
model of the matching text architecture sharing the vocabulary; (c) ``prompt_lookup``.
Run with ``-s`` to see the acceptance each case measures (docs/multimodal.md quotes them).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (AutoModelForCausalLM, CLIPVisionConfig, DynamicCache, Gemma3Config, Gemma3ForConditionalGeneration, LlamaConfig,
                          LlavaConfig, LlavaForConditionalGeneration, Qwen2Config, Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                          SiglipVisionConfig)
from transformers.models.gemma3 import Gemma3TextConfig

from candidate_generators.prompt_lookup import lookup
from specdec import SpecDecoder
from specdec.models import tiny_random
from specdec.multimodal import Prefix
from specdec.sampling import SamplingParams

from helpers import ForwardRecorder, chi_square_pooled, left_pad, perturbed_copy

FAMILIES = ("llava", "qwen2_vl", "gemma3")
VOCAB, EOS, PAD = 320, 256, 257
IMAGE, BLOCK_START, BLOCK_END = 300, 302, 303  # placeholder; Qwen's vision start/end (Gemma: boi 301, eoi 302)
QWEN_GRID = (1, 4, 6)  # t, h, w patches -> (4 // 2) * (6 // 2) = 6 image tokens
IMAGE_TOKENS = {"llava": 16, "qwen2_vl": 6, "gemma3": 16}
TEXT_ARCH = {"llava": "llama", "qwen2_vl": "qwen2", "gemma3": "gemma3_text"}
NEW_TOKENS = 24
DRAFT_NOISE = 0.1  # (a): the target's weights plus 10% relative noise, vision tower included
SPECIAL = dict(bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, **SPECIAL)


# -- tiny models ----------------------------------------------------------------------------------
def _config(family: str):
    if family == "llava":
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=32, patch_size=8, projection_dim=32)
        return LlavaConfig(vision_config=vision, text_config=LlamaConfig(**TEXT), image_token_id=IMAGE,
                           vision_feature_layer=-1, tie_word_embeddings=False)
    if family == "qwen2_vl":
        text = dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                      spatial_merge_size=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=301,
                             vision_start_token_id=BLOCK_START, vision_end_token_id=BLOCK_END)
    text = Gemma3TextConfig(**dict(TEXT, num_hidden_layers=3, head_dim=16, sliding_window=8,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"]))
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16, tie_word_embeddings=False,
                        image_token_id=IMAGE, boi_token_id=301, eoi_token_id=302)


MODEL_CLASS = {"llava": LlavaForConditionalGeneration, "qwen2_vl": Qwen2VLForConditionalGeneration,
               "gemma3": Gemma3ForConditionalGeneration}


def tiny_vlm(family: str, seed: int = 0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = MODEL_CLASS[family](_config(family)).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # random init is near uniform: make greedy paths decisive
            # random init attends almost uniformly, so positions and the image mask would hardly
            # matter; sharpen attention so that a wrong position or mask changes the output
            for key, weight in model.model.language_model.named_parameters():
                if key.endswith(("q_proj.weight", "k_proj.weight")):
                    weight.mul_(8.0)
                elif key.endswith(("q_norm.weight", "k_norm.weight")):  # Gemma normalises q and k
                    weight.fill_(1.0)  # scale (1 + w) = 2
            if family == "gemma3":  # initialised to zeros: the image would not matter at all
                model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 1.0)
    for key, value in SPECIAL.items():
        setattr(model.generation_config, key, value)
    return model


def language_model_copy(family: str, target):
    """A text-only causal LM with the target's own language-model weights: a draft that shares the
    tokenizer and agrees with the target on text, but never sees the image."""
    config = copy.deepcopy(target.config.text_config)
    if family == "qwen2_vl":  # mRoPE on text-only positions is plain RoPE: Qwen2 is its text-only twin
        config = Qwen2Config(**TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config.tie_word_embeddings = False  # the target's head is its own (Gemma's text config would tie it)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.model.load_state_dict(target.model.language_model.state_dict())
    model.lm_head.load_state_dict(target.lm_head.state_dict())
    for key, value in SPECIAL.items():
        setattr(model.generation_config, key, value)
    return model


def vision_tower(model):
    return model.model.visual if hasattr(model.model, "visual") else model.model.vision_tower


def image_block(family: str) -> list[int]:
    n = IMAGE_TOKENS[family]
    return {"llava": [IMAGE] * n, "qwen2_vl": [BLOCK_START] + [IMAGE] * n + [BLOCK_END],
            "gemma3": [301] + [IMAGE] * n + [302]}[family]


def pixels(family: str, seed: int) -> dict:
    """The image inputs of one image, as the family's processor would return them (no token ids)."""
    g = torch.Generator().manual_seed(1000 + seed)
    if family == "qwen2_vl":
        t, h, w = QWEN_GRID
        return {"pixel_values": torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=g),
                "image_grid_thw": torch.tensor([QWEN_GRID])}
    return {"pixel_values": torch.randn(1, 3, 32, 32, generator=g)}


def token_types(family: str, ids: torch.Tensor) -> dict:
    """Per-token inputs shaped like ``ids [B, L]``."""
    if family == "qwen2_vl":
        return {"mm_token_type_ids": (ids == IMAGE).long()}
    if family == "gemma3":
        return {"token_type_ids": (ids == IMAGE).long()}
    return {}


def image_prompt(family: str, seed: int = 0, text: int = 10, ends_before_image: bool = False):
    """([1, L] ids, image inputs): text, an image, text that repeats (prompt lookup finds drafts).

    ``ends_before_image``: the prompt ends with the text that precedes the image, so prompt lookup's
    very first block proposes the image placeholders themselves."""
    g = torch.Generator().manual_seed(seed)
    pre, post = torch.randint(0, 256, (6,), generator=g), torch.randint(0, 256, (text,), generator=g)
    tail = pre if ends_before_image else torch.cat([post[: text // 2], pre[:3]])
    ids = torch.cat([pre, torch.tensor(image_block(family)), post, tail])[None]
    return ids, {**pixels(family, seed), **token_types(family, ids)}


def batch_inputs(family: str, prompts: list[tuple[torch.Tensor, dict]]):
    """Left-pad several single-image prompts into one batch with their image inputs."""
    ids, mask = left_pad([p[0][0] for p in prompts], PAD)
    inputs = {"pixel_values": torch.cat([p[1]["pixel_values"] for p in prompts])}
    if family == "qwen2_vl":
        inputs["image_grid_thw"] = torch.cat([p[1]["image_grid_thw"] for p in prompts])
    return ids, mask, {**inputs, **token_types(family, ids * mask)}


REFERENCES: dict = {}


def greedy_reference(target, ids, inputs, mask=None, new=NEW_TOKENS):
    """target.generate(do_sample=False), memoised per (model, prompt, image inputs)."""
    key = (id(target), ids.numpy().tobytes(), None if mask is None else mask.numpy().tobytes(), new,
           tuple((k, v.numpy().tobytes()) for k, v in sorted(inputs.items())))
    if key not in REFERENCES or REFERENCES[key][0] is not target:  # the model is kept: its id stays unique
        REFERENCES[key] = (target, target.generate(ids, attention_mask=mask, **inputs, max_new_tokens=new,
                                                   do_sample=False))
    return REFERENCES[key][1]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    target = tiny_vlm(request.param, seed=0)
    drafts = {"vlm": perturbed_copy(target, DRAFT_NOISE, seed=7), "text": language_model_copy(request.param, target),
              "prompt_lookup": "prompt_lookup"}
    return request.param, target, drafts


def decoder_for(target, draft):
    return SpecDecoder(target, draft, num_tokens=4, schedule="fixed")




# -- 2. greedy: token-identical to target.generate --------------------------------------------------
@pytest.mark.parametrize("draft_kind", ["vlm", "text", "prompt_lookup"])
def test_greedy_matches_generate(family, draft_kind):
    name, target, drafts = family
    decoder = decoder_for(target, drafts[draft_kind])
    rates = []
    for seed in (0, 1):
        ids, inputs = image_prompt(name, seed)
        ref = greedy_reference(target, ids, inputs)
        out = decoder.generate(ids, max_new_tokens=NEW_TOKENS, **inputs)
        assert torch.equal(out.sequences, ref), f"{name} / {draft_kind} / prompt {seed}"
        rates.append((out.stats.accepted_tokens, out.stats.drafted_tokens))
    accepted, drafted = map(sum, zip(*rates))
    assert drafted > 0
    print(f"\nacceptance {name:9s} {draft_kind:13s} {accepted}/{drafted} = {accepted / drafted:.3f}")


def test_qwen2_5_vl_greedy_matches_generate():
    """Qwen2.5-VL (windowed vision attention; its get_rope_index also takes second_per_grid_ts)
    goes through the same path: nothing in specdec names a model."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=301,
                              vision_start_token_id=BLOCK_START, vision_end_token_id=BLOCK_END)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        target = Qwen2_5_VLForConditionalGeneration(config).eval()
        with torch.no_grad():
            target.lm_head.weight.mul_(8.0)
            for key, weight in target.model.language_model.named_parameters():
                if key.endswith(("q_proj.weight", "k_proj.weight")):
                    weight.mul_(8.0)
    for key, value in SPECIAL.items():
        setattr(target.generation_config, key, value)
    draft = perturbed_copy(target, DRAFT_NOISE, seed=7)
    for seed in (0, 1):
        ids, inputs = image_prompt("qwen2_vl", seed)
        ref = greedy_reference(target, ids, inputs)
        # positions matter on this model: plain 1-D positions would change the output
        plain = target.generate(ids, **inputs, position_ids=torch.arange(ids.shape[1])[None],
                                max_new_tokens=NEW_TOKENS, do_sample=False)
        assert not torch.equal(plain, ref)
        for drafter in (draft, "prompt_lookup"):
            out = decoder_for(target, drafter).generate(ids, max_new_tokens=NEW_TOKENS, **inputs)
            assert torch.equal(out.sequences, ref), f"prompt {seed}"


def test_prompt_lookup_never_offers_a_placeholder_to_the_prefill(family):
    """A prompt ending with the text before the image makes prompt lookup propose the image
    placeholders at once; the target's prefill (which carries the image features) must not get
    them, or the model would count them as image slots. Later blocks may hold them: by then they
    are plain tokens, as in transformers' own decoding."""
    name, target, _ = family
    ids, inputs = image_prompt(name, 2, ends_before_image=True)
    proposed = lookup(ids[0], 3, 1, 4)  # what prompt lookup offers first (its default n-grams, 4 drafts)
    assert IMAGE in proposed.tolist()
    recorder = ForwardRecorder(target)
    try:
        out = decoder_for(target, "prompt_lookup").generate(ids, max_new_tokens=NEW_TOKENS, **inputs)
    finally:
        recorder.remove()
    prefill = recorder.calls[0]["input_ids"]
    assert int((prefill == IMAGE).sum()) == IMAGE_TOKENS[name]  # the prompt's, nothing more
    # the drafts before the first placeholder did ride along (Qwen's vision-start, Gemma's boi)
    assert prefill.shape[1] == ids.shape[1] + proposed.tolist().index(IMAGE)
    assert torch.equal(out.sequences, greedy_reference(target, ids, inputs))


@pytest.mark.parametrize("draft_kind", ["vlm", "prompt_lookup"])
def test_batched_image_rows_match_single_row_generate(family, draft_kind):
    """Left-padded rows of different lengths, one image each: per-row mRoPE deltas, per-token
    inputs laid out per row, every row equal to decoding it alone."""
    name, target, drafts = family
    prompts = [image_prompt(name, seed, text=t) for seed, t in ((3, 4), (4, 18), (5, 9))]
    ids, mask, inputs = batch_inputs(name, prompts)
    out = decoder_for(target, drafts[draft_kind]).generate(ids, mask, max_new_tokens=NEW_TOKENS, **inputs)
    for row, (one_ids, one_inputs) in enumerate(prompts):
        ref = greedy_reference(target, one_ids, one_inputs)[0, one_ids.shape[1]:]
        got = out.sequences[row, ids.shape[1]:]
        assert torch.equal(got[: ref.numel()], ref), f"row {row}"
        assert bool((got[ref.numel():] == PAD).all())


def test_mrope_positions_match_transformers():
    """The 3-D positions ModelState feeds equal those transformers' generate builds (prompt via
    get_rope_index, then +1 per new token on each axis), for left-padded rows."""
    from specdec.multimodal import PrefillSpec

    target = tiny_vlm("qwen2_vl")
    prompts = [image_prompt("qwen2_vl", seed, text=t) for seed, t in ((3, 4), (4, 18))]
    ids, mask, inputs = batch_inputs("qwen2_vl", prompts)
    lengths = mask.sum(1)
    rows = torch.stack([torch.cat([r[0][0], r[0][0].new_zeros(ids.shape[1] - r[0].shape[1])]) for r in prompts])
    _, positions = PrefillSpec.from_call(rows, lengths, inputs).for_model(target)
    theirs = target._prepare_position_ids_for_generation(ids, {"attention_mask": mask, **inputs})[1:]  # [3, B, L]
    new = torch.arange(1, 6)
    theirs = torch.cat([theirs, theirs[..., -1:] + new], dim=-1)  # what generate appends per new token
    for b in range(2):
        index = torch.arange(int(lengths[b]) + 5)[None]  # [1, row tokens + 5 new]
        ours = positions.select_rows(torch.tensor([b]))(index)[:, 0]  # [3, W]
        assert torch.equal(ours, theirs[:, b, ids.shape[1] - int(lengths[b]):])


# -- 3. prefill-only inputs reach each model in its first forward only ------------------------------
def test_prefill_only_inputs_reach_each_model_once(family):
    """Per generate() call: the target gets the image inputs in its first forward and never again,
    a vision-language draft in its one prefill (the prompt alone) and never again, a text-only
    draft never; each vision tower runs once per model per call. Two calls, counted separately."""
    name, target, drafts = family
    ids, inputs = image_prompt(name, 0)
    prefill_only = set(inputs)  # pixel values, grid, token type ids
    models = {"target": target, "vlm": drafts["vlm"], "text": drafts["text"]}
    recorders = {k: ForwardRecorder(m) for k, m in models.items()}
    towers = {"target": 0, "vlm": 0}
    handles = [vision_tower(models[k]).register_forward_hook(lambda *_, k=k: towers.__setitem__(k, towers[k] + 1))
               for k in towers]

    def carried(calls):  # [forward index carrying any prefill-only input]
        return [i for i, c in enumerate(calls) if prefill_only & c["kwargs"]]

    weights = {k: v.clone() for k, v in target.state_dict().items()}
    config = target.config.to_dict()
    rope_deltas = getattr(target.model, "rope_deltas", None)  # Qwen2-VL: what transformers left there, if anything

    try:
        for draft in ("vlm", "text", "vlm"):  # three generate() calls, counted one by one
            for recorder in recorders.values():
                recorder.calls.clear()
            towers.update(target=0, vlm=0)
            decoder_for(target, models[draft]).generate(ids, max_new_tokens=NEW_TOKENS, **inputs)
            calls = {k: r.calls for k, r in recorders.items()}
            assert len(calls["target"]) > 3 and len(calls[draft]) > 3  # several steps really ran
            assert carried(calls["target"]) == [0] and prefill_only <= calls["target"][0]["kwargs"]
            if draft == "vlm":
                assert carried(calls["vlm"]) == [0] and prefill_only <= calls["vlm"][0]["kwargs"]
                assert calls["vlm"][0]["tokens"] == ids.shape[1]  # its prefill is the prompt alone
                assert towers == {"target": 1, "vlm": 1}
            else:
                assert carried(calls["text"]) == [] and calls["vlm"] == []
                assert towers == {"target": 1, "vlm": 0}
        # and the user's model is left as it was
        assert target.config.to_dict() == config
        assert all(torch.equal(v, weights[k]) for k, v in target.state_dict().items())
        assert getattr(target.model, "rope_deltas", None) is rope_deltas
    finally:
        for recorder in recorders.values():
            recorder.remove()
        for handle in handles:
            handle.remove()


# -- 4. an exact copy of the target accepts (nearly) everything -------------------------------------
def test_exact_copy_draft_accepts_at_least_95_percent(family):
    """Measured (tiny models, 2 image prompts, 24 new tokens, K=4): 38/38 = 1.000 for llava, qwen2_vl and
    gemma3. transformers' assisted generation, whose assistant never sees the image, reaches far
    less with the same copy (see docs/multimodal.md)."""
    name, target, _ = family
    decoder = decoder_for(target, copy.deepcopy(target))
    accepted = drafted = 0
    for seed in (0, 1):
        ids, inputs = image_prompt(name, seed)
        out = decoder.generate(ids, max_new_tokens=NEW_TOKENS, **inputs)
        assert torch.equal(out.sequences, greedy_reference(target, ids, inputs))
        accepted, drafted = accepted + out.stats.accepted_tokens, drafted + out.stats.drafted_tokens
    print(f"\nexact copy {name}: {accepted}/{drafted} = {accepted / drafted:.3f}")
    assert drafted >= 30 and accepted / drafted >= 0.95


# -- 5. continuing from a cache that already holds a prefix -----------------------------------------
def transformers_continuation(target, prefix_ids, prefix_inputs, full_ids, new=NEW_TOKENS):
    """What transformers does: prefill the prefix with a forward, then generate on a copy of that
    cache (Qwen2-VL reads the rope_deltas the forward left on the model)."""
    cache = DynamicCache()
    with torch.no_grad():
        target(input_ids=prefix_ids, **prefix_inputs, cache=cache)
    extra = {k: torch.cat([v, v.new_zeros(1, full_ids.shape[1] - v.shape[1])], 1)
             for k, v in prefix_inputs.items() if k in ("token_type_ids", "mm_token_type_ids")}
    return target.generate(full_ids, cache=copy.deepcopy(cache), max_new_tokens=new, do_sample=False, **extra)


@pytest.mark.parametrize("draft_kind", ["vlm", "prompt_lookup"])
def test_continuation_from_a_prefix(family, draft_kind, monkeypatch):
    name, target, drafts = family
    system = torch.randint(0, 256, (5,), generator=torch.Generator().manual_seed(11))
    prefix_ids = torch.cat([system, torch.tensor(image_block(name)), system[:2]])[None]
    prefix_inputs = {**pixels(name, 11), **token_types(name, prefix_ids)}
    questions = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))[None] for n in (7, 12)]
    decoder = decoder_for(target, drafts[draft_kind])
    sentinel = torch.full((1, 1), -1234)
    if name == "qwen2_vl":  # transformers' forward would store rope_deltas here; specdec never does
        target.model.rope_deltas = sentinel
    prefix = decoder.prefill(prefix_ids, **prefix_inputs)
    assert isinstance(prefix, Prefix)

    # an unrelated image call in between: the prefix carries its own prefill-derived state
    other_ids, other_inputs = image_prompt(name, 5)
    decoder.generate(other_ids, max_new_tokens=4, **other_inputs)

    rope_calls = []
    if name == "qwen2_vl":  # instrument (this test only) the target's own rope-index helper
        own = target.model.get_rope_index
        monkeypatch.setattr(target.model, "get_rope_index", lambda *a, **k: rope_calls.append(1) or own(*a, **k))
    recorder = ForwardRecorder(target)
    tower_calls = []
    handle = vision_tower(target).register_forward_hook(lambda *_: tower_calls.append(1))
    try:
        outs = [decoder.generate(torch.cat([prefix_ids, q], 1), prefix=prefix, max_new_tokens=NEW_TOKENS)
                for q in questions]
    finally:
        recorder.remove()
        handle.remove()
    # nothing prefill-only was recomputed for the target: no image, no positions, no image inputs
    assert tower_calls == [] and rope_calls == []
    assert all(not (set(prefix_inputs) & c["kwargs"]) for c in recorder.calls)
    assert recorder.calls[0]["tokens"] <= questions[0].shape[1] + 4  # the question and drafts, not the prefix
    if name == "qwen2_vl":
        assert target.model.rope_deltas is sentinel  # never mutated by specdec
        target.model.rope_deltas = None
    for q, out in zip(questions, outs):
        full = torch.cat([prefix_ids, q], 1)
        ref = transformers_continuation(target, prefix_ids, prefix_inputs, full)
        assert torch.equal(out.sequences, ref)
        # and the same as prefilling everything at once
        full_inputs = {**pixels(name, 11), **token_types(name, full)}
        assert torch.equal(out.sequences, greedy_reference(target, full, full_inputs))


def test_batched_continuation_from_a_prefix(family):
    """Two rows with prefixes of different lengths (left-padded) continue with questions of
    different lengths; each row equals transformers' generate on its whole prompt alone."""
    name, target, drafts = family
    prompts = [image_prompt(name, seed, text=t) for seed, t in ((3, 4), (4, 12))]
    decoder = decoder_for(target, drafts["vlm"])
    prefix = decoder.prefill(*batch_inputs(name, prompts)[:2], **batch_inputs(name, prompts)[2])
    rows = [torch.cat([p[0][0], torch.arange(5, 5 + n)]) for p, n in zip(prompts, (3, 7))]
    ids, mask = left_pad(rows, PAD)
    out = decoder.generate(ids, mask, prefix=prefix, max_new_tokens=16)
    for b, (row, (_, inputs)) in enumerate(zip(rows, prompts)):
        full = row[None]
        ref = greedy_reference(target, full, {**pixels(name, (3, 4)[b]), **token_types(name, full)}, new=16)
        got = out.sequences[b, ids.shape[1]:]
        assert torch.equal(got[: ref.shape[1] - full.shape[1]], ref[0, full.shape[1]:]), f"row {b}"


# -- 6. bad input: one clear error before any forward -----------------------------------------------
def _no_forward(*models):
    return [ForwardRecorder(m) for m in models]


def test_image_inputs_for_a_text_only_target():
    text, _ = tiny_random("llama", seed=0, vocab_size=VOCAB)
    ids, inputs = image_prompt("llava", 0)
    recorders = _no_forward(text)
    with pytest.raises(ValueError, match="text-only model: it cannot take image inputs"):
        SpecDecoder(text, "prompt_lookup").generate(ids, max_new_tokens=4, **inputs)
    assert recorders[0].calls == []


def test_vision_language_draft_with_a_text_only_target():
    text, _ = tiny_random("llama", seed=0, vocab_size=VOCAB)
    vlm = tiny_vlm("llava")
    recorders = _no_forward(text, vlm)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="is a vision-language model but the target"):
        SpecDecoder(text, vlm).generate(ids, max_new_tokens=4)
    assert all(r.calls == [] for r in recorders)


@pytest.mark.parametrize("name", FAMILIES)
def test_placeholders_without_image_inputs(name):
    target = tiny_vlm(name)
    draft = perturbed_copy(target, DRAFT_NOISE, seed=7)
    ids, inputs = image_prompt(name, 0)
    recorders = _no_forward(target, draft)
    with pytest.raises(ValueError, match="image placeholder tokens .* but no image inputs"):
        SpecDecoder(target, draft).generate(ids, max_new_tokens=4)
    text_ids = ids[ids != IMAGE][None]
    with pytest.raises(ValueError, match="the prompt holds no image placeholder"):
        SpecDecoder(target, draft).generate(text_ids, max_new_tokens=4, **inputs)
    if name == "qwen2_vl":
        with pytest.raises(ValueError, match="need mm_token_type_ids"):
            SpecDecoder(target, draft).generate(ids, max_new_tokens=4, pixel_values=inputs["pixel_values"],
                                                image_grid_thw=inputs["image_grid_thw"])
    assert all(r.calls == [] for r in recorders)
    # a vision-language target on a text-only prompt is plain text decoding, equal to generate
    out = SpecDecoder(target, draft, num_tokens=4).generate(text_ids, max_new_tokens=12)
    assert torch.equal(out.sequences, target.generate(text_ids, max_new_tokens=12, do_sample=False))


def test_prefix_misuse():
    target = tiny_vlm("qwen2_vl")
    ids, inputs = image_prompt("qwen2_vl", 0)
    decoder = SpecDecoder(target, "prompt_lookup")
    prefix = decoder.prefill(ids, **inputs)
    recorders = _no_forward(target)
    tail = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="does not start with the prefix"):
        decoder.generate(torch.cat([ids[:, 1:], tail, tail], 1), prefix=prefix, max_new_tokens=4)
    with pytest.raises(ValueError, match="extend its prefix row by at least one token"):
        decoder.generate(ids, prefix=prefix, max_new_tokens=4)
    with pytest.raises(ValueError, match="belong to the prefix"):
        decoder.generate(torch.cat([ids, tail], 1), prefix=prefix, max_new_tokens=4, **inputs)
    with pytest.raises(ValueError, match="images belong to the prefix"):
        decoder.generate(torch.cat([ids, tail, torch.tensor([[IMAGE]])], 1), prefix=prefix, max_new_tokens=4)
    with pytest.raises(ValueError, match="another target"):
        SpecDecoder(tiny_vlm("qwen2_vl", seed=1)).generate(torch.cat([ids, tail], 1), prefix=prefix, max_new_tokens=4)
    assert recorders[0].calls == []


# -- 2. sampling stays lossless on a vision-language target -----------------------------------------
N_SAMPLES, ALPHA, MAX_TV = 8000, 1e-3, 0.05


def test_sampling_on_an_image_prompt_is_lossless():
    """Qwen2-VL target (mRoPE) with a vision-language draft: the joint distribution of the first
    three sampled tokens over N rows of one image prompt matches the target's exact distribution
    (forward passes over every continuation inside top-k = 3: 27 cells). Same method and thresholds as
    tests/test_sampling_lossless.py: chi-square with cells of expected count < 5 pooled,
    p > 1e-3 (a given seed fails with probability 1e-3 under a correct sampler), and total
    variation < 0.05."""
    params = SamplingParams(True, 1.5, top_k=3)
    target = tiny_vlm("qwen2_vl")
    draft = perturbed_copy(target, DRAFT_NOISE, seed=7)
    ids, inputs = image_prompt("qwen2_vl", 0)

    def repeat(n):  # n copies of the prompt and its image
        return {"pixel_values": inputs["pixel_values"].repeat(n, 1), "image_grid_thw": inputs["image_grid_thw"].repeat(n, 1)}

    out = SpecDecoder(target, draft, num_tokens=3, schedule="fixed").generate(
        ids.repeat(N_SAMPLES, 1), max_new_tokens=3, do_sample=True, temperature=params.temperature,
        top_k=params.top_k, generator=torch.Generator().manual_seed(0), mm_token_type_ids=inputs["mm_token_type_ids"].repeat(N_SAMPLES, 1),
        **repeat(N_SAMPLES))
    new = out.sequences[:, ids.shape[1]:]
    assert new.shape == (N_SAMPLES, 3)
    assert out.stats.drafted_tokens > N_SAMPLES and 0 < out.stats.accepted_tokens < out.stats.drafted_tokens

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:  # [n, j] continuations -> [n, V]
        n = prefixes.shape[0]
        full = torch.cat([ids.repeat(n, 1), prefixes], 1)
        mm = torch.cat([inputs["mm_token_type_ids"].repeat(n, 1), torch.zeros_like(prefixes)], 1)
        with torch.no_grad():
            logits = target(input_ids=full, mm_token_type_ids=mm, **repeat(n)).logits[:, -1]
        return params.probs(logits)

    exact: dict[tuple[int, ...], float] = {}
    p1 = next_probs(ids.new_zeros(1, 0))[0]
    firsts = p1.nonzero().flatten()
    p2 = next_probs(firsts[:, None])  # [k, V]
    pairs = [(int(a), int(b)) for i, a in enumerate(firsts) for b in p2[i].nonzero().flatten()]
    p3 = next_probs(torch.tensor(pairs))  # [k*k, V]
    for j, (a, b) in enumerate(pairs):
        for c in p3[j].nonzero().flatten().tolist():
            exact[(a, b, c)] = float(p1[a] * p2[firsts.tolist().index(a), b] * p3[j, c])
    cells = list(exact)
    counts = torch.zeros(len(cells))
    observed = {}
    for row in new.tolist():
        observed[tuple(row)] = observed.get(tuple(row), 0) + 1
    assert set(observed) <= set(cells), "sampled a token outside the target's top-k"
    for i, cell in enumerate(cells):
        counts[i] = observed.get(cell, 0)
    probs = torch.tensor([exact[c] for c in cells], dtype=torch.float64)
    p_value, tv = chi_square_pooled(counts, probs)
    print(f"\nsampling on an image prompt: {len(cells)} cells, chi-square p = {p_value:.3f}, tv = {tv:.4f}")
    assert p_value > ALPHA and tv < MAX_TV
