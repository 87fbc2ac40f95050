"""OutputSteps: finished rows leave the batch, and the call's output is built from them.

A mixin of :class:`~specdec.run.DecodeRun`: its methods read the run's states, stopper, session,
policy and statistics. Finished rows' new tokens become output and the rows leave every state,
the session and the policy; at the end the outputs, the scores and logits kept and the
statistics (with each model's engine and the generator's report) make the :class:`SpecOutput`.
"""

from __future__ import annotations

import time

import torch

from .engines import engine_report, packed_weights_report
from .host import host_ints, host_long, hosted
from .outputs import SpecOutput
from .state import ModelState


class OutputSteps:
    def _retire(self, finished: torch.Tensor) -> None:
        """Finished rows [B] bool leave the batch; their new tokens become output."""
        target, done = self.target, host_ints(finished)
        row_ids, prompts, lengths = (host_ints(t) for t in (self.row_ids, self.prompt_lengths, target.lengths))
        for b in (b for b, gone in enumerate(done) if gone):
            self.outputs[row_ids[b]] = target.tokens[b, prompts[b]: lengths[b]].clone()
        kept = [b for b, gone in enumerate(done) if not gone]
        rest = host_long(kept, finished.device)
        self.row_ids = hosted(self.row_ids[rest], [row_ids[b] for b in kept])
        self.prompt_lengths = hosted(self.prompt_lengths[rest], [prompts[b] for b in kept])
        self.stopper.select_rows(rest)
        if rest.numel():
            for state in self.states():
                state.select_rows(rest)
            self.session.select_rows(rest)
            if self.policy is not None:
                self.policy.select_rows(rest)

    def _engine_report(self) -> str:
        """What ran each model's forwards (``stats.choices["engine"]``): "target: ...", then each
        assistant's (a copy or a draft model) as "assistant i: ...", joined by " | "."""
        def said(state: ModelState) -> str:
            return engine_report(state.model, state.kv.settings.engine, state.kv.settings.fast_head)

        parts = [f"target: {said(self.target)}"]
        parts += [f"assistant {i}: {said(state)}" for i, state in enumerate(self.assistants)]
        return " | ".join(parts)

    def finish(self, input_ids: torch.Tensor, started: float) -> SpecOutput:
        """-> sequences [B, P + new] (the prompt as given, then each row's new tokens right-padded),
        the scores and logits asked for, and the statistics."""
        self.feed.end()
        report = self.session.report()  # counters; words (a choice and its reason) go to stats.choices
        self.stats.generator = {k: v for k, v in report.items() if not isinstance(v, str)}
        self.stats.choices.update({k: v for k, v in report.items() if isinstance(v, str)})
        packed = None if self.settings.cache.own_forward else packed_weights_report(self.target.model)
        if packed is not None:
            self.stats.choices["packed_weights"] = packed
        self.stats.choices["engine"] = self._engine_report()
        self.stats.total_seconds = time.perf_counter() - started
        if self.processors is not None:
            self.stats.processor_seconds = self.processors.seconds
        # generate()'s steps: a row that went on past its stop (unpadded) may hold more
        longest = self.stopper.length() or max(o.numel() for o in self.outputs)
        new = input_ids.new_full((input_ids.shape[0], longest), self.settings.pad)
        for b, o in enumerate(self.outputs):
            new[b, : min(o.numel(), longest)] = o[:longest]
        scores, logits = self.recorder.tuples(longest)
        return SpecOutput(sequences=torch.cat([input_ids, new], dim=1), scores=scores, logits=logits, stats=self.stats)
