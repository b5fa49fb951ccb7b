"""longseq.report: metrics.json written by every run, and mean ± std over seeds from a multirun directory."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from sweep_files import VALUES, fake_job

from longseq.report.__main__ import main as report_main
from longseq.report.runs import learning_curves, load_runs
from longseq.report.table import aggregate

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def multirun(tmp_path: Path) -> Path:
    """Three seeds x two attentions completed, one failed job, one unfinished job."""
    root = tmp_path / "multiruns" / "2026-01-01_00-00-00"
    job = 0
    for (attention, seed), value in VALUES.items():
        fake_job(root / str(job), attention, seed, "completed", value)
        job += 1
    fake_job(root / str(job), "combiner_fixed", 4, "failed", error="RuntimeError: injected fault\nat step 3")
    fake_job(root / str(job + 1), "full", 4, None)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def test_aggregate_means_stds_and_left_out(multirun: Path) -> None:
    report = aggregate(load_runs([multirun]))
    assert report.metric == "test/bpd" and report.by == ["attention"] and report.mode == "min"
    table = report.table.set_index("attention")
    assert list(table.index) == ["combiner_fixed", "full"]  # best (lowest) mean first
    for attention in ("full", "combiner_fixed"):
        values = [VALUES[attention, s] for s in (1, 2, 3)]
        assert table.loc[attention, "mean"] == pytest.approx(statistics.mean(values))
        assert table.loc[attention, "std"] == pytest.approx(statistics.stdev(values))  # sample std (ddof 1)
        assert table.loc[attention, "n"] == 3
        assert table.loc[attention, "best"] == pytest.approx(min(values))
        assert table.loc[attention, "seeds"] == "1,2,3"
    left = report.left_out.set_index("status")
    assert sorted(left.index) == ["failed", "unfinished"]
    assert left.loc["failed", "reason"] == "RuntimeError: injected fault\nat step 3"
    assert "seed=4" in left.loc["failed", "overrides"] and "attention=combiner_fixed" in left.loc["failed", "overrides"]
    assert Path(left.loc["unfinished", "run"]).name == "7"
    assert "no metrics.json" in left.loc["unfinished", "reason"]


def test_cli_writes_csv_and_markdown_listing_failures(multirun: Path, capsys) -> None:
    assert report_main([str(multirun), "--metric", "test/bpd"]) == 0
    printed = capsys.readouterr().out
    csv = pd.read_csv(multirun / "report.csv")
    assert list(csv["attention"]) == ["combiner_fixed", "full"]
    assert csv["mean"].tolist() == pytest.approx([1.95, statistics.mean([2.1, 2.2, 2.6])])
    markdown = (multirun / "report.md").read_text()
    assert "| combiner_fixed | 1.9500 ± 0.0500 | 3 | 1.9000 | 1,2,3 |" in markdown
    assert "Not in the table (2 run(s))" in markdown
    assert "| 6 | failed |" in markdown and "| RuntimeError: injected fault at step 3 |" in markdown  # one line
    assert "| 7 | unfinished |" in markdown
    assert "combiner_fixed" in printed and "injected fault" in printed


def test_group_by_config_key_and_other_metric(multirun: Path) -> None:
    report = aggregate(load_runs([multirun]), metric="val/bpd", by=["attention.name", "attention.block_size"])
    assert report.table["attention.block_size"].tolist() == ["8", "8"]
    assert report.table.set_index("attention.name").loc["full", "mean"] == pytest.approx(2.31)


def test_completed_run_without_the_metric_is_listed(multirun: Path) -> None:
    report = aggregate(load_runs([multirun]), metric="test/acc")
    assert report.table.empty
    assert (report.left_out["status"] == "no metric").sum() == 6
    assert "test/bpd" in report.left_out["reason"].iloc[0]  # names what was recorded


def test_cli_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    run = subprocess.run([sys.executable, "-m", "longseq.report", str(missing)], capture_output=True, text=True)
    assert run.returncode == 2 and str(missing) in run.stderr
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2
    assert not (tmp_path / "empty" / "report.csv").exists()


def test_train_records_completed_and_failed_runs(make_cfg, tmp_path: Path) -> None:
    """The runner writes metrics.json: the final metrics of a finished run; the error of a failed one."""
    from longseq.runner import train

    metrics = train(make_cfg(["logger=csv", "trainer.log_every_n_steps=1", "callbacks.samples.n_samples=0"]))
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["status"] == "completed"
    assert record["metrics"]["test/bpd"] == pytest.approx(metrics["test/bpd"]) and math.isfinite(record["metrics"]["test/bpd"])
    curves = learning_curves(load_runs([tmp_path])[0], "train/loss")
    assert len(curves) >= 1 and curves["step"].is_monotonic_increasing

    failed_dir = tmp_path / "failed"
    failed_dir.mkdir()  # a sweep job's directory, made by Hydra before the job runs (a single run is refused before)
    cfg = make_cfg(["attention=fixed", "attention.block_size=5"])  # 5 does not tile L = 64: fails at build
    cfg.paths.output_dir = str(failed_dir)
    with pytest.raises(Exception, match="block_size") as raised:
        train(cfg)
    record = json.loads((failed_dir / "metrics.json").read_text())
    assert record["status"] == "failed" and record["metrics"] == {}
    assert type(raised.value).__name__ in record["error"] and "block_size" in record["error"]


@pytest.mark.parametrize("code,status", [(143, "interrupted"), (-1, "interrupted"), (1, "failed"), (2, "failed")])
def test_an_exit_from_outside_records_interrupted_and_any_other_exit_failed(tmp_path: Path, code, status) -> None:
    """SIGTERM (143) and submitit's requeue of a preempted SLURM job (``sys.exit(-1)`` in its signal handler) are
    not the run's failure: ``metrics.json`` says interrupted until the next attempt rewrites it."""
    from types import SimpleNamespace

    from longseq.report.outcome import records_run_outcome

    def stopped(cfg):
        raise SystemExit(code)

    with pytest.raises(SystemExit):
        records_run_outcome(stopped)(SimpleNamespace(paths=SimpleNamespace(output_dir=str(tmp_path))))
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["status"] == status and record["error"] == f"SystemExit: {code}"


def fake_run(path: Path, task: str, overrides: list[str], best: float | None, checkpoint: str = "best.ckpt") -> Path:
    """A single run as train.py leaves it, with a checkpoint file and its best validation score."""
    import yaml

    from longseq.report import write_run_metrics

    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (path / "config_resolved.yaml").write_text(yaml.safe_dump({"task": {"name": task, "monitor": "val/bpd",
                                                                         "mode": "min"}}))
    (path / "checkpoints").mkdir()
    (path / "checkpoints" / checkpoint).write_bytes(b"weights")
    write_run_metrics(path, {} if best is None else {"val/bpd_best": best}, "completed")
    return path


def test_notebooks_draw_from_the_default_runs_best_checkpoint_not_the_newest(tmp_path: Path) -> None:
    """samples.ipynb's default: ``make train``'s run (no overrides) even when a 20-step run is newer; among runs
    with overrides, the best val/bpd; never another task's."""
    import os

    from longseq.report.runs import default_checkpoint

    runs = tmp_path / "train" / "runs"
    default = fake_run(runs / "a", "digits", [], best=2.10)
    worse = fake_run(runs / "b", "digits", ["trainer.max_steps=20"], best=3.90)
    better = fake_run(runs / "c", "digits", ["model.n_layers=2"], best=2.50, checkpoint="last.ckpt")
    fake_run(runs / "d", "mqar", [], best=0.01)
    for age, run in enumerate((default, better, worse)):  # the 20-step run is the newest
        os.utime(run, (1_000_000 + age, 1_000_000 + age))
    assert default_checkpoint(tmp_path) == default / "checkpoints" / "best.ckpt"
    (default / "checkpoints" / "best.ckpt").unlink()
    assert default_checkpoint(tmp_path) == better / "checkpoints" / "last.ckpt"
    assert default_checkpoint(tmp_path, "needle") is None


def test_a_report_of_single_runs_keeps_to_one_task(tmp_path: Path) -> None:
    """results.ipynb over logs/train/runs: recall runs are not rows of the digits table; they are counted."""
    import os

    from longseq.report.runs import runs_of_task

    for i, task in enumerate(["digits", "mqar", "digits", "needle", "digits"]):
        run = fake_run(tmp_path / str(i), task, [], best=2.0)
        os.utime(run, (1_000_000 + i, 1_000_000 + i))
    kept, others = runs_of_task(load_runs([tmp_path]), None)
    assert sorted(run.path.name for run in kept) == ["0", "2", "4"] and others == {"mqar": 1, "needle": 1}
    kept, others = runs_of_task(load_runs([tmp_path]), "mqar")
    assert [run.path.name for run in kept] == ["1"] and others == {"digits": 3, "needle": 1}
