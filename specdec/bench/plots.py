"""Benchmark plots (matplotlib, the ``bench`` extra): speedup per subtask, acceptance by draft
position, and the measured forward cost against tokens fed. Each function writes one PNG and
returns whether it drew anything; the report links what was drawn."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .results import OVERALL

if TYPE_CHECKING:  # pragma: no cover
    from .summary import Summary


def plot_speedup(all_summaries: list[Summary], base_name: str, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(s.method for s in all_summaries if s.method != base_name))
    groups = list(dict.fromkeys(s.subtask for s in all_summaries))
    if not methods:
        return False
    by = {(s.method, s.subtask): s.speedup for s in all_summaries}
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups) + 0.3 * len(methods)), 4))
    for i, m in enumerate(methods):
        xs = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [by.get((m, g)) or 0.0 for g in groups], width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=20)
    ax.set_ylabel(f"speedup over {base_name} (tokens/s ratio)")
    ax.set_title("Speedup per subtask")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_acceptance(all_summaries: list[Summary], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [s for s in all_summaries if s.subtask == OVERALL and s.stats is not None and s.stats.accepted_at_position]
    if not measured:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in measured:
        values = s.stats.per_position_acceptance
        ax.plot(range(1, len(values) + 1), values, marker="o", label=s.method)
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of steps accepting it")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title("Acceptance by draft position (overall)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_forward_cost(curves: dict[str, dict[int, float]], path: Path) -> bool:
    """Mean milliseconds per target forward (``{method: {tokens fed: ms}}``) against tokens fed
    (log2 x), one line per method; False (nothing drawn) when no method measured a forward."""
    curves = {name: curve for name, curve in curves.items() if curve}
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        ax.plot(list(curve), list(curve.values()), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("tokens fed per target forward (width x batch)")
    ax.set_ylabel("mean ms per target forward")
    ax.set_ylim(bottom=0)
    ax.set_title("Measured forward cost")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


