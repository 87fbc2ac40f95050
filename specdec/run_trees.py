"""TreeSteps: a step's token trees (docs/trees.md), from the proposal's check to its verdict.

A mixin of :class:`~specdec.run.DecodeRun`: its methods read the run's target, settings and
processors, and keep the call's tree engine and refusal (``_tree_engine``, ``_tree_refusal``).
It checks a proposal's ``parents``, decides whether the step verifies the tree or its leading
chain, processes each node's scores along its own path and verifies the tree from the root;
:func:`_columns` picks a block's columns.
"""

from __future__ import annotations

import dataclasses

import torch

from .accepted import keep_path
from .distributed import Solo
from .engines import Layout, LayoutNotSupported
from .generators import Proposal
from .verify import TreeVerdict, leaf_chains, tree_greedy_verify, tree_point_mass_sample, tree_speculative_sample


class TreeSteps:
    def _check_tree(self, proposal: Proposal) -> None:
        """A proposal's ``parents`` must be a well-formed tree over its drafts; name the plugin if not."""
        where = f"candidate generator {self.plugin!r}"
        parents = proposal.parents
        if not isinstance(parents, torch.Tensor) or tuple(parents.shape) != tuple(proposal.token_ids.shape):
            got = tuple(parents.shape) if isinstance(parents, torch.Tensor) else type(parents).__name__
            raise ValueError(f"{where}: Proposal.parents must be None or a long tensor shaped like token_ids "
                             f"{tuple(proposal.token_ids.shape)}, got {got}")
        try:
            Layout.tree(parents, lengths=proposal.lengths.to(parents.device))
        except ValueError as error:
            raise ValueError(f"{where}: Proposal.parents: {error}") from None

    def _tree_or_chain(self, proposal: Proposal, offered: torch.Tensor) -> tuple[Proposal, torch.Tensor]:
        """A checked tree proposal and the nodes admitted per row [B] -> the proposal this step
        verifies: the tree itself, or its leading chain where the step cannot verify a tree (or the
        nodes admitted form a chain in every row, which the chain's faster path verifies)."""
        # a first forward's prefill-only inputs (images) pass with the first step: trees after it
        passing = self.target.is_first_iteration and bool(self.target.prefill_inputs)
        reason = self._tree_refusal or (None if passing else self._tree_problem())
        if reason is not None and self._tree_refusal is None:
            self._tree_refusal = reason  # for the rest of the call
            self.stats.choices["trees"] = f"verified as chains: {reason}"
        if reason is None and not passing and not proposal.is_chain(offered):
            return proposal, offered
        cut = dataclasses.replace(proposal,
                                  lengths=torch.minimum(proposal.lengths, offered.to(proposal.lengths.device)))
        chain = cut.leading_chain()
        return chain, torch.minimum(offered, chain.lengths.to(offered.device))

    def _tree_problem(self) -> str | None:
        """Why this call cannot verify trees (None: it can): a distributed call, or a model neither
        the CPU engine's stack nor the eager engine runs a tree layout on."""
        if not isinstance(self.ranks, Solo):
            return "a distributed call"
        if not self.target.kv.trees:
            return f"engine={self._engine!r} verifies chains"
        if self._tree_engine is None:  # the engine of the target's chain forwards: the CPU engine runs
            self._tree_engine = self.target.kv.chain.engine()  # a tree through its stack where it serves the model
        try:
            self._tree_engine.check_tree_support(self.target.kv.cache)
        except LayoutNotSupported as error:
            return str(error)
        return None

    def _tree_step(self, logits: torch.Tensor, node_ids: torch.Tensor, parents: torch.Tensor, offered: torch.Tensor,
                   committed: torch.Tensor, probs: torch.Tensor | None):
        """A tree's forward's logits [B, k+1, V] -> the step as the chain it accepted: (scores, logits,
        node ids) in that chain's order, the verdict, a grammar's dead end along it (None: none) and
        the tree's depth [B]; the target's cache keeps the accepted nodes' entries in chain order."""
        scores = self._tree_scores(logits, node_ids, parents, offered, committed)  # [B, k+1, V]
        verifiable, dead_columns = self._tree_dead_ends(scores)  # a grammar's columns that allow nothing
        verdict = self._verify_tree(verifiable, node_ids, parents, offered, probs)
        columns = torch.cat([torch.zeros_like(verdict.path[:, :1]), verdict.path + 1], dim=1)  # [B, k+1]
        scores, logits = (_columns(x, columns) for x in (scores, logits))
        dead = None
        if dead_columns is not None:  # the first such column along the accepted path, as a chain's
            _, dead = self._dead_ends(scores, verdict.accepted)
        keep_path(self.target, committed, verdict.path, verdict.accepted)
        depth = Layout(parents=parents, lengths=offered).deepest()  # checked when proposed
        return scores, logits, node_ids.gather(1, verdict.path), verdict, dead, depth

    def _tree_scores(self, logits: torch.Tensor, node_ids: torch.Tensor, parents: torch.Tensor,
                     offered: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
        """A tree's logits [B, k+1, V] (column i+1: after node i) -> the scores ``generate()`` would
        compute at each column given that node's own path: the processors are applied once per
        leaf rank, over the chains from the root to each row's l-th leaf (a chain block as
        :meth:`_scores` processes one), and each column takes its scores from a chain through it."""
        if self.processors is None:
            return logits.float()
        target = self.target
        chains, depths = leaf_chains(parents, offered)  # [L, B, k] node indices, [L, B]
        out = logits.float().clone()
        rows = torch.arange(out.shape[0], device=out.device)[:, None]
        for path, depth in zip(chains, depths):
            width = int(depth.max())
            path = path[:, :width]  # [B, d]
            columns = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1)  # [B, d+1]
            pos = self.processors.positions(target.tokens, committed, self.prompt_lengths, self.row_ids,
                                            node_ids.gather(1, path), depth + 1)
            processed = self.processors.apply(_columns(logits.float(), columns), pos)  # [B, d+1, V]
            if processed.dtype != out.dtype:
                out = out.to(processed.dtype)
            valid = torch.arange(width + 1, device=out.device)[None, :] <= depth[:, None]  # [B, d+1]
            out[rows.expand_as(columns)[valid], columns[valid]] = processed[valid]
        return out

    def _tree_dead_ends(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Under a grammar, a tree's scores [B, k+1, V] with every column that allows no token at all
        scored uniformly (so a verdict can be drawn; one that reaches such a column ends the run, as
        a chain's does) -> (those scores, the columns [B, k+1] bool), or (scores, None)."""
        if self.processors is None or self.processors.grammar is None:
            return scores, None
        dead = scores.amax(dim=-1).isneginf()  # [B, k+1]
        if not bool(dead.any()):
            return scores, None
        return scores.masked_fill(dead[..., None], 0.0), dead

    def _verify_tree(self, scores: torch.Tensor, node_ids: torch.Tensor, parents: torch.Tensor,
                     offered: torch.Tensor, probs: torch.Tensor | None = None) -> TreeVerdict:
        """A tree's scores [B, k+1, V] -> its verdict: greedy; or sampled: the target sampled from
        the root down where a point-mass child holds the sampled token, or, with the nodes' draft
        distributions ``probs [B, k, V]``, recursive rejection over each node's children
        (specdec/verify.py)."""
        sampling = self.settings.sampling
        if not sampling.do_sample:
            return tree_greedy_verify(scores, node_ids, parents, offered)
        target_probs = torch.softmax(scores, dim=-1) if self.processors is not None else sampling.probs(scores)
        if probs is not None:
            return tree_speculative_sample(target_probs.float(), node_ids, parents, offered,
                                           probs[:, : node_ids.shape[1]], self.settings.generator)
        return tree_point_mass_sample(target_probs.float(), node_ids, parents, offered, self.settings.generator)


def _columns(x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """x [B, T, V], columns [B, C] -> x[b, columns[b, c]]: [B, C, V]."""
    return x.gather(1, columns[..., None].expand(-1, -1, x.shape[-1]))
