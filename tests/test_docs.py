"""The README's figures are the committed results' (generated, never typed)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_figures_match_committed_results():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    readme = (ROOT / "README.md").read_text()
    block = readme.split(figures.START, 1)[1].split(figures.END, 1)[0].split("\n", 1)[1].strip()
    assert block == figures.table(), "README.md's figures are stale: run python benchmarks/figures.py --write"
