"""Token trees (docs/trees.md): many guesses verified in one forward, exactly.

* the verifier's math on hand-made logits (greedy takes the deepest all-argmax path, not the first
  sibling's), and point-mass tree sampling against a Markov chain's exact joint (chi-square);
* greedy ``SpecDecoder.generate`` with trees identical to ``target.generate`` on every tiny
  architecture (prompt lookup's tries), dynamic and static caches, batch 1 and a left-padded batch
  with a different tree per row; a hand-made generator whose right branch at depth 2 follows a
  wrong first sibling accepts deeper than its leading chain, with the same output;
* logits processors along each node's own path; sampling end to end (chi-square on a tiny vocab);
* drafted siblings (recursive rejection), with and without replacement: chi-square against a Markov
  chain's exact joint, a wrong claim caught, and end to end;
* ``draft_model`` and ``self_draft`` with ``tree=True`` (the chain and the draft's alternatives):
  greedy identical to ``generate`` (batches, caches, processors), alternatives drawn without
  replacement sampled losslessly end to end, bad options refused;
* malformed trees refused naming the plugin.
"""

from __future__ import annotations

import pytest
import torch

from candidate_generators.draft_model import DraftModelGenerator, with_siblings
from specdec import SpecDecoder
from specdec.engines import Layout
from specdec.generators import CandidateGenerator, DraftingInfo, Proposal, StepRecord
from specdec.models import TINY_ARCHS
from specdec.sampling import SamplingParams
from specdec.verify import tree_greedy_verify, tree_point_mass_sample, tree_speculative_sample

from helpers import commit_verdict, left_pad, reference
from test_sampling_lossless import (N, TINY_VOCAB, VOCAB, X0, assert_same_distribution, chain_joint,
                                    exact_three_token_joint, joint_counts, markov_tables, tiny_vocab_llama)

#: a prompt whose suffix (5 6 7) occurred twice before with different continuations: prompt lookup
#: proposes a tree at the first step
CONTESTED = torch.tensor([[5, 6, 7, 8, 9, 12, 5, 6, 7, 10, 11, 13, 4, 5, 6, 7]])


class Oracle(CandidateGenerator):
    """Proposes, from the known greedy output ``ref`` [B, P+N] (rows left-padded by ``pads``), the
    tree: the right token t1, then under it a wrong sibling before the right t2, then t3 under t2
    (odd rows: a wrong sibling before t1 at the root, then t2, t3). ``chain=True`` proposes its
    leading chain instead (t1, wrong)."""

    name = "oracle_tree"

    def __init__(self, ref: torch.Tensor, pads: list[int], chain: bool = False):
        self.ref, self.pads, self.chain = ref, pads, chain

    def drafting(self) -> DraftingInfo:
        return DraftingInfo(max_drafts=None)  # no policy: every step verifies what is proposed

    def propose(self, ctx, max_drafts):
        rows = []
        for b in range(ctx.batch_size):
            at = self.pads[b] + int(ctx.lengths[b])
            truth = self.ref[b, at: at + 3].tolist()
            if len(truth) < 3 or int(max_drafts[b]) < 4:
                rows.append([])
                continue
            wrong = (truth[1] + 1 + b) % 300
            if self.chain:
                rows.append([(truth[0], -1), (wrong, 0)])
            elif b % 2:  # odd rows: the wrong sibling at the root, before the right one
                rows.append([((truth[0] + 1) % 300, -1), (truth[0], -1), (truth[1], 1), (truth[2], 2)])
            else:
                rows.append([(truth[0], -1), (wrong, 0), (truth[1], 0), (truth[2], 2)])
        return Proposal.from_tree(rows) if not self.chain else Proposal.from_rows([[t for t, _ in r] for r in rows])


# -- the verifier -----------------------------------------------------------------------------------
def test_greedy_tree_verdict_takes_the_deepest_all_argmax_path():
    vocab = 10
    node_ids = torch.tensor([[3, 4, 5, 6, 7]])  # node 0 (3) root child; 1 (4) and 2 (5) under 0; 3 (6) under 2
    parents = torch.tensor([[-1, 0, 0, 2, -1]])
    argmax = [3, 5, 9, 6, 1, 0]  # column i+1 after node i: root -> 3; node 0 -> 5 (node 2, not node 1); 2 -> 6; 3 -> 1
    logits = torch.nn.functional.one_hot(torch.tensor([argmax]), vocab).float()  # [1, 6, V]
    verdict = tree_greedy_verify(logits, node_ids, parents, torch.tensor([5]))
    assert verdict.accepted.tolist() == [3] and verdict.path[0, :3].tolist() == [0, 2, 3]
    assert verdict.next_token.tolist() == [argmax[3 + 1]]  # the argmax after node 3
    short = tree_greedy_verify(logits, node_ids, parents, torch.tensor([3]))  # node 3 is padding
    assert short.accepted.tolist() == [2] and short.next_token.tolist() == [6]


def run_tree(target_table: torch.Tensor, seed: int, nodes: int = 6) -> torch.Tensor:
    """Decode N rows of the Markov chain in lockstep with random point-mass trees (tokens and shapes
    random per row and step) until each has >= 3 tokens; return [N, 3] first committed tokens."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((N, 3 * (nodes + 1)), -1, dtype=torch.long)
    count = torch.zeros(N, dtype=torch.long)
    last = torch.full((N,), X0, dtype=torch.long)
    index = torch.arange(nodes)
    for _ in range(3):
        parents = (torch.rand(N, nodes, generator=g) * (index + 1)).long() - 1  # [N, K] each in -1 .. i-1
        node_ids = torch.randint(0, VOCAB, (N, nodes), generator=g)
        lengths = torch.randint(0, nodes + 1, (N,), generator=g)
        context = torch.cat([last[:, None], node_ids], 1)  # [N, K+1]: the token each column follows
        verdict = tree_point_mass_sample(target_table[context], node_ids, parents, lengths, g)
        last = commit_verdict(out, count, node_ids.gather(1, verdict.path), verdict)  # the path, [N, K]
    return out[:, :3]


@pytest.mark.parametrize("params", [SamplingParams(True, 1.0), SamplingParams(True, 0.7, top_k=4)],
                         ids=["plain", "top_k"])
def test_point_mass_tree_sampling_commits_the_target_distribution(params):
    target_table, _ = markov_tables(params)
    first = run_tree(target_table, seed=11)
    assert_same_distribution(joint_counts(first, VOCAB), chain_joint(target_table).flatten())


def drafted_siblings(draft_table: torch.Tensor, last: torch.Tensor, parents: torch.Tensor, replacement: bool,
                     g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node drawn from the draft's distribution after its parent's token (``draft_table``),
    with or without its earlier siblings' tokens -> (node_ids [N, K], probs [N, K, V]: the
    distribution each node was drawn from)."""
    n, k = parents.shape
    node_ids = torch.zeros(n, k, dtype=torch.long)
    probs = torch.zeros(n, k, draft_table.shape[1])
    rows = torch.arange(n)
    for i in range(k):
        p = parents[:, i]
        before = torch.where(p >= 0, node_ids[rows, p.clamp(min=0)], last)  # [N] the parent's token
        q = draft_table[before].clone()  # [N, V]
        if not replacement:
            for j in range(i):  # an earlier sibling's token is not drawn again
                sibling = parents[:, j] == p
                q[rows[sibling], node_ids[sibling, j]] = 0.0
            q = q / q.sum(dim=-1, keepdim=True)
        probs[:, i] = q
        node_ids[:, i] = torch.multinomial(q, 1, generator=g)[:, 0]
    return node_ids, probs


def run_stochastic_tree(target_table: torch.Tensor, draft_table: torch.Tensor, replacement: bool, seed: int,
                        nodes: int = 5, claim_target: bool = False) -> torch.Tensor:
    """As :func:`run_tree`, with nodes drawn from the draft (``drafted_siblings``) and verified by
    recursive rejection (``claim_target``: told they were drawn from the target's own distribution,
    a wrong claim); -> [N, 3] first committed tokens."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((N, 3 * (nodes + 1)), -1, dtype=torch.long)
    count = torch.zeros(N, dtype=torch.long)
    last = torch.full((N,), X0, dtype=torch.long)
    index = torch.arange(nodes)
    for _ in range(3):
        parents = (torch.rand(N, nodes, generator=g) * (index + 1)).long() - 1
        node_ids, probs = drafted_siblings(draft_table, last, parents, replacement, g)
        lengths = torch.randint(0, nodes + 1, (N,), generator=g)
        context = torch.cat([last[:, None], node_ids], 1)
        if claim_target:
            probs = target_table[context.gather(1, parents + 1)]  # [N, K, V] the target after each parent
        verdict = tree_speculative_sample(target_table[context], node_ids, parents, lengths, probs, g)
        last = commit_verdict(out, count, node_ids.gather(1, verdict.path), verdict)
    return out[:, :3]


@pytest.mark.parametrize("replacement, params", [(True, SamplingParams(True, 1.0)),
                                                 (True, SamplingParams(True, 0.7, top_k=4)),
                                                 (False, SamplingParams(True, 1.0)),
                                                 (False, SamplingParams(True, 0.6))],
                         ids=["with_replacement", "with_replacement_top_k", "without", "without_cold"])
def test_drafted_siblings_by_recursive_rejection_commit_the_target_distribution(replacement, params):
    target_table, draft_table = markov_tables(params)
    first = run_stochastic_tree(target_table, draft_table, replacement, seed=13)
    assert_same_distribution(joint_counts(first, VOCAB), chain_joint(target_table).flatten())


def test_siblings_judged_against_the_wrong_draft_distribution_are_caught():
    """The same check on nodes verified as if drawn from the target itself (every first sibling
    accepted: the committed tokens follow the draft) fails, so the test above can fail."""
    target_table, draft_table = markov_tables(SamplingParams(True, 1.0))
    first = run_stochastic_tree(target_table, draft_table, True, seed=13, claim_target=True)
    with pytest.raises(AssertionError, match="biased|total variation"):
        assert_same_distribution(joint_counts(first, VOCAB), chain_joint(target_table).flatten())


# -- greedy, end to end -----------------------------------------------------------------------------
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_prompt_lookup_trees_match_generate(pairs, arch, cache):
    target, _, _ = pairs(arch)
    for ids in (CONTESTED, torch.randint(3, 11, (1, 40), generator=torch.Generator().manual_seed(1))):
        ref = reference(target, ids, 32)
        out = SpecDecoder(target, "prompt_lookup", tree=True, schedule="fixed", num_tokens=6,
                          cache_implementation=cache).generate(ids, max_new_tokens=32)
        assert torch.equal(out.sequences, ref)
        if ids is CONTESTED:  # the first step's lookup was a tree, verified as one
            assert out.stats.tree_steps >= 1 and out.stats.tree_nodes > out.stats.tree_depth
            assert "trees" not in out.stats.choices


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_a_right_branch_after_a_wrong_sibling_is_accepted(pairs, arch, cache):
    target, _, _ = pairs(arch)
    ids = CONTESTED
    ref = reference(target, ids, 30)
    tree = SpecDecoder(target, Oracle(ref, [0]), cache_implementation=cache).generate(ids, max_new_tokens=30)
    chain = SpecDecoder(target, Oracle(ref, [0], chain=True), cache_implementation=cache).generate(
        ids, max_new_tokens=30)
    assert torch.equal(tree.sequences, ref) and torch.equal(chain.sequences, ref)
    assert tree.stats.tree_steps > 0 and tree.stats.tree_depth == 3 * tree.stats.tree_steps  # t1, t2, t3 every step
    assert chain.stats.accepted_tokens == chain.stats.steps - 1 or chain.stats.acceptance_rate <= 0.5
    assert tree.stats.mean_accepted_length > chain.stats.mean_accepted_length + 1


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_a_left_padded_batch_with_a_tree_per_row(pairs, arch, cache):
    target, _, _ = pairs(arch)
    rows = [CONTESTED[0], torch.randint(3, 11, (9,), generator=torch.Generator().manual_seed(4)),
            torch.tensor([20, 21, 22, 23, 20, 21, 24, 25, 20, 21, 22])]
    padded, mask = left_pad(rows, pad_id=257)
    refs = [reference(target, row[None, :], 24)[0] for row in rows]
    width = padded.shape[1]
    full = [torch.cat([padded[b, : width - row.numel()], refs[b]]) for b, row in enumerate(rows)]
    longest = max(f.numel() for f in full)  # a row that ends early (EOS) is padded after it
    ref = torch.stack([torch.nn.functional.pad(f, (0, longest - f.numel()), value=257) for f in full])
    pads = [width - row.numel() for row in rows]
    for generator in ("prompt_lookup", Oracle(ref, pads)):
        options = {"tree": True, "schedule": "fixed", "num_tokens": 6} if generator == "prompt_lookup" else {}
        out = SpecDecoder(target, generator, cache_implementation=cache, **options).generate(
            padded, mask, max_new_tokens=24)
        for b, row in enumerate(rows):
            want = refs[b][row.numel():]
            assert torch.equal(out.sequences[b, width: width + want.numel()], want), (generator, b)
        assert out.stats.tree_steps > 0


@pytest.mark.parametrize("settings", [{"repetition_penalty": 1.5}, {"no_repeat_ngram_size": 2},
                                      {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3}],
                         ids=["repetition", "no_repeat", "both"])
def test_processors_apply_along_each_nodes_own_path(pairs, settings):
    target, _, _ = pairs("llama")
    for ids in (CONTESTED, torch.randint(3, 11, (1, 30), generator=torch.Generator().manual_seed(2))):
        ref = reference(target, ids, 30, **settings)
        for generator in ("prompt_lookup", Oracle(ref, [0])):
            options = {"tree": True} if generator == "prompt_lookup" else {}
            out = SpecDecoder(target, generator, **options).generate(ids, max_new_tokens=30, **settings)
            assert torch.equal(out.sequences, ref), generator
        assert out.stats.tree_steps > 0


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_draft_model_trees_match_generate(pairs, arch, cache):
    """The draft's chain with its next-best tokens as alternatives: batch 1 and a left-padded batch,
    greedy output identical to generate, and some alternative accepted (the random draft misses often)."""
    target, draft, _ = pairs(arch)
    rows = [torch.randint(3, 40, (12,), generator=torch.Generator().manual_seed(6)), CONTESTED[0]]
    padded, mask = left_pad(rows, pad_id=257)
    for ids, attention in ((rows[0][None, :], None), (padded, mask)):
        out = SpecDecoder(target, draft, tree=True, tree_width=3, schedule="fixed", num_tokens=4,
                          cache_implementation=cache).generate(ids, attention, max_new_tokens=24)
        for b in range(ids.shape[0]):
            row = rows[0] if attention is None else rows[b]
            want = reference(target, row[None, :], 24)[0, row.numel():]
            got = out.sequences[b, ids.shape[1]: ids.shape[1] + want.numel()]
            assert torch.equal(got, want), (arch, cache, b)
        assert out.stats.tree_steps > 0 and out.stats.tree_nodes > out.stats.tree_depth


def test_draft_model_trees_keep_processors_along_each_path(pairs):
    target, draft, _ = pairs("llama")
    ids = torch.randint(3, 40, (1, 14), generator=torch.Generator().manual_seed(8))
    settings = {"repetition_penalty": 1.4, "no_repeat_ngram_size": 3}
    out = SpecDecoder(target, draft, tree=True, schedule="fixed", num_tokens=3).generate(ids, max_new_tokens=30, **settings)
    assert torch.equal(out.sequences, reference(target, ids, 30, **settings))
    assert out.stats.tree_steps > 0


def test_alternatives_go_where_the_draft_expects_its_chain_to_fail_within_the_budget():
    scores = [torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 2), torch.tensor([[0.0, 0.2, 0.1, -9.0]] * 2)]
    chain = Proposal(torch.tensor([[0, 1]] * 2), torch.tensor([2, 2]), confidence=torch.tensor([[0.97, 0.36]] * 2))
    tree = with_siblings(chain, scores, torch.tensor([3, 6]), width=3, generator=None)
    # row 0 has room for one alternative: token 2 at depth 1 (0.97 * 0.33 against 0.02 for token 1 at
    # depth 0); row 1 for all four, two a depth, each a leaf under the chain's node before it
    assert tree.lengths.tolist() == [3, 6]
    assert tree.token_ids[0, :3].tolist() == [0, 1, 2] and tree.parents[0, :3].tolist() == [-1, 0, 0]
    assert tree.token_ids[1].tolist() == [0, 1, 1, 2, 2, 0] and tree.parents[1].tolist() == [-1, 0, -1, -1, 0, 0]
    assert with_siblings(chain, scores, torch.tensor([2, 2]), width=3, generator=None) is chain  # no room: the chain
    # priced: the best alternative (0.32 tokens) pays 0.3, the next (0.29) does not; none pays 0.5
    priced = with_siblings(chain, scores, torch.tensor([6, 6]), width=3, generator=None, prices=torch.full((4,), 0.3))
    assert priced.lengths.tolist() == [3, 3] and priced.token_ids[:, 2].tolist() == [2, 2]
    assert with_siblings(chain, scores, torch.tensor([6, 6]), 3, None, prices=torch.full((4,), 0.5)) is chain


def test_self_draft_trees_match_generate(pairs):
    target, _, _ = pairs("llama")
    ids = torch.randint(3, 40, (1, 16), generator=torch.Generator().manual_seed(9))
    for lookup in (True, False):
        out = SpecDecoder(target, "self_draft", weights="bfloat16", compile_draft=False, lookup=lookup, tree=True,
                          schedule="fixed", num_tokens=3).generate(ids, max_new_tokens=30)  # no policy: no prices
        assert torch.equal(out.sequences, reference(target, ids, 30)), lookup
        assert out.stats.tree_steps > 0, lookup


@pytest.mark.parametrize("options, problem", [({"tree": "yes"}, "tree must be True or False"),
                                              ({"tree_width": 1}, "tree_width must be an int >= 2")])
def test_bad_tree_options_are_refused(pairs, options, problem):
    _, draft, _ = pairs("llama")
    with pytest.raises((TypeError, ValueError), match=problem):
        DraftModelGenerator(draft, **options)


def test_a_tree_step_teaches_the_policy_the_chain_of_its_depth():
    """Nodes beside the accepted path are not deep positions that failed: the policy and the
    generator learn a tree step as the chain of its depth, the statistics still count its nodes."""
    parents = torch.tensor([[-1, 0, 1, 0, -1], [-1, -1, 0, 0, 0]])
    depth = Layout.tree(parents, lengths=torch.tensor([5, 2])).deepest()
    assert depth.tolist() == [3, 1]
    counts = dict(asked=torch.tensor([5, 5]), made=torch.tensor([5, 2]), candidates=torch.tensor([5, 2]),
                  kept=torch.tensor([3, 1]), room=torch.tensor([9, 9]))
    record = StepRecord(torch.tensor([5, 2]), torch.tensor([2, 0]), **counts, tree=True, depth=depth)
    view = record.drafter_view()
    assert (view.offered.tolist(), view.accepted.tolist(), view.made.tolist(), view.tree) == ([3, 1], [2, 0], [3, 1], False)
    assert record.offered.tolist() == [5, 2]


# -- sampling, end to end ---------------------------------------------------------------------------
class Siblings(CandidateGenerator):
    """Two point-mass siblings at the root, and a child under the second where room allows."""

    name = "siblings"

    def drafting(self) -> DraftingInfo:
        return DraftingInfo(max_drafts=None)

    def propose(self, ctx, max_drafts):
        room = int(max_drafts.min())
        nodes = [(1, -1), (2, -1), (3, 1)][: max(room, 0)]
        return Proposal.from_tree([nodes] * ctx.batch_size)


def _sample_three_tokens(generator: CandidateGenerator, seed: int):
    """N samples of three new tokens with ``generator``'s trees -> (the output, the new tokens'
    joint counts, the target's exact joint distribution)."""
    target = tiny_vocab_llama(0)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]])
    params = SamplingParams(True, 0.8, top_k=6)
    out = SpecDecoder(target, generator).generate(
        prompt.repeat(N, 1), max_new_tokens=3, do_sample=True, temperature=params.temperature, top_k=params.top_k,
        generator=torch.Generator().manual_seed(seed))
    new = out.sequences[:, prompt.shape[1]:]
    return out, joint_counts(new, TINY_VOCAB), exact_three_token_joint(target, prompt, params)


def test_tree_sampling_end_to_end_samples_the_target_distribution():
    out, counts, exact = _sample_three_tokens(Siblings(), seed=0)
    assert out.stats.tree_steps >= N and 0 < out.stats.tree_depth < out.stats.tree_nodes
    assert_same_distribution(counts, exact)


class DrawnSiblings(CandidateGenerator):
    """Three root children drawn without replacement from a fixed draft distribution over the tiny
    vocabulary, and a child of the first drawn from it again: a tree whose nodes carry ``probs``."""

    name = "drawn_siblings"

    def __init__(self, seed: int = 5):
        self.gen = torch.Generator().manual_seed(seed)
        self.q = torch.softmax(torch.randn(TINY_VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5, -1)

    def drafting(self) -> DraftingInfo:
        return DraftingInfo(max_drafts=None)

    def propose(self, ctx, max_drafts):
        batch, parents = ctx.batch_size, [-1, -1, -1, 0]
        ids = torch.zeros(batch, 4, dtype=torch.long)
        probs = torch.zeros(batch, 4, TINY_VOCAB)
        for i, parent in enumerate(parents):
            q = self.q.expand(batch, -1).clone()
            if parent == -1:  # root children: without the earlier ones' tokens
                for j in range(i):
                    q[torch.arange(batch), ids[:, j]] = 0.0
                q = q / q.sum(-1, keepdim=True)
            probs[:, i], ids[:, i] = q, torch.multinomial(q, 1, generator=self.gen)[:, 0]
        room = max_drafts.clamp(max=4).to(torch.long)
        return Proposal(ids, room, probs=probs, parents=torch.tensor([parents] * batch))


def test_a_tree_of_drawn_siblings_samples_the_target_distribution_end_to_end():
    out, counts, exact = _sample_three_tokens(DrawnSiblings(), seed=1)
    assert out.stats.tree_steps >= N and out.stats.tree_depth > 0
    assert_same_distribution(counts, exact)


def test_a_draft_models_drawn_alternatives_sample_the_target_distribution_end_to_end():
    """draft_model's trees under sampling: its chain sampled, alternatives drawn without replacement
    from what is left of its distribution, verified by recursive rejection (docs/trees.md)."""
    # a first step of three new tokens has room for two nodes: the sampled chain token and one alternative
    generator = DraftModelGenerator(tiny_vocab_llama(3), tree=True, schedule="fixed", num_tokens=1)
    out, counts, exact = _sample_three_tokens(generator, seed=2)
    assert out.stats.tree_steps > 0 and out.stats.tree_nodes > out.stats.tree_depth
    assert_same_distribution(counts, exact)


# -- refusals ---------------------------------------------------------------------------------------
class Fixed(CandidateGenerator):
    name = "fixed_tree"

    def __init__(self, parents):
        self.parents = parents

    def drafting(self) -> DraftingInfo:
        return DraftingInfo(max_drafts=None)

    def propose(self, ctx, max_drafts):
        k = len(self.parents)
        return Proposal(torch.full((ctx.batch_size, k), 7), torch.full((ctx.batch_size,), k),
                        parents=torch.tensor([self.parents] * ctx.batch_size))


@pytest.mark.parametrize("parents,problem", [([-1, 2, 0], "at or after its child"), ([-1, 5], "out of range"),
                                             ([-1, -3], "out of range"), ([-1, 1], "at or after its child")])
def test_a_malformed_tree_is_refused_naming_the_plugin(pairs, parents, problem):
    target, _, _ = pairs("llama")
    with pytest.raises(ValueError, match=f"'fixed_tree'.*{problem}"):
        SpecDecoder(target, Fixed(parents)).generate(CONTESTED, max_new_tokens=8)
