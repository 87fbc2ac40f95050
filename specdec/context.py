"""What a candidate generator is given during one call: :class:`DecodeContext`, and the small
protocols that type what it reads (docs/plugins.md).

The context answers from the run's parts without handing them over: the committed rows
(:class:`CommittedRows`, the target's state as read only), the assistants a generator attaches
(:class:`AssistantHandle`, implemented by :class:`specdec.assistant.Assistant`), the draft-length
policy (:class:`DraftAdvice`) and the stopper's end test. This module imports nothing of the run,
so the plugin API (``specdec.generators``, which re-exports it) sits below everything that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from .host import host_ints
from .modelinfo import vocab_size
from .sampling import SamplingParams


class CommittedRows(Protocol):
    """The committed tokens of a call's rows, as the context reads them (the target's state)."""

    @property
    def tokens(self) -> torch.Tensor: ...  # [B, L] long, row b valid in [:lengths[b]]

    @property
    def lengths(self) -> torch.Tensor: ...  # [B] long

    @property
    def batch_size(self) -> int: ...

    def token_lists(self) -> list[list[int]]: ...  # each row's tokens[b, :lengths[b]] as a host list


class AssistantHandle(Protocol):
    """What a generator may do with a model it attached (``ctx.attach``): the controller owns its
    cache and keeps it in step; :class:`specdec.assistant.Assistant` says what each method does."""

    @property
    def model(self) -> Any: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def lengths(self) -> torch.Tensor: ...

    def row(self, b: int, start: int = 0, end: int | None = None) -> list[int]: ...

    def next_logits(self) -> torch.Tensor: ...

    def feed(self, ids: torch.Tensor, counts: torch.Tensor | None = None) -> None: ...

    def rewrite(self, keep: Sequence[int] | torch.Tensor, tails: Sequence[Sequence[int]]) -> None: ...


class DraftAdvice(Protocol):
    """The draft-length policy as a generator's context asks it during ``propose``, for the step
    it planned (``ctx.draft_rate``, ``ctx.keep_drafting``, ``ctx.node_prices``); see
    ``specdec.policy.DraftPolicy``."""

    def step_rate(self, counts: torch.Tensor, source: int, paid: bool = False) -> torch.Tensor | None: ...

    def step_keep(self, confidence: torch.Tensor, max_drafts: torch.Tensor) -> bool: ...

    def step_node_prices(self, confidence: torch.Tensor) -> torch.Tensor | None: ...


@dataclass
class DecodeContext:
    """What a generator may read and use during one ``generate()`` call. Built by the run with
    everything it answers from: the target's state, the run's ``attach``, the draft-length
    policy (None when the generator sets its own draft lengths) and the stopper's end test."""

    target: Any
    tokenizer: Any
    draft_tokenizer: Any
    sampling: SamplingParams
    generator: torch.Generator | None
    model_inputs: dict[str, Any]
    _target_state: CommittedRows = field(repr=False)
    _attach: Callable[..., AssistantHandle] = field(repr=False)
    _advice: DraftAdvice | None = field(default=None, repr=False)
    _ended: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    _scores: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = field(default=None, repr=False)
    #: whether an assistant may mirror the target's cache (``attach(prefill_from_target=True)``):
    #: False where the engine keeps the target's keys and values itself (``engine="llama_cpp"``)
    can_mirror: bool = True

    def scores(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """[B, V] a drafter's logits in the target's token ids, at the position after the committed
        tokens and ``drafts [B, i]`` (this step's drafts so far) -> the scores the call's logits
        processors give there, as ``model.generate()`` computes them (repetition penalty, bad
        words, ..., and the warpers when sampling): drafting from them makes drafts the target
        accepts more often. The logits unchanged when the call has no processors."""
        return logits if self._scores is None else self._scores(logits, drafts)

    @property
    def processed(self) -> bool:
        """Whether the call has processors, so :meth:`scores` may change a drafter's logits."""
        return self._scores is not None

    def probs(self, scores: torch.Tensor) -> torch.Tensor:
        """[B, V] scores from :meth:`scores` -> [B, V] the distribution to draft from: their softmax
        where the call's processors (warpers included) made them, else ``sampling.probs`` when
        sampling, else the softmax."""
        if self._scores is None and self.sampling.do_sample:
            return self.sampling.probs(scores)
        return torch.softmax(scores.float(), dim=-1)

    @property
    def tokens(self) -> torch.Tensor:
        """[B, L] committed tokens (read only), row b valid in ``[:lengths[b]]`` (prompt included)."""
        return self._target_state.tokens

    @property
    def lengths(self) -> torch.Tensor:
        """[B] committed length per row. During ``propose`` the target holds no drafts yet."""
        return self._target_state.lengths

    def token_lists(self) -> list[list[int]]:
        """Each row's committed tokens as Python lists (read only; prompt included): what
        :attr:`tokens` holds, kept on the host as the call commits, so reading them costs no
        device read on most steps."""
        return self._target_state.token_lists()

    @property
    def batch_size(self) -> int:
        return self._target_state.batch_size

    @property
    def target_vocab_size(self) -> int:
        return vocab_size(self.target)

    def draft_rate(self, counts: torch.Tensor, source: int = 0, paid: bool = False) -> torch.Tensor | None:
        """[B] committed tokens per second the core's draft-length policy expects for row b this
        step if it verifies the best number, up to ``counts[b]``, of drafts from ``source`` (an
        index into ``DraftingInfo.priors``; source 0's measured drafting cost included, other
        sources' drafts taken as free; ``paid``: source 0's too, for drafts made this step
        whatever the row takes, as a batch's draft model steps every row when any row drafts
        from it). A generator with several sources asks it during ``propose`` to draft each row
        from the source that pays most. None when the generator sets its own draft lengths (a
        ``fixed`` or ``adaptive`` schedule: no policy runs), and during ``setup`` (drafting is not
        priced yet)."""
        return None if self._advice is None else self._advice.step_rate(counts, source, paid)

    def keep_drafting(self, drafts: torch.Tensor, confidence: torch.Tensor | None, max_drafts: torch.Tensor) -> bool:
        """Whether to draft one more token this step, asked by a generator that drafts one token at
        a time (``DraftingInfo.stepwise``) after each: ``drafts [B, i]`` the drafts so far,
        ``confidence [B, i]`` its own probabilities of them (None if it has none),
        ``max_drafts [B]`` what ``propose`` was given. False once every row has drafted an end of
        sequence (nothing after it can be kept) or as many as it may; otherwise, under the core's
        policy, while it expects a longer block to pay, valued with these drafts' own acceptance;
        True when the generator sets its own draft lengths."""
        made = drafts.shape[1]
        room = [made < n for n in host_ints(max_drafts)]  # host values: no read where no row can end
        if not any(room):
            return False
        if self._ended is not None and made:  # a row whose last draft ends its sequence drafts no more
            if not bool((torch.tensor(room, device=drafts.device) & ~self._ended(drafts)[:, -1]).any()):
                return False
        if self._advice is None or confidence is None:
            return True
        return self._advice.step_keep(confidence, max_drafts)

    def node_prices(self, confidence: torch.Tensor) -> torch.Tensor | None:
        """What nodes beside a drafted chain (a tree's alternatives) must each be expected to add
        to the step's committed tokens to pay for being verified, asked by a generator that drafts a
        chain one token at a time and then offers alternatives: ``confidence [B, i]`` its own
        probabilities of the chain's drafts -> ``[m]``: the k-th further node's price in tokens, the
        extra forward time it costs at the step's expected tokens per second with the chain alone
        (``m``: as many as the policy lets a row verify beyond the chain). None when the generator
        sets its own draft lengths (no policy: every alternative within ``max_drafts`` is offered)."""
        return None if self._advice is None else self._advice.step_node_prices(confidence)

    def attach(self, model, tokens: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
               pad_token_id: int | None = None, *, cache_implementation: str | None = None,
               compile: bool | dict | None = None, compile_widths: tuple[int, ...] | None = None,
               prefill_from_target: bool = False, owned: bool = False) -> AssistantHandle:
        """Hand an assistant model to the controller; get an :class:`~specdec.assistant.Assistant`.

        Without ``tokens`` the assistant shares the target's token ids and the controller keeps it
        at the committed prefix after every verification. With ``tokens [B, L]`` and ``lengths
        [B]`` (another tokenizer's ids) the generator keeps it in step with ``rewrite``. Either way
        the controller builds its cache, routes prefill-only inputs to its first forward, and drops
        finished rows. ``cache_implementation`` / ``compile`` (as in ``SpecDecoder``) choose how
        this assistant keeps its cache, whatever the call uses (default: as the call);
        ``compile_widths``: the forward widths to compile (e.g. ``(1, 2)`` for a draft that feeds
        one token per step; wider forwards then run eagerly).

        ``prefill_from_target``: the assistant's cache mirrors the target's: it starts from a copy
        of the keys and values the target's prefill computed and takes those of each verified
        block, so it is fed neither the prompt nor committed tokens, only its drafts and the
        target's newest token. Needs an assistant that shares the target's tokens and its cache
        layout (layers, key/value heads, head size): a copy of the target at lower precision, say.
        The first step then verifies no drafts (the target's prefill has to come first). Only
        where :attr:`can_mirror`.

        ``owned``: the generator built ``model`` and nothing changes it (its modules, their
        attributes, its parameters' shapes) while it is attached: its compiled forwards then run
        a compiled function of its own that skips dynamo's guards on its modules (docs/self_draft.md,
        "No module guards"). Never for the user's models.
        """
        return self._attach(model, tokens, lengths, pad_token_id, cache_implementation, compile, compile_widths,
                            prefill_from_target, owned)
