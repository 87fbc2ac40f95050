"""The ``eagle3`` generator: exact with random and trained heads, lossless under sampling, and
``train-head`` end to end (resumed from its checkpoint), on tiny random targets.

The trained head here is trained by the project's own training-time-test loss on the target's
greedy continuations of random prompts, for a few hundred steps (about a second): enough that
its drafts are accepted often, so the accepting paths of the loop are exercised, not only the
rejecting ones."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import assert_batch_is_exact, left_pad, reference
from test_sampling_lossless import (N, PROMPT, TINY_VOCAB, assert_same_distribution, exact_three_token_joint,
                                    joint_counts, tiny_vocab_llama)

from candidate_generators.eagle3 import Eagle3Head, HeadConfig
from candidate_generators.eagle3.train import TrainSettings, target_features, train_head, ttt_loss
from specdec import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.tiny import tiny_random


def train_prompts(vocab: int, seed: int = 0) -> torch.Tensor:
    """[16, 6] the random prompts a test head is trained on (its drafts are accepted after them)."""
    return torch.randint(0, vocab, (16, 6), generator=torch.Generator().manual_seed(seed))


def trained_head(target, vocab: int, steps: int = 200, seed: int = 0) -> Eagle3Head:
    """A head for ``target`` trained on its own greedy continuations of :func:`train_prompts`."""
    prompts = train_prompts(vocab, seed)
    sequences = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=40,
                                do_sample=False)
    valid = torch.ones_like(sequences, dtype=torch.bool)
    answer = valid.clone()
    answer[:, :6] = False
    config = HeadConfig.for_target(target.config, draft_vocab_size=vocab)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = Eagle3Head(config)
    head.set_vocab(torch.arange(vocab))
    aux, top_ids, top_probs = target_features(target, sequences, valid, config.aux_layers, torch.arange(vocab))
    table = target.get_input_embeddings()
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _, _ = ttt_loss(head, lambda ids: table(ids).detach(), aux.float(), sequences, valid, answer,
                              top_ids.long(), top_probs, 3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


@pytest.fixture(scope="module")
def llama():
    target, tokenizer = tiny_random("llama", seed=3)
    return target.eval(), tokenizer


@pytest.fixture(scope="module")
def heads(llama):
    target, _ = llama
    vocab = target.config.vocab_size
    with torch.random.fork_rng():
        torch.manual_seed(0)
        random = Eagle3Head(HeadConfig.for_target(target.config, draft_vocab_size=vocab // 2))
    random.set_vocab(torch.arange(0, vocab, 2))
    return {"random": random.eval(), "trained": trained_head(target, vocab)}


def prompts(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g) for n in (9, 5)]


@pytest.mark.parametrize("kind", ["random", "trained"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_is_the_target_own_output(llama, heads, kind, cache):
    target, _ = llama
    decoder = SpecDecoder(target, "eagle3", head=heads[kind], cache_implementation=cache, schedule="fixed",
                          num_tokens=3)
    for row in [*prompts(target.config.vocab_size), train_prompts(target.config.vocab_size)[0]]:
        out = decoder.generate(row[None], max_new_tokens=30)
        assert torch.equal(out.sequences, reference(target, row[None], 30))
    assert_batch_is_exact(decoder, target)
    if kind == "trained":  # on a prompt it was trained after, the head's drafts are accepted
        assert out.stats.mean_accepted_length > 1.5, out.stats.summary()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_trees_are_exact_and_accept_deeper(llama, heads, cache):
    """``tree=True`` drafts a dynamic tree from the head: greedy output is still the target's, and on
    a prompt the head was trained after, its trees are accepted beyond their first level."""
    target, _ = llama
    row = train_prompts(target.config.vocab_size)[1][None]
    depth = {}
    for tree in (False, True):
        decoder = SpecDecoder(target, "eagle3", head=heads["trained"], tree=tree, schedule="fixed", num_tokens=6,
                              cache_implementation=cache)
        out = decoder.generate(row, max_new_tokens=30)
        assert torch.equal(out.sequences, reference(target, row, 30))
        depth[tree] = out.stats.mean_accepted_length
        assert_batch_is_exact(decoder, target)
    assert out.stats.tree_steps > 0
    assert depth[True] > 1.3 and depth[False] > 1.3, depth


@pytest.mark.parametrize("tree", [False, True])
def test_one_token_prompts_draft_once_a_pair_exists(llama, heads, tree):
    """A one-token row has no (feature, next token) pair for the head: it drafts nothing at first,
    alone or beside longer rows (it crashed on both)."""
    target, _ = llama
    decoder = SpecDecoder(target, "eagle3", head=heads["trained"], tree=tree, schedule="fixed", num_tokens=4)
    for ids, mask in [(torch.tensor([[5]]), None), left_pad([torch.tensor([5]), torch.tensor([5, 6, 7])], pad_id=0)]:
        want = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        assert torch.equal(decoder.generate(ids, mask, max_new_tokens=12).sequences, want)


def test_left_padded_batch_with_processors(llama, heads):
    target, _ = llama
    rows = prompts(target.config.vocab_size)
    ids, mask = left_pad(rows, pad_id=0)
    decoder = SpecDecoder(target, "eagle3", head=heads["trained"])
    out = decoder.generate(ids, mask, max_new_tokens=20, repetition_penalty=1.3)
    for b, row in enumerate(rows):
        want = reference(target, row[None], 20, repetition_penalty=1.3)[0, row.numel():]
        assert torch.equal(out.sequences[b, ids.shape[1]: ids.shape[1] + want.numel()], want), b


def test_drafts_without_processors_are_those_the_processed_scores_give(llama, heads):
    """Greedy drafting without processors takes the argmax over the draft vocabulary's own columns;
    a processor that changes nothing sends the head's logits through the target's vocabulary
    instead: the same drafts, so the same acceptance, step by step."""
    target, _ = llama
    vocab = target.config.vocab_size
    row = train_prompts(vocab)[0][None]
    # the trained head cut to a draft vocabulary of its own: the ids the target writes after the
    # prompt, and every third id, so that draft index and target id differ
    keep = torch.tensor(sorted(set(reference(target, row, 30)[0].tolist()) | set(range(0, vocab, 3))))
    trained = heads["trained"]
    head = Eagle3Head(HeadConfig(**{**trained.config.to_dict(), "draft_vocab_size": keep.numel()}))
    head.load_state_dict({k: v[keep] if k == "lm_head.weight" else v for k, v in trained.state_dict().items()
                          if k not in ("d2t", "t2d")}, strict=False)
    head.set_vocab(keep)
    stats = []
    for processors in ([], [lambda ids, scores: scores]):
        decoder = SpecDecoder(target, "eagle3", head=head.eval(), schedule="fixed", num_tokens=3)
        out = decoder.generate(row, max_new_tokens=30, logits_processor=processors)
        assert torch.equal(out.sequences, reference(target, row, 30))
        stats.append((out.stats.steps, out.stats.drafted_tokens, out.stats.accepted_at_position))
    assert stats[0] == stats[1], stats
    assert stats[0][0] < 20, stats  # the trained head's drafts are accepted: fewer steps than 30 tokens ask


@pytest.fixture(scope="module")
def tiny_vocab():
    target = tiny_vocab_llama(0)
    return target, trained_head(target, TINY_VOCAB, steps=150)


@pytest.mark.parametrize("tree", [False, True])
def test_sampling_is_the_target_distribution(tiny_vocab, tree):
    """Chains carry the head's probabilities (speculative sampling); trees are point masses (the
    target sampled, descending where a child holds its token). Either way: the target's law."""
    target, head = tiny_vocab
    params = SamplingParams(True, 0.8, top_k=6)
    decoder = SpecDecoder(target, "eagle3", head=head, num_tokens=3, schedule="fixed", tree=tree, tree_width=2)
    out = decoder.generate(PROMPT.repeat(N, 1), max_new_tokens=3, do_sample=True, temperature=params.temperature,
                           top_k=params.top_k, generator=torch.Generator().manual_seed(0))
    stats = out.stats
    assert stats.drafted_tokens >= N and 0 < stats.accepted_tokens < stats.drafted_tokens
    assert_same_distribution(joint_counts(out.sequences[:, PROMPT.shape[1]:], TINY_VOCAB),
                             exact_three_token_joint(target, PROMPT, params))


def test_a_head_that_does_not_fit_is_refused_before_any_forward(llama):
    target, _ = llama
    config = HeadConfig.for_target(target.config, draft_vocab_size=16)
    wrong = Eagle3Head(HeadConfig(**{**config.to_dict(), "target_hidden_size": config.target_hidden_size * 2}))
    calls = []
    hook = target.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match="hidden"):
            SpecDecoder(target, "eagle3", head=wrong).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    finally:
        hook.remove()
    assert not calls


def test_train_head_writes_a_head_that_drafts_and_resumes(llama, tmp_path):
    target, tokenizer = llama
    records = [{"key": f"p{i}", "turns": [text]} for i, text in enumerate(["hello there", "write a poem", "count"])]
    settings = TrainSettings(steps=3, draft_vocab_size=64, answer_tokens=12, batch_tokens=64, warmup=1,
                             checkpoint_seconds=0.0)
    folder = train_head(target, tokenizer, tmp_path, settings, prompts=records, progress=False)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    answers = (tmp_path / "answers.jsonl").read_text().splitlines()
    assert len(answers) == 3
    # killed after logging steps 4 and 5 but before their checkpoint, and while writing an answer
    # (the steps were logged twice; the next answer was glued onto the torn line, lost to every rerun)
    with (tmp_path / "log.jsonl").open("a") as file:
        file.write('{"step": 4, "loss": 1.0}\n{"step": 5, "loss": 1.0}\n')
    with (tmp_path / "answers.jsonl").open("a") as file:
        file.write(answers[0][:20])
    # a rerun with a higher limit resumes at step 4 and reuses the answers
    train_head(target, tokenizer, tmp_path, TrainSettings(**{**settings.__dict__, "steps": 5}), prompts=records,
               progress=False)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5]
    assert (tmp_path / "answers.jsonl").read_text().splitlines() == answers
    decoder = SpecDecoder(target, "eagle3", head=folder)
    row = prompts(target.config.vocab_size)[0][None]
    assert torch.equal(decoder.generate(row, max_new_tokens=16).sequences, reference(target, row, 16))


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_train_head_takes_a_target_whose_config_names_its_mlp_otherwise(arch, tmp_path):
    """GPT-2 (n_inner, None for 4x) and OPT (ffn_dim) have no intermediate_size: the head's shape
    failed after the whole self-distillation."""
    target, tokenizer = tiny_random(arch)
    settings = TrainSettings(steps=1, draft_vocab_size=64, answer_tokens=8, batch_tokens=64, warmup=1)
    folder = train_head(target, tokenizer, tmp_path, settings, prompts=[{"key": "p", "turns": ["hello there"]}],
                        progress=False)
    row = prompts(target.config.vocab_size)[0][None]
    assert torch.equal(SpecDecoder(target, "eagle3", head=folder).generate(row, max_new_tokens=12).sequences,
                       reference(target, row, 12))


def test_hidden_states_reach_the_generator_as_the_model_computes_them(llama):
    """What ``feedback.hidden`` carries is ``output_hidden_states`` of the committed sequence."""
    from specdec.generators import CandidateGenerator, DraftingInfo, Proposal

    target, _ = llama
    seen = []

    class Recorder(CandidateGenerator):
        name = "recorder"

        def drafting(self):
            return DraftingInfo(max_drafts=None, hidden_layers=(1, 2))

        def propose(self, ctx, max_drafts):
            # drafts that are sometimes right: the target's own continuation shifted by one
            return Proposal.from_rows([[7, 8, 9]] * ctx.batch_size)

        def observe(self, ctx, feedback):
            seen.append(feedback.hidden)

    row = prompts(target.config.vocab_size)[0][None]
    out = SpecDecoder(target, Recorder()).generate(row, max_new_tokens=12)
    with torch.no_grad():
        full = target(out.sequences, output_hidden_states=True).hidden_states
    covered = set()
    for hidden in seen:
        for j in range(int(hidden.count[0])):
            position = int(hidden.start[0]) + j
            covered.add(position)
            for layer in (1, 2):
                torch.testing.assert_close(hidden.states[layer][0, j], full[layer][0, position], atol=1e-5, rtol=1e-5)
    # every committed token but the newest was fed, and reported
    assert covered == set(range(out.sequences.shape[1] - 1))


def test_the_command_trains_on_a_prompt_file_and_refuses_bad_input(tmp_path, capsys):
    from specdec.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"turns": ["one", "two"]}\n')
    out = tmp_path / "run"
    assert main(["train-head", "--target", "tiny-random:llama", "--out", str(out), "--steps", "2",
                 "--prompts", str(prompts), "--answer-tokens", "6", "--draft-vocab", "32", "--threads", "1"]) == 0
    assert (out / "head" / "config.json").is_file()
    assert len((out / "answers.jsonl").read_text().splitlines()) == 3  # the second turn after the first answer
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": []}\n')
    assert main(["train-head", "--out", str(out), "--steps", "1", "--prompts", str(bad)]) == 2
    assert "line 1" in capsys.readouterr().err
    assert main(["train-head", "--out", str(out)]) == 2  # no limit
    # the flag reaches the settings: the tiny model's tokenizer has no chat template to write prompts with
    assert main(["train-head", "--target", "tiny-random:llama", "--out", str(tmp_path / "synthetic"), "--steps", "1",
                 "--synthetic-prompts", "2", "--threads", "1"]) == 2
    assert "chat template" in capsys.readouterr().err


def test_a_generator_asking_for_a_hidden_state_the_target_lacks_is_refused(llama):
    from specdec.generators import CandidateGenerator, DraftingInfo, Proposal

    target, _ = llama

    class Deep(CandidateGenerator):
        name = "deep"

        def drafting(self):
            return DraftingInfo(hidden_layers=(target.config.num_hidden_layers + 1,))

        def propose(self, ctx, max_drafts):
            return Proposal.empty(ctx.batch_size)

    with pytest.raises(ValueError, match=r"'deep' reads hidden state \d+ of LlamaForCausalLM, which has \d+"):
        SpecDecoder(target, Deep()).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)


def test_synthetic_prompts_are_distinct_complete_turns_and_resume(llama, tmp_path, monkeypatch):
    """The target writes user turns after its chat template's opening; a rerun writes the same ones,
    continuing the file, and a tokenizer without a template is refused."""
    from candidate_generators.eagle3.data import synthetic_prompts

    target, tokenizer = llama
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}<eos>{% endfor %}"
                               "{% if add_generation_prompt %}[assistant]{% endif %}")
    end = tokenizer.eos_token_id
    # a random model seldom ends a turn: make its end-of-turn token likely enough to end some
    hook = target.lm_head.register_forward_hook(lambda module, args, out: out.index_add(
        -1, torch.tensor([end]), torch.full((*out.shape[:-1], 1), 4.0)))
    try:
        path = tmp_path / "prompts.jsonl"
        made = synthetic_prompts(target, tokenizer, 6, path, seed=3, batch_size=8, max_tokens=40, progress=False)
        texts = [p["turns"][0] for p in made]
        assert len(texts) == 6 and len(set(texts)) == 6 and all(len(t) >= 16 for t in texts)
        assert [p["key"] for p in made] == [f"synthetic:{i}" for i in range(6)]
        lines = path.read_text().splitlines()
        path.write_text("\n".join(lines[:3]) + "\n")  # an interrupted run kept the first three
        again = synthetic_prompts(target, tokenizer, 6, tmp_path / "fresh.jsonl", seed=3, batch_size=8, max_tokens=40,
                                  progress=False)
        resumed = synthetic_prompts(target, tokenizer, 6, path, seed=3, batch_size=8, max_tokens=40, progress=False)
        assert [p["turns"][0] for p in again] == texts  # the same seed writes the same prompts
        assert [p["turns"][0] for p in resumed][:3] == texts[:3] and len(resumed) == 6
        monkeypatch.setattr(target, "generate", lambda *a, **k: pytest.fail("a finished file generates nothing"))
        assert synthetic_prompts(target, tokenizer, 6, path, seed=3, progress=False) == resumed
    finally:
        hook.remove()
        monkeypatch.undo()
    # a model that never ends a turn within max_tokens: a bounded number of batches, fewer prompts
    assert synthetic_prompts(target, tokenizer, 3, tmp_path / "short.jsonl", batch_size=2, max_tokens=2,
                             progress=False) == []
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        synthetic_prompts(target, plain, 2, tmp_path / "none.jsonl", progress=False)
