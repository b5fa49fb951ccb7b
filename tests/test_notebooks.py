"""notebooks/*.ipynb: stored without outputs; ``make notebooks`` after a short training run executes every one top to
bottom (small settings); a notebook without its input says so and passes."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from sweep_files import VALUES, fake_job

from longseq.report.notebooks import execute_notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NAMES = ["attention_patterns", "benchmark", "results", "samples"]


def execute(name: str, parameters: str) -> nbformat.NotebookNode:
    return execute_notebook(NOTEBOOKS / f"{name}.ipynb", parameters, timeout=300)


def text_of(book: nbformat.NotebookNode) -> str:
    parts = []
    for cell in book.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts += [str(v) for k, v in output.get("data", {}).items() if k.startswith("text/")]
    return "\n".join(parts)


def images_of(book: nbformat.NotebookNode) -> int:
    return sum("image/png" in output.get("data", {}) for cell in book.cells for output in cell.get("outputs", []))


@pytest.mark.parametrize("name", NAMES)
def test_stored_notebooks_have_no_outputs(name: str) -> None:
    book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(book)
    code = [cell for cell in book.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)
    assert sum("parameters" in cell.metadata.get("tags", []) for cell in code) == 1


def test_results_notebook_aggregates_a_multirun(tmp_path: Path) -> None:
    root = tmp_path / "multirun"
    for job, ((attention, seed), value) in enumerate(VALUES.items()):
        run = fake_job(root / str(job), attention, seed, "completed", value)
        (run / "csv").mkdir()
        (run / "csv" / "metrics.csv").write_text(
            f"epoch,step,val/bpd\n0,10,{value + 0.5:.2f}\n1,20,{value + 0.01:.2f}\n")
    fake_job(root / "6", "full", 4, "failed", error="RuntimeError: injected fault")
    book = execute("results", f"multirun_dir = {str(root)!r}")
    text = text_of(book)
    assert "1.9500 ± 0.0500" in text and "injected fault" in text
    assert "no val/bpd curve in the CSV logs of 1 run(s): 6" in text  # said, not silently missing from the plot
    assert images_of(book) == 1


@pytest.mark.slow  # ~50 s: a training run, then every notebook on it; the fast set runs each notebook without its input
def test_make_notebooks_after_a_short_train_runs_every_notebook(tmp_path: Path, monkeypatch, one_thread) -> None:
    """``make notebooks`` right after ``make train`` (no Table 1 sweep): every notebook runs; results reports the
    trained run with its curve (from the CSV every run writes), samples draws from its checkpoint."""
    from conftest import compose_config

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernels: tiny tensors, thread start-up would dominate

    from longseq.report.notebooks import main
    from longseq.runner import train

    logs = tmp_path / "logs"
    run = logs / "train" / "runs" / "2026-11-25_12-00-00"
    train(compose_config(["callbacks.samples.n_samples=0", "callbacks.attention_maps.enabled=false",
                          "trainer.log_every_n_steps=1"], run))
    out = tmp_path / "executed"
    csv = ROOT / "docs" / "bench_cpu_fwd_bwd.csv"  # benchmark.ipynb would read the newest logs/bench/ run
    params = [f"logs_dir = {str(logs)!r}", "n_samples = 2", "n_completions = 2",  # results, samples
              "seq_len = 16", "block_size = 4", "n_clusters = 2",  # attention_patterns at a small size
              f"results_csv = {str(csv)!r}", "attentions = ['full', 'fixed', 'combiner_fixed']"]  # benchmark
    assert main(["--out", str(out), *(arg for line in params for arg in ("--param", line))]) == 0
    assert sorted(p.stem for p in out.glob("*.ipynb")) == NAMES
    patterns = nbformat.read(out / "attention_patterns.ipynb", as_version=4)
    assert "full support for every Combiner variant: True" in text_of(patterns)
    assert "combiner_axial_horizontal" in text_of(patterns) and "combiner_routing" in text_of(patterns)
    assert images_of(patterns) == 1
    bench = nbformat.read(out / "benchmark.ipynb", as_version=4)
    assert "combiner_fixed" in text_of(bench) and "16384" in text_of(bench) and images_of(bench) == 1
    results = nbformat.read(out / "results.ipynb", as_version=4)
    assert "1 runs" in text_of(results) and "no val/bpd curve" not in text_of(results)
    assert images_of(results) == 1
    samples = nbformat.read(out / "samples.ipynb", as_version=4)
    assert "attention full" in text_of(samples)
    assert images_of(samples) == 4  # samples, test images, given halves, completions


def test_notebooks_without_their_input_say_so_and_pass(tmp_path: Path) -> None:
    from longseq.report.notebooks import main

    out = tmp_path / "executed"
    assert main(["results", "samples", "--out", str(out), "--param", f"logs_dir = {str(tmp_path)!r}"]) == 0
    results, samples = (nbformat.read(out / f"{name}.ipynb", as_version=4) for name in ("results", "samples"))
    assert "no runs to report" in text_of(results) and images_of(results) == 0
    assert "no digits checkpoint" in text_of(samples) and images_of(samples) == 0



def test_results_curves_come_from_tensorboard_when_a_run_wrote_no_csv(make_cfg, tmp_path: Path) -> None:
    """Whatever the run logged: without its CSV (``extras.csv_metrics=false``) the curve is read from TensorBoard."""
    from longseq.report.runs import learning_curves, load_runs
    from longseq.runner import train

    train(make_cfg(["logger=tensorboard", "extras.csv_metrics=false", "trainer.log_every_n_steps=1",
                    "callbacks.samples.n_samples=0", "callbacks.attention_maps.enabled=false"]))
    assert not list(tmp_path.rglob("metrics.csv"))
    curve = learning_curves(load_runs([tmp_path])[0], "train/loss")
    assert list(curve["step"]) == [0, 1, 2] and curve["train/loss"].notna().all()
