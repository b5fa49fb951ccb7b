"""The benchmark figure (``longseq.bench.report.benchmark_figure``): one column of panels per family with ``full`` in
each as the reference, time as the ratio to ``full``, every curve distinguishable (a hue per family); the same function
draws ``make bench``'s plot.png, ``python -m longseq.bench.replot`` and the notebook's figure."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from matplotlib.colors import rgb_to_hsv, to_rgb

from longseq.bench import replot
from longseq.bench.report import benchmark_figure, curve_styles, family, read_results

REPO_ROOT = Path(__file__).resolve().parents[1]


def committed_rows() -> list[dict]:
    """The 26-attention CPU run kept in docs/ (the figure the issue could not read)."""
    return read_results(REPO_ROOT / "docs" / "bench_cpu_fwd_bwd.csv")


def test_every_curve_has_its_own_look_and_families_their_own_hue() -> None:
    rows = committed_rows()
    names = list(dict.fromkeys(r["attention"] for r in rows))
    assert len(names) >= 26
    assert family("full") == "dense" and family("combiner_axial:row_summary=none") == "combiner"
    assert family("performer") == "efficient" and family("bigbird") == "sparse" and family("nope") == "other"
    styles = curve_styles(names, ["fwd_bwd"])
    looks = {(to_rgb(s["color"]), s["marker"], s["linestyle"]) for s in styles.values()}
    assert len(looks) == len(names)  # no two curves look alike
    for name in names:  # within a family: marker and line style alone already tell members apart
        same = [n for n in names if family(n) == family(name)]
        assert len({(styles[n, "fwd_bwd"]["marker"], styles[n, "fwd_bwd"]["linestyle"]) for n in same}) == len(same)

    def hue(name: str) -> float:
        return float(rgb_to_hsv(to_rgb(styles[name, "fwd_bwd"]["color"]))[0])

    # sparse (blue), combiner (red), efficient (green) members each sit on their family's hue
    for fam, (low, high) in {"sparse": (0.5, 0.7), "efficient": (0.25, 0.45)}.items():
        assert all(low < hue(n) < high for n in names if family(n) == fam), fam
    assert all(hue(n) < 0.05 or hue(n) > 0.95 for n in names if family(n) == "combiner")
    # two modes: the line style is the mode, the same attention keeps its colour and marker
    both = curve_styles(["full", "fixed"], ["fwd", "fwd_bwd"])
    assert both["fixed", "fwd"]["linestyle"] == "-" and both["fixed", "fwd_bwd"]["linestyle"] == "--"
    assert both["fixed", "fwd"]["color"] == both["fixed", "fwd_bwd"]["color"]


def panels(figure) -> dict[str, list[str]]:
    """Top-row panel title -> the labels of its column's legend."""
    top, bottom = figure.axes[: len(figure.axes) // 2], figure.axes[len(figure.axes) // 2:]
    return {axis.get_title(): [t.get_text() for t in below.get_legend().get_texts()] for axis, below in zip(top, bottom)}


@pytest.mark.slow  # a full figure drawn
def test_one_column_per_family_with_full_in_each_and_time_as_its_ratio(tmp_path: Path) -> None:
    rows = committed_rows()
    names = list(dict.fromkeys(r["attention"] for r in rows))
    figure = benchmark_figure(rows, "title")
    drawn = panels(figure)
    assert list(drawn) == ["sparse (9)", "Combiner (8)", "kernel / low-rank (efficient) (8)"]  # no block selection run
    assert all(labels[0] == "full (reference)" for labels in drawn.values())
    members = [label for labels in drawn.values() for label in labels[1:]]
    assert sorted(members) == sorted(n for n in names if n != "full")  # each attention in exactly one panel
    assert "combiner_axial:row_summary=none" in drawn["Combiner (8)"] and "bigbird" in drawn["sparse (9)"]
    top = figure.axes[:3]
    assert all(axis.get_shared_y_axes().joined(top[0], axis) for axis in top)  # families compare across columns
    ms = {(r["attention"], r["length"]): r["ms"] for r in rows}
    for axis in top:
        full, *others = axis.get_lines()
        assert list(full.get_ydata()) == [1.0, 1.0, 1.0]  # the reference, in every panel
        assert not any(math.isnan(y) for line in others for y in line.get_ydata())
    assert drawn["sparse (9)"][1] == "fixed"  # lines in legend order: full, then the members
    assert top[0].get_lines()[1].get_ydata()[-1] == ms["fixed", 16384] / ms["full", 16384]
    out = replot.main([str(REPO_ROOT / "docs" / "bench_cpu_fwd_bwd.csv"), "--out", str(tmp_path / "plot.png")])
    assert out.stat().st_size > 10_000


def test_block_selection_gets_its_own_panel_whatever_its_family_folder() -> None:
    """moba and nsa live in sparse/, combiner_select in combiner/: all three are built on ops/block_select.py."""
    rows = [dict(attention=name, length=length, mode="fwd", status="ok", ms=float(length) * (1 + i), peak_mem_mb=1.0)
            for i, name in enumerate(["full", "fixed", "combiner_fixed", "moba", "nsa", "combiner_select", "linear"])
            for length in (256, 512)]
    drawn = panels(benchmark_figure(rows, "title"))
    assert drawn == {"sparse (1)": ["full (reference)", "fixed"],
                     "Combiner (1)": ["full (reference)", "combiner_fixed"],
                     "kernel / low-rank (efficient) (1)": ["full (reference)", "linear"],
                     "block selection (3)": ["full (reference)", "moba", "nsa", "combiner_select"]}
