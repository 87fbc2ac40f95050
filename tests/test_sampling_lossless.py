"""Speculative sampling is lossless: committed tokens are distributed as the target's own samples.

Two levels, each with at least 20,000 samples on a small vocabulary, and a coupling:

* **Verifier level.** A Markov-chain "target" ``P[prev] -> next`` and "draft" ``Q[prev]`` on
  V = 6 tokens. 20,000 rows are decoded in lockstep with ``speculative_sample`` (random K per
  row) until every row has 3 tokens, with model-like drafts (sampled from ``Q``, with
  ``draft_probs``) and with one-hot drafts (a deterministic lookup, as prompt lookup proposes).
  The joint distribution of the first three committed tokens (216 cells) must match the chain's
  exact ``P[x0, a] P[a, b] P[b, c]``. Temperature, top-k and top-p are applied through
  :class:`SamplingParams` to both tables, exactly as the decoder does.
* **End to end.** ``SpecDecoder.generate`` on a tiny Llama with an 8-token vocabulary, a batch of
  20,000 copies of one prompt, with ``prompt_lookup``, ``draft_model`` (also as a w8a8 copy),
  ``self_draft`` and the lookup-then-copy hybrid; the joint distribution of the 3 generated
  tokens (512 cells) must match the target's exact distribution, computed by forward passes over
  every 1- and 2-token continuation.
  The target prefills the prompt once for all its rows (``specdec/shared_prefill.py``); the same
  check with every row prefilled covers rows of distinct prompts.
* **Static cache, by coupling.** With the same seeded generator, the static cache commits exactly
  the tokens of the dynamic cache, row for row (2,000 rows per drafter), through the same accepted
  and rejected drafts. Equal samples have equal distributions, so the end-to-end check covers the
  static path too, and any difference in any row fails, which a second chi-square would only
  notice as a bias large enough to show in the counts.

**Threshold.** Pearson's chi-square goodness of fit, cells with expected count < 5 pooled into
one bin (the usual validity condition for the chi-square approximation), rejecting at
``p < ALPHA = 1e-3``. Under a correct sampler the p-value is uniform, so a given seed fails with
probability 1e-3 per comparison (about 1% over the comparisons in this file), and the seeds are
fixed, so a run is deterministic. A real bias is far beyond that threshold: the classic bug of
resampling a rejected position from the target instead of the residual shifts tens of percent of
probability between cells, i.e. a chi-square in the thousands at n = 20,000;
:func:`test_the_chi_square_check_catches_a_biased_sampler` shows the check rejecting exactly that
bug with p < 1e-10. Cells with target probability 0 (cut by top-k/top-p) must stay empty. The
total-variation distance is asserted too, below 0.05, against a gross shift (the biased
sampler's is >= 0.1); over the 512 cells of the end-to-end joint a correct sampler's expected
distance at n = 20,000 is close to that bound, so there the chi-square is the test and the fixed
seeds keep the bound deterministic.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec import SpecDecoder
from specdec.sampling import SamplingParams, warp_logits
from specdec.verify import Verdict, speculative_sample

from helpers import BlindAssistant, chi_square_pooled, commit_verdict, perturbed_copy

ALPHA = 1e-3
MAX_TV = 0.05
N = 20_000
#: rows of each static-cache run compared with the dynamic cache's (a coupling: equal or not)
N_COUPLED = 2_000


def assert_same_distribution(observed: torch.Tensor, expected_probs: torch.Tensor) -> None:
    p_value, tv = chi_square_pooled(observed, expected_probs)
    assert p_value > ALPHA, f"chi-square p = {p_value:.2e} (tv {tv:.4f}): committed tokens are biased"
    assert tv < MAX_TV, f"total variation {tv:.4f}"


# -- warping -------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, None, None), (1.0, 3, None), (1.0, None, 0.8),
                                                     (1.3, 5, 0.9), (0.5, 1, None)])
def test_warp_matches_transformers_logits_warpers(temperature, top_k, top_p):
    """The warp the decoder applies to draft and target is transformers' own: temperature, top-k,
    top-p, in that order."""
    logits = torch.randn(64, 11, generator=torch.Generator().manual_seed(0)) * 3
    expected = logits.clone()
    expected = TemperatureLogitsWarper(temperature)(None, expected)
    if top_k is not None:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p is not None:
        expected = TopPLogitsWarper(top_p)(None, expected)
    ours = warp_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    params = SamplingParams(True, temperature, top_k, top_p)
    assert torch.allclose(params.probs(logits), torch.softmax(expected, -1), atol=1e-6)


# -- verifier level: a Markov chain ------------------------------------------------------------
VOCAB, K, X0 = 6, 4, 0


def markov_tables(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Warped transition tables target P [V, V] and draft Q [V, V] (row = previous token)."""
    g = torch.Generator().manual_seed(7)
    target_logits = torch.randn(VOCAB, VOCAB, generator=g) * 1.5
    draft_logits = target_logits + torch.randn(VOCAB, VOCAB, generator=g)  # close, not equal
    return params.probs(target_logits), params.probs(draft_logits)


def run_chain(target_table, draft_table, one_hot: bool, seed: int, verify=speculative_sample) -> torch.Tensor:
    """Decode N rows in lockstep until each has >= 3 tokens; return [N, 3] first committed tokens."""
    g = torch.Generator().manual_seed(seed)
    lookup = torch.roll(torch.arange(VOCAB), -1)  # one-hot drafts: "token t is followed by t+1"
    out = torch.full((N, 3 * (K + 1)), -1, dtype=torch.long)
    count = torch.zeros(N, dtype=torch.long)
    last = torch.full((N,), X0, dtype=torch.long)
    for _ in range(3):  # each step commits >= 1 token per row
        drafts, prev = [], last
        for _ in range(K):
            prev = lookup[prev] if one_hot else torch.multinomial(draft_table[prev], 1, generator=g).squeeze(1)
            drafts.append(prev)
        draft_ids = torch.stack(drafts, 1)  # [N, K]
        context = torch.cat([last[:, None], draft_ids], 1)  # [N, K+1]: token before each scored position
        target_probs = target_table[context]  # [N, K+1, V]
        draft_probs = None if one_hot else draft_table[context[:, :K]]  # [N, K, V]
        lengths = torch.randint(0, K + 1, (N,), generator=g)  # rows offer different numbers of drafts
        verdict: Verdict = verify(target_probs, draft_ids, lengths, draft_probs, g)
        last = commit_verdict(out, count, draft_ids, verdict)
    return out[:, :3]


def chain_joint(target_table: torch.Tensor) -> torch.Tensor:
    """[V, V, V] exact probability of the first three tokens after X0."""
    p1 = target_table[X0]  # [V]
    return p1[:, None, None] * target_table[:, :, None] * target_table[None, :, :]


def joint_counts(first: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, m] tokens -> [vocab ** m] counts of each m-gram."""
    index = torch.zeros(first.shape[0], dtype=torch.long)
    for j in range(first.shape[1]):
        index = index * vocab + first[:, j]
    return torch.bincount(index, minlength=vocab ** first.shape[1])


SAMPLING = [SamplingParams(True, 1.0), SamplingParams(True, 0.7, top_k=4), SamplingParams(True, 1.2, top_p=0.8)]


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("params", SAMPLING, ids=["plain", "temp_topk", "temp_topp"])
def test_verifier_commits_the_target_distribution(params, one_hot):
    target_table, draft_table = markov_tables(params)
    first = run_chain(target_table, draft_table, one_hot, seed=1)
    assert bool((first >= 0).all())
    assert_same_distribution(joint_counts(first, VOCAB), chain_joint(target_table))


def naive_sample(target_probs, draft_ids, draft_lengths, draft_probs=None, generator=None) -> Verdict:
    """A classic bug: the rejected position is resampled from the target, not the residual."""
    verdict = speculative_sample(target_probs, draft_ids, draft_lengths, draft_probs, generator)
    rows = torch.arange(target_probs.shape[0])
    resampled = torch.multinomial(target_probs[rows, verdict.accepted], 1, generator=generator).squeeze(1)
    return Verdict(verdict.accepted, resampled)


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
def test_the_chi_square_check_catches_a_biased_sampler(one_hot):
    target_table, draft_table = markov_tables(SAMPLING[0])
    first = run_chain(target_table, draft_table, one_hot, seed=1, verify=naive_sample)
    p_value, tv = chi_square_pooled(joint_counts(first, VOCAB), chain_joint(target_table))
    assert p_value < 1e-10 and tv > 2 * MAX_TV


# -- end to end: SpecDecoder on a tiny model with an 8-token vocabulary ------------------------
TINY_VOCAB = 8
PROMPT = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]])  # repetitive: prompt lookup finds drafts


def tiny_vocab_llama(seed: int = 0) -> LlamaForCausalLM:
    """A tiny random Llama over 8 tokens, no EOS (every row generates exactly max_new_tokens)."""
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(6.0)  # random init is near uniform; make distributions uneven
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def tiny_models():
    target = tiny_vocab_llama(0)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std())
    return target, draft


def exact_three_token_joint(model, prompt: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V, V, V] probability of the first three generated tokens, by forward passes over every
    1- and 2-token continuation of ``prompt [1, P]``."""
    v = TINY_VOCAB
    with torch.no_grad():
        p1 = params.probs(model(prompt).logits[0, -1])  # [V]
        one = torch.cat([prompt.repeat(v, 1), torch.arange(v)[:, None]], 1)  # [V, P+1]
        p2 = params.probs(model(one).logits[:, -1])  # [V, V]
        pairs = torch.cartesian_prod(torch.arange(v), torch.arange(v))  # [V*V, 2]
        two = torch.cat([prompt.repeat(v * v, 1), pairs], 1)  # [V*V, P+2]
        p3 = params.probs(model(two).logits[:, -1]).view(v, v, v)  # [V, V, V]
    return p1[:, None, None] * p2[:, :, None] * p3


DRAFTERS = [
    ("prompt_lookup", SamplingParams(True, 0.8, top_k=6)),
    ("draft_model", SamplingParams(True, 1.2, top_p=0.9)),
    ("draft_model_w8a8", SamplingParams(True, 0.8, top_k=6)),  # the draft as a w8a8 copy (weights=)
    ("self_draft", SamplingParams(True, 0.8, top_k=6)),
    ("self_draft_lookup", SamplingParams(True, 1.0, top_k=6)),  # the hybrid: lookup first, then the copy
]


def sample(tiny_models, drafter: str, params: SamplingParams, cache: str, rows: int):
    """``SpecDecoder.generate`` of 3 tokens for ``rows`` copies of ``PROMPT``, seeded."""
    target, draft = tiny_models
    options = {}
    if drafter.startswith("self_draft"):
        options = {"weights": "bfloat16", "compile_draft": False, "lookup": drafter == "self_draft_lookup"}
    if drafter == "draft_model_w8a8":
        options = {"weights": "w8a8", "compile_draft": False}
    generator = {"draft_model": draft, "draft_model_w8a8": draft, "self_draft_lookup": "self_draft"}.get(drafter, drafter)
    decoder = SpecDecoder(target, generator, num_tokens=3, schedule="fixed", cache_implementation=cache, **options)
    return decoder.generate(PROMPT.repeat(rows, 1), max_new_tokens=3, do_sample=True, temperature=params.temperature,
                            top_k=params.top_k, top_p=params.top_p, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("drafter,params", DRAFTERS)
def test_generate_samples_the_target_distribution(tiny_models, drafter, params):
    target, _ = tiny_models
    out = sample(tiny_models, drafter, params, "dynamic", N)
    new = out.sequences[:, PROMPT.shape[1]:]
    assert new.shape == (N, 3)
    stats = out.stats
    # speculation really happened: drafts were offered (self_draft's first step verifies none: its
    # copy starts from the target's prefill), some accepted and some rejected
    assert stats.drafted_tokens >= N and 0 < stats.accepted_tokens < stats.drafted_tokens
    assert_same_distribution(joint_counts(new, TINY_VOCAB), exact_three_token_joint(target, PROMPT, params))


@pytest.mark.parametrize("drafter,params", [("prompt_lookup", SamplingParams(True, 0.8, top_k=3)),
                                             ("draft_model", SamplingParams(True, 1.1, top_k=3))])
def test_every_row_prefilled_samples_the_target_distribution(tiny_models, drafter, params, monkeypatch):
    """The rows above repeat one prompt, which the target prefills once (specdec/shared_prefill.py);
    with that switched off every row is prefilled, as rows of distinct prompts are (top-k 3: 27
    cells, so 4,000 rows keep the total variation small)."""
    monkeypatch.setattr("specdec.run.shared_prefix", lambda *args: None)
    target, _ = tiny_models
    new = sample(tiny_models, drafter, params, "dynamic", 4_000).sequences[:, PROMPT.shape[1]:]
    assert_same_distribution(joint_counts(new, TINY_VOCAB), exact_three_token_joint(target, PROMPT, params))


@pytest.mark.parametrize("drafter,params", DRAFTERS)
def test_the_static_cache_samples_what_the_dynamic_cache_samples(tiny_models, drafter, params):
    """With the same generator the static cache commits the very tokens the dynamic cache does,
    row for row, through the same accepted and rejected drafts: its distribution is then the one
    test_generate_samples_the_target_distribution checks (a coupling, stronger than a second
    chi-square: any difference in any row fails)."""
    dynamic, static = (sample(tiny_models, drafter, params, cache, N_COUPLED) for cache in ("dynamic", "static"))
    assert torch.equal(static.sequences, dynamic.sequences)
    assert (static.stats.drafted_tokens, static.stats.accepted_tokens) == \
        (dynamic.stats.drafted_tokens, dynamic.stats.accepted_tokens)
    assert static.stats.drafted_tokens >= N_COUPLED and 0 < static.stats.accepted_tokens < static.stats.drafted_tokens


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
def test_seeded_sampling_is_reproducible(tiny_models, drafter):
    target, draft = tiny_models
    decoder = SpecDecoder(target, draft if drafter == "draft_model" else drafter, num_tokens=4)
    prompt = PROMPT.repeat(16, 1)
    runs = []
    for seed, global_seed in ((5, 0), (5, 1), (6, 0)):
        torch.manual_seed(global_seed)  # only the given generator may matter
        out = decoder.generate(prompt, max_new_tokens=10, do_sample=True, temperature=0.9, top_k=7,
                               generator=torch.Generator().manual_seed(seed))
        runs.append(out.sequences)
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


class _Suppressed:
    """A SamplingParams whose logits first lose ``tokens`` (suppress_tokens), as generate() processes them."""

    def __init__(self, params: SamplingParams, tokens: list[int]):
        self.params, self.tokens = params, tokens

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return self.params.probs(logits.index_fill(-1, torch.tensor(self.tokens), float("-inf")))


def test_drafts_drawn_where_a_processor_forbids_them_are_rejected_not_cut(tiny_models):
    """A generator drafting from a distribution blind to suppress_tokens (as docs/plugins.md's
    assistant example does) gave no confidence, so its drafts were taken for a lookup's point
    masses and cut at a suppressed token: that position then sampled from the target's whole
    distribution, not from what the draft's leaves of it (biased)."""
    target, draft = tiny_models
    params, suppressed = SamplingParams(True, 1.0), [0, 6]
    out = SpecDecoder(target, BlindAssistant(draft)).generate(
        PROMPT.repeat(N, 1), max_new_tokens=3, do_sample=True, suppress_tokens=suppressed,
        generator=torch.Generator().manual_seed(0))
    new = out.sequences[:, PROMPT.shape[1]:]
    assert not bool(torch.isin(new, torch.tensor(suppressed)).any())
    assert 0 < out.stats.accepted_tokens < out.stats.drafted_tokens
    assert_same_distribution(joint_counts(new, TINY_VOCAB),
                             exact_three_token_joint(target, PROMPT, _Suppressed(params, suppressed)))


def test_under_sampling_the_verified_width_never_reads_a_drawn_drafts_probability(monkeypatch):
    """The policy sized each block by the drafter's probability of every drawn draft
    (``Proposal.confidence``): whether a draft was verified then depended on what was drawn, and the
    committed law was not the target's (a randomized check of single-row mtp calls measured a total
    variation of 0.08 at such steps, z = 7 against the target's law). Under sampling the policy sees
    no confidence of a drawn draft; a lookup's point masses keep theirs."""
    from specdec.generators import DraftingInfo
    from specdec.policy.plan import DraftPolicy

    class Confident(BlindAssistant):  # drafts as a free drafter, with each drawn draft's own probability
        def drafting(self):
            return DraftingInfo(free=True)

        def propose(self, ctx, max_drafts):
            proposal = super().propose(ctx, max_drafts)
            if proposal.probs is not None:
                proposal.confidence = proposal.probs.gather(2, proposal.token_ids[..., None])[..., 0]
            return proposal

    seen, admit = [], DraftPolicy.admit
    monkeypatch.setattr(DraftPolicy, "admit", lambda self, offered, sources, confidence: (
        seen.append(confidence), admit(self, offered, sources, confidence))[1])
    target = tiny_vocab_llama(0)
    SpecDecoder(target, Confident(perturbed_copy(target, 0.3, seed=1))).generate(
        PROMPT.repeat(2, 1), max_new_tokens=12, do_sample=True, generator=torch.Generator().manual_seed(0))
    drafted = [c for c in seen if c is not None and c.numel()]
    assert drafted and all(bool(torch.isnan(c).all()) for c in drafted)
