"""The ``mtp`` generator (``candidate_generators/mtp.py``): transformers' ``MtpModel`` drafts for its
target, on tiny random DeepSeek-V3 and GLM-4-MoE models with one and two MTP layers.

* greedy output is ``target.generate(do_sample=False)``, for one row and for a left-padded batch;
* an *oracle* ``MtpModel`` (its ``forward_layer`` returns, at the last column, the target's own last
  hidden state of the sequence its columns spell, so the shared output layer gives the target's
  logits) has its drafts accepted: the columns, positions and drafts the generator feeds are the
  right ones, and with two layers a wrong second draft is cropped out of the cache;
* with random MTP layers (drafts rejected, so two layers crop every step) each step's drafts are
  those of a fresh ``MtpModel.forward`` over the whole committed prefix: the cache the generator
  keeps and crops is exact;
* sampling: the oracle's drafts are all accepted (their probabilities are the target's own, so any
  other draft distribution would show as rejections), and a seeded chi-square on an 8-token
  vocabulary finds the committed tokens distributed as the target's;
* MTP layers load from a checkpoint in DeepSeek-V3's layout (a 61-layer tiny model, where the class
  looks for them), and a checkpoint without them, a Llama, and an ``MtpModel`` of another model are
  refused before any forward, naming why.

``MtpModel`` built in code leaves its experts' weights as uninitialised memory and its router at zero
(it initialises through the generic ``PreTrainedModel._init_weights``), so :func:`built_mtp` draws them.
"""

from __future__ import annotations

import re
import weakref

import pytest
import torch
from helpers import chi_square_pooled, left_pad, reference
from safetensors.torch import load_file, save_file
from test_sampling_lossless import ALPHA, exact_three_token_joint, joint_counts
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM, LlamaConfig,
                          LlamaForCausalLM)
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

from candidate_generators.mtp import MtpGenerator, exact_columns
from specdec import SpecDecoder
from specdec.sampling import SamplingParams
# balanced into the second process of a split session (tests/conftest.py)
pytestmark = pytest.mark.split_second


VOCAB = 96
NEW = 16


def deepseek(mtp_layers: int, layers: int = 2, vocab: int = VOCAB, seed: int = 0) -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, num_nextn_predict_layers=mtp_layers, max_position_embeddings=128,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return built(DeepseekV3ForCausalLM, config, seed)


def glm(mtp_layers: int, seed: int = 0) -> Glm4MoeForCausalLM:
    config = Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, partial_rotary_factor=0.5,
        num_nextn_predict_layers=mtp_layers, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
        pad_token_id=0)
    return built(Glm4MoeForCausalLM, config, seed)


def built(model_class, config, seed: int):
    """``model_class(config)`` seeded, with no end of sequence (every row makes max_new_tokens)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def init_experts(mtp: MtpModel, seed: int = 1) -> MtpModel:
    """Draw the weights ``MtpModel``'s generic init leaves unset: the experts' and the router's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if "mlp.experts" in name or name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return mtp.eval()


def built_mtp(target, seed: int = 1) -> MtpModel:
    with torch.random.fork_rng():  # its generic init draws from the global generator: the same layers in any order
        torch.manual_seed(seed)
        mtp = MtpModel(target, target.config.num_mtp_layers)
    return init_experts(mtp, seed)


def last(target) -> int:
    return target.config.num_hidden_layers


def decoder(target, mtp, **options) -> SpecDecoder:
    return SpecDecoder(target, "mtp", mtp=mtp, **{"schedule": "fixed", **options})


def prompts(vocab: int = VOCAB) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, vocab, (n,), generator=g) for n in (9, 5)]


def assert_exact(dec: SpecDecoder, target, new: int = NEW) -> list:
    """Each prompt alone and both as a left-padded batch decode to ``target.generate``; the outputs."""
    outs = []
    rows = prompts(target.config.vocab_size)
    for row in rows:
        out = dec.generate(row[None], max_new_tokens=new)
        assert torch.equal(out.sequences, reference(target, row[None], new))
        outs.append(out)
    ids, mask = left_pad(rows, pad_id=0)
    out = dec.generate(ids, mask, max_new_tokens=new)
    for b, row in enumerate(rows):
        want = reference(target, row[None], new)[0, row.numel():]
        assert torch.equal(out.sequences[b, ids.shape[1]:], want), b
    return [*outs, out]


class Oracle(MtpModel):
    """MTP layers that draft the target's own choice. Each row has its own ``MtpCache``; per cache the
    oracle rebuilds the row's sequence from the tokens its columns carry (layer 0 the committed ones,
    layer i this step's drafts), the row told by its prompt at the first feed. ``wrong_from``: layers
    from this one on draft the target's least likely token instead (a negated hidden state)."""

    def __init__(self, target, rows: list[torch.Tensor], wrong_from: int | None = None):
        super().__init__(target, target.config.num_mtp_layers)
        self.targets = [target]  # a list: not a submodule
        self.rows = rows
        self.wrong_from = wrong_from
        self.sequences: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def forward_layer(self, layer_idx, last_hidden_states, position_ids, mtp_cache, input_ids=None, **kwargs):
        ids, positions = input_ids[0].tolist(), position_ids[0].tolist()
        if mtp_cache not in self.sequences:
            row = next(r for r in self.rows if r[1:].tolist() == ids[: r.numel() - 1])
            self.sequences[mtp_cache] = dict(enumerate(row.tolist()))
        sequence = self.sequences[mtp_cache]
        sequence.update(zip(positions, ids))
        tokens = torch.tensor([[sequence[i] for i in range(positions[-1] + 1)]])
        with torch.no_grad():
            h = self.targets[0](tokens, output_hidden_states=True).hidden_states[-1][:, -1]  # [1, H]
        if self.wrong_from is not None and layer_idx >= self.wrong_from:
            h = -h
        out = torch.zeros(1, len(ids), h.shape[-1])
        out[:, -1] = h
        return out


# -- the cache arithmetic -----------------------------------------------------------------------------
def test_exact_columns():
    committed = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    # one layer: every fed column stays, whatever was drafted
    assert exact_columns(4, 5, [], committed, 1) == 4
    # two layers fed at 5 committed tokens (columns 0..3): layer 1's column 3 saw draft 0 at token 5
    assert exact_columns(4, 5, [10], committed, 2) == 4  # token 5 committed as drafted: all exact
    assert exact_columns(4, 5, [99], committed, 2) == 3  # rejected: column 3 goes
    assert exact_columns(4, 5, [10], committed[:5], 2) == 3  # not committed yet: goes too
    # three layers: column 3 saw tokens 5 and 6 (layer 2), column 2 token 5 (layer 2)
    assert exact_columns(4, 5, [10, 11], committed, 3) == 4
    assert exact_columns(4, 5, [10, 99], committed, 3) == 3
    assert exact_columns(4, 5, [99, 11], committed, 3) == 2


# -- greedy -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,layers", [(deepseek, 1), (deepseek, 2), (glm, 1)],
                         ids=["deepseek_v3-1", "deepseek_v3-2", "glm4_moe-1"])
def test_greedy_is_the_target_own_output(make, layers):
    target = make(layers)
    mtp = built_mtp(target)
    outs = assert_exact(decoder(target, mtp), target)
    stats = outs[0].stats
    assert stats.drafted_tokens >= layers * (stats.steps - 3)  # every step but the prefill and the last two: a full block
    assert stats.generator["mtp_layers"] == layers
    # under the core's draft-length policy (schedule "auto"), which may verify fewer than a block
    assert_exact(SpecDecoder(target, "mtp", mtp=mtp), target)


@pytest.mark.parametrize("layers", [1, 2])
def test_oracle_drafts_are_accepted(layers):
    target = deepseek(layers)
    rows = prompts()
    outs = assert_exact(decoder(target, Oracle(target, rows)), target)
    for out in outs:
        stats = out.stats
        assert stats.mean_accepted_length > 1 + 0.6 * layers, stats.summary()  # the prefill step counts too
        assert stats.accepted_tokens >= 0.95 * stats.drafted_tokens, stats.summary()


def test_a_wrong_second_draft_is_cropped_and_the_first_still_accepted():
    target = deepseek(2)
    outs = assert_exact(decoder(target, Oracle(target, prompts(), wrong_from=1)), target)
    for out in outs:
        stats = out.stats
        steps = stats.drafted_tokens // 2
        assert stats.accepted_tokens >= 0.9 * steps and stats.accepted_tokens <= steps, stats.summary()


class Recording(MtpGenerator):
    """Records each proposal with the committed tokens it was made after."""

    def __init__(self, log: list, **options):
        super().__init__(**options)
        self.log = log

    def propose(self, ctx, max_drafts):
        proposal = super().propose(ctx, max_drafts)
        self.log.append((ctx.tokens.clone(), ctx.lengths.clone(), proposal))
        return proposal


def test_drafts_are_those_of_a_fresh_mtp_forward_over_the_prefix():
    target = deepseek(2)
    mtp = built_mtp(target)
    log = []
    row = prompts()[0]
    out = SpecDecoder(target, Recording(log, mtp=mtp, schedule="fixed")).generate(
        row[None], max_new_tokens=NEW)
    assert torch.equal(out.sequences, reference(target, row[None], NEW))
    assert out.stats.accepted_tokens < out.stats.drafted_tokens  # rejections: the cache was cropped
    checked = 0
    with torch.no_grad():
        h = target(out.sequences, output_hidden_states=True).hidden_states[-1]  # [1, T, H]
        for tokens, lengths, proposal in log:
            n = int(lengths[0])
            if int(proposal.lengths[0]) == 0:
                continue
            seq = tokens[:, :n]
            fresh, logits, _ = mtp(input_ids=seq[:, 1:], last_hidden_states=h[:, : n - 1], attention_mask=None,
                                   position_ids=torch.arange(1, n)[None], mtp_cache=MtpCache(config=mtp.config))
            assert torch.equal(proposal.token_ids[:, :2], fresh), n
            # the drafts' probabilities too: a stale cache entry moves them long before it flips an argmax
            torch.testing.assert_close(proposal.confidence, torch.softmax(logits.float(), -1).amax(-1),
                                       atol=1e-6, rtol=1e-5)
            checked += 1
    assert checked >= NEW // 2


# -- sampling -----------------------------------------------------------------------------------------
def test_sampled_oracle_drafts_carry_the_target_probabilities():
    """Drafts sampled from the target's own (warped) distribution, with it as their probabilities, are
    accepted with probability 1: a draft distribution off the target's would show as rejections."""
    target = deepseek(2)
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)  # a spread, uneven distribution rather than a near-uniform one
    rows = prompts()
    log = []
    ids, mask = left_pad(rows, pad_id=0)
    out = SpecDecoder(target, Recording(log, mtp=Oracle(target, rows), schedule="fixed")
                      ).generate(ids, mask, max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=40,
                                 generator=torch.Generator().manual_seed(0))
    stats = out.stats
    assert stats.drafted_tokens >= 2 * 4
    assert stats.accepted_tokens >= 0.95 * stats.drafted_tokens, stats.summary()
    drafted = [p for _, _, p in log if int(p.lengths.max()) > 0]
    assert drafted and all(p.probs is not None and tuple(p.probs.shape) == (*p.token_ids.shape, VOCAB)
                           for p in drafted)
    probs = drafted[0].probs
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:2]))
    assert int((probs[0, 0] > 0).sum()) <= 40  # top_k applied to the drafts' distribution too


def test_sampling_is_the_target_distribution():
    """2,000 rows, 3 new tokens, an 8-token vocabulary: the first two tokens (the second drafted by the
    MTP layer, accepted or resampled) are distributed as the target's."""
    vocab, rows = 8, 2000
    target = deepseek(1, vocab=vocab, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)  # uneven distributions: the MTP layer shares this output layer
    prompt = torch.tensor([[1, 2, 3, 4, 5, 1, 2]])
    params = SamplingParams(True, 0.8, top_k=6)
    out = decoder(target, built_mtp(target, seed=2)).generate(
        prompt.repeat(rows, 1), max_new_tokens=3, do_sample=True, temperature=params.temperature, top_k=params.top_k,
        generator=torch.Generator().manual_seed(0))
    stats = out.stats
    assert stats.drafted_tokens >= rows and 0 < stats.accepted_tokens < stats.drafted_tokens, stats.summary()
    import test_sampling_lossless

    assert test_sampling_lossless.TINY_VOCAB == vocab
    expected = exact_three_token_joint(target, prompt, params).sum(-1)  # [V, V] the first two tokens
    p_value, _ = chi_square_pooled(joint_counts(out.sequences[:, prompt.shape[1]: prompt.shape[1] + 2], vocab),
                                   expected)
    assert p_value > ALPHA, f"chi-square p = {p_value:.2e}"


# -- loading and refusals ----------------------------------------------------------------------------
def write_checkpoint(target, mtp: MtpModel, folder) -> None:
    """``target`` saved with ``mtp``'s layers appended in DeepSeek-V3's layout: MTP layer j at
    ``model.layers.{num_hidden_layers + j}``, its block's weights directly under it, ``post_norm`` as
    ``shared_head.norm``, experts one by one (gate, up and down projections)."""
    target.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    n = last(target)
    for key, value in mtp.state_dict().items():
        match = re.match(r"layers\.(\d+)\.(.*)", key)
        if match is None:  # the shared embeddings, output layer and rotary tables
            continue
        base = f"model.layers.{n + int(match.group(1))}."
        rest = match.group(2).replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if rest == "mlp.experts.gate_up_proj":
            for e, fused in enumerate(value):
                gate, up = fused.chunk(2, dim=0)
                state[f"{base}mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                state[f"{base}mlp.experts.{e}.up_proj.weight"] = up.clone()
        elif rest == "mlp.experts.down_proj":
            for e, down in enumerate(value):
                state[f"{base}mlp.experts.{e}.down_proj.weight"] = down.clone()
        else:
            state[base + rest] = value.clone().contiguous()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def test_mtp_layers_load_from_the_checkpoint(tmp_path):
    # DeepseekV3ForCausalLM looks for its MTP layer at model.layers.61: a tiny model of 61 dense layers
    source = deepseek(1, layers=61)
    source.config.first_k_dense_replace = 61
    source = DeepseekV3ForCausalLM(source.config).eval()
    mtp = built_mtp(source)
    write_checkpoint(source, mtp, tmp_path)
    target = DeepseekV3ForCausalLM.from_pretrained(tmp_path).eval()
    dec = SpecDecoder(target, "mtp", schedule="fixed")
    row = prompts()[1][None]
    out = dec.generate(row, max_new_tokens=8)
    assert torch.equal(out.sequences, target.generate(row, max_new_tokens=8, do_sample=False))
    assert out.stats.drafted_tokens >= 6
    (loaded,) = dec.candidate_generator._loaded.values()  # loaded once for the decoder
    assert loaded.shared_head is target.lm_head
    ours = {k: v for k, v in mtp.state_dict().items() if k.startswith("layers.")}
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ours.items())
    dec.generate(row, max_new_tokens=4)
    assert list(dec.candidate_generator._loaded.values()) == [loaded]  # a second call shares it


def refused(target, match: str, **options) -> None:
    """``SpecDecoder(target, "mtp", **options).generate`` raises a ValueError matching ``match`` before any
    forward of the target."""
    calls = []
    hook = target.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            SpecDecoder(target, "mtp", **options).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    finally:
        hook.remove()
    assert not calls


def test_a_target_without_mtp_layers_is_refused_before_any_forward():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    why = r"LlamaForCausalLM \(llama\) has no multi-token-prediction layers: its config has no num_mtp_layers.*deepseek_v3"
    refused(llama, why)


def test_a_checkpoint_without_mtp_weights_is_refused_before_any_forward(tmp_path):
    deepseek(1).save_pretrained(tmp_path)
    target = DeepseekV3ForCausalLM.from_pretrained(tmp_path).eval()
    refused(target, "holds no MTP weights")


def test_a_model_built_in_code_needs_mtp():
    refused(deepseek(1), "built in code.*mtp=MtpModel")


def test_an_mtp_of_another_model_is_refused():
    target, other = deepseek(1), deepseek(1, vocab=64)
    refused(target, "output layer", mtp=built_mtp(other))
    with pytest.raises(TypeError, match="MtpModel"):
        SpecDecoder(target, "mtp", mtp=target)


def test_the_default_reads_the_last_hidden_state():
    target = deepseek(2)
    out = SpecDecoder(target, "mtp", mtp=Oracle(target, prompts()), schedule="fixed").generate(
        prompts()[0][None], max_new_tokens=NEW)
    assert torch.equal(out.sequences, reference(target, prompts()[0][None], NEW))
    assert out.stats.mean_accepted_length > 2
