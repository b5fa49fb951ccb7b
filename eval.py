"""Evaluate a checkpoint with the config of the run that produced it:
``python eval.py ckpt_path=logs/train/runs/<run>/checkpoints/best.ckpt [split=val]`` (a run or checkpoints/
directory: its best.ckpt, else last.ckpt), or sample from it:
``python eval.py ckpt_path=... mode=sample [sample.n=16] [sample.cache=false] [sample.out_dir=<dir>]``.
The metrics are printed and saved to ``<eval run>/metrics.json``.

Errors print as one line, ``error: <key>: <message>`` (``HYDRA_FULL_ERROR=1``: full traceback).
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig, open_dict  # noqa: E402

from longseq.preflight.command import check_composition  # noqa: E402
from longseq.preflight.evaluate import check_eval_config, check_eval_mode  # noqa: E402
from longseq.report.outcome import METRICS_FILE  # noqa: E402
from longseq.runner import evaluate, sample  # noqa: E402
from longseq.utils.checkpoint import resolve_ckpt_path  # noqa: E402
from longseq.utils.config import register_resolvers  # noqa: E402
from longseq.utils.console import full_errors, report_and_exit  # noqa: E402

register_resolvers()
CHECKED = False  # the command's config passed check_eval_config before Hydra made the run directory


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    try:
        if not CHECKED:
            check_eval_config(cfg)
        with open_dict(cfg):  # a run or checkpoints/ directory stands for its best.ckpt (else last.ckpt)
            cfg.ckpt_path = str(resolve_ckpt_path(cfg.ckpt_path))
        if check_eval_mode(cfg.get("mode", "evaluate")) == "sample":
            for name, path in sample(cfg, checked=True).items():
                print(f"{name}: {path}")
            return
        metrics = evaluate(cfg, checked=True)
    except Exception as exc:
        if full_errors():
            raise
        report_and_exit(exc)
    for name, value in sorted(metrics.items()):
        print(f"{name}: {value:.4f}")
    print(f"saved: {Path(cfg.paths.output_dir) / METRICS_FILE}")


if __name__ == "__main__":
    # a bad override or value: one error: line, before Hydra makes the run directory
    CHECKED = check_composition(sys.argv, Path(__file__).resolve().parent / "conf", "eval", check=check_eval_config)
    main()
