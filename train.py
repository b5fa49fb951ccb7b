"""Train a model: ``python train.py task=<task> attention=<attention> [key=value ...]``.

Composes ``conf/train.yaml``, trains, tests the best checkpoint, and returns ``optimized_metric`` so
Hydra sweepers (``-m``, Optuna) can optimize it. All logic lives in ``longseq.runner``.

Before Hydra creates a run directory, the composed command passes ``longseq.preflight`` (every value, the model,
Lightning's own checks, the data files; ``ckpt_path=`` exists, loads, fits the composed model), and a checkpoint
of an earlier run (``<run>/checkpoints/*.ckpt``, or the run directory) resumes that run in place with its own
overrides replayed: same directory, same logs, the command's optimizer settings from the resumed step. A launcher job started
again in a directory holding its own checkpoints (SLURM requeue) resumes from the newest one. Errors print as
one line, ``error: <key>: <message>`` (``HYDRA_FULL_ERROR=1``: full traceback).
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from longseq.preflight.command import preflight_train  # noqa: E402
from longseq.runner import metric_value, results_line, set_float32_precision, train  # noqa: E402
from longseq.utils.config import extras, register_resolvers  # noqa: E402
from longseq.utils.console import error_summary, full_errors, report_and_exit  # noqa: E402
from longseq.utils.errors import name_user_key  # noqa: E402
from longseq.utils.resume import resume_requeued  # noqa: E402

register_resolvers()
CONFIG_DIR = Path(__file__).resolve().parent / "conf"
CHECKED = False  # the command's config passed the pre-flight before Hydra made the run directory


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        return run(cfg, Path(hydra_cfg.runtime.output_dir), multirun)
    except Exception as exc:
        name_user_key(exc, cfg)  # task.data.batch_size=${task.batch_size}: the message names task.batch_size
        if full_errors() or multirun:  # a sweeper records the failed trial from the exception
            print(error_summary(exc), file=sys.stderr)
            raise
        report_and_exit(exc)


def run(cfg: DictConfig, output_dir: Path, multirun: bool) -> float | None:
    hydra_cfg = HydraConfig.get()
    extras(cfg, output_dir, multirun=multirun, choices=dict(hydra_cfg.runtime.choices),
           overrides=list(hydra_cfg.overrides.task))
    set_float32_precision()
    metrics = train(resume_requeued(cfg, output_dir, multirun), checked=CHECKED and not multirun)
    print(results_line(metrics, cfg.task.get("monitor"), output_dir))
    checkpoints = output_dir / "checkpoints"
    best = metrics.get("ckpt_path")
    if best and Path(best).is_file():
        print(f"tested checkpoint: {best}")
    if (checkpoints / "last.ckpt").is_file():
        print(f"last checkpoint: {checkpoints / 'last.ckpt'} (resume: python train.py ckpt_path=<this>)")
    return metric_value(metrics, cfg.get("optimized_metric"), trained=bool(cfg.get("train", True)))


if __name__ == "__main__":
    # compose and check the command once, resume included: a refusal is one error: <key>: line, before anything runs
    sys.argv, CHECKED = preflight_train(sys.argv, CONFIG_DIR, "train")
    main()
