"""The report's sections on how each method decoded: structured output, token trees, the compile
warm-up, the choices it made on this machine, the draft lengths it chose.
"""

from __future__ import annotations

from ..metrics import AcceptanceStats
from .report_tables import MAX_POSITIONS, NA, _f, _table
from .results import FORWARD_COST_PNG, OVERALL, is_batched
from .summary import Summary, method_stats


def k_distribution(stats: AcceptanceStats, shown: int = MAX_POSITIONS) -> str:
    """``"K: share, ..."``: every draft length verified at least once, as a share of row-steps
    (``drafts_verified[k] / steps``); lengths from ``shown`` up are folded into one entry."""
    if not stats.steps or not stats.drafts_verified:
        return NA
    counts = stats.drafts_verified
    parts = [f"{k}: {n / stats.steps:.0%}" for k, n in enumerate(counts[:shown]) if n]
    if sum(counts[shown:]):
        parts.append(f"≥{shown}: {sum(counts[shown:]) / stats.steps:.0%}")
    return ", ".join(parts)


def _structured_section(meta: dict, rows: list[dict]) -> list[str]:
    """Grammar-constrained rows: per method, valid outputs, the share of output tokens the grammar
    forced (a property of the text), the share committed as the grammar's own drafts, and the
    acceptance of the other drafts (docs/structured.md)."""
    constrained = [r for r in rows if r.get("grammar") and not is_batched(r)]
    if not constrained:
        return []
    stats = method_stats(meta, constrained)
    out = ["", "## Structured output", "",
           "Every method decodes under the same compiled grammar (transformers with xgrammar's logits processor). "
           "*Forced*: output tokens at positions where the grammar allowed exactly one token. *Grammar drafts*: "
           "committed tokens that were the grammar's own drafts (forced tokens, and xgrammar's spelling of a forced "
           "string, proposed after the generator's drafts). *Other drafts accepted*: acceptance of the "
           "generator's drafts.", ""]
    body = []
    for m in meta["config"]["methods"]:
        mine = [r for r in constrained if r["method"] == m["name"]]
        if not mine:
            continue
        st = stats.get(m["name"])
        tokens = sum(r["new_tokens"] for r in mine)
        body.append([f"`{m['name']}`", f"{sum(r['grammar']['valid'] for r in mine)} of {len(mine)}",
                     _f(sum(r["grammar"]["forced"] for r in mine) / tokens if tokens else None, ".1%"),
                     _f(st.grammar_share if st is not None else None, ".1%"),
                     _f(st.drafter_acceptance_rate if st is not None and st.drafted_tokens > st.grammar_drafts
                        else None, ".1%")])
    return out + _table(["method", "valid outputs", "forced", "grammar drafts", "other drafts accepted"], body)


def _tree_section(meta: dict, rows: list[dict]) -> list[str]:
    """Per method that verified token trees (docs/trees.md): how many of its steps did, their mean
    node count and mean accepted depth (drafts accepted on the path the target took)."""
    stats = {name: st for name, st in method_stats(meta, rows).items() if st.tree_steps}
    if not stats:
        return []
    out = ["", "## Token trees", "", "*Tree steps*: steps whose drafts were a tree, verified in one forward; "
           "*nodes*: drafts per tree step; *accepted depth*: drafts accepted per tree step (the path the target "
           "took).", ""]
    body = [[f"`{name}`", f"{st.tree_steps} of {st.steps}", f"{st.tree_nodes / st.tree_steps:.2f}",
             f"{st.tree_depth / st.tree_steps:.2f}"] for name, st in stats.items()]
    return out + _table(["method", "tree steps", "nodes", "accepted depth"], body)


def _warmup_section(meta: dict) -> list[str]:
    """Seconds each compiled method spent compiling before the timed runs, per session."""
    sessions = [s.get("warmup_seconds") or {} for s in meta.get("sessions", [])]
    names = [m["name"] for m in meta["config"]["methods"] if any(m["name"] in s for s in sessions)]
    if not names:
        return []
    out = ["", "## Warm-up (compile) seconds", "",
           "Compiling each compiled method before the first timed call (every batch size it decodes, caches as long "
           "as the run's longest call); no tokens/s above includes it. One value per session: a resumed run "
           "compiles again.", ""]
    body = [[f"`{n}`", ", ".join(_f(s.get(n), ".1f", " s") for s in sessions if n in s)] for n in names]
    return out + _table(["method", "warm-up (compile)"], body)


def _choices_section(meta: dict, rows: list[dict]) -> list[str]:
    """Per method, the one-time choices its calls made and why (``AcceptanceStats.choices``: e.g.
    the precision ``self_draft``'s ``weights="auto"`` measured best on this machine)."""
    made = {name: stats.choices for name, stats in method_stats(meta, rows).items() if stats.choices}
    if not made:
        return []
    out = ["", "## Choices made on this machine", "",
           "What each method chose for itself, and why (`AcceptanceStats.choices`); the measuring was done in the "
           "untimed warm-up call, so no tokens/s above includes it.", ""]
    body = [[f"`{name}`", f"`{key}`", value.replace("|", "/")] for name, choices in made.items()
            for key, value in choices.items()]
    return out + _table(["method", "choice", "value"], body)


def _draft_lengths_section(meta: dict, rows: list[dict], all_summaries: list[Summary],
                           figures: list[str]) -> list[str]:
    """Per drafting method: mean K, the K distribution, the skipped-drafting share, calibration time."""
    drafting = [s for s in all_summaries if s.subtask == OVERALL and s.stats is not None and s.stats.steps]
    if not any(s.stats.drafts_verified for s in drafting):
        return []  # nothing drafted, or rows written before the chosen draft lengths were recorded
    every_row = method_stats(meta, rows)
    out = ["", "## Draft lengths chosen", "",
           "Over the rows of the overall table: mean K = drafts per step; K distribution = share of row-steps that "
           "verified K drafts (`AcceptanceStats.drafts_verified`); drafting skipped = share of row-steps where the "
           "draft-length policy chose no drafts: asked for none, or verified none of those offered "
           "(`AcceptanceStats.skipped_share`); calibration = seconds spent measuring the target's forward costs, "
           "over all the method's rows.", ""]
    body = [[f"`{s.method}`", _f(s.k_per_step, ".2f"), f"{s.stats.skipped_share:.1%}", k_distribution(s.stats),
             _f(every_row[s.method].calibration_seconds if s.method in every_row else None, ".2f", " s")]
            for s in drafting]
    out += _table(["method", "mean K", "drafting skipped", "K distribution", "calibration"], body)
    if FORWARD_COST_PNG in figures:
        out += ["", f"Measured cost curve (mean time per target forward against tokens fed): "
                    f"[{FORWARD_COST_PNG}]({FORWARD_COST_PNG})."]
    return out
