"""The benchmark figure (``longseq.bench.report.benchmark_figure``): every curve of a full run distinguishable,
coloured by family, one legend; the same function draws ``make bench``'s plot.png and the notebook's figure."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from matplotlib.colors import rgb_to_hsv, to_rgb

from longseq.bench.report import benchmark_figure, curve_styles, family, plot

REPO_ROOT = Path(__file__).resolve().parents[1]


def committed_rows() -> list[dict]:
    """The 26-attention CPU run kept in docs/ (the figure the issue could not read)."""
    with (REPO_ROOT / "docs" / "bench_cpu_fwd_bwd.csv").open() as handle:
        return [dict(attention=r["attention"], mode=r["mode"], status=r["status"], length=int(r["length"]),
                     ms=float(r["ms"] or "nan"), peak_mem_mb=float(r["peak_mem_mb"] or "nan"))
                for r in csv.DictReader(handle)]


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


def test_one_legend_grouped_by_family_and_the_png(tmp_path: Path) -> None:
    rows = committed_rows()
    names = list(dict.fromkeys(r["attention"] for r in rows))
    figure = benchmark_figure(rows, "title")
    assert len(figure.legends) == 1 and all(axis.get_legend() is None for axis in figure.axes)
    labels = [text.get_text() for text in figure.legends[0].get_texts()]
    headings = [label for label in labels if label.endswith(":")]
    assert headings == ["dense:", "sparse:", "combiner:", "efficient:"]
    assert sorted(label for label in labels if not label.endswith(":")) == sorted(names)
    assert labels.index("combiner:") < labels.index("combiner_axial") < labels.index("efficient:")
    time_axis = figure.axes[0]  # one curve per attention, failed cells left out (no NaN points)
    assert len(time_axis.get_lines()) == len(names)
    assert not any(math.isnan(y) for line in time_axis.get_lines() for y in line.get_ydata())
    plot(rows, tmp_path / "plot.png", "title")
    assert (tmp_path / "plot.png").stat().st_size > 10_000
