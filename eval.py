"""Evaluate a checkpoint with the config of the run that produced it:
``python eval.py ckpt_path=logs/train/runs/<run>/checkpoints/best.ckpt [split=val]``.
"""

import os
from pathlib import Path

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from longseq.runner import evaluate  # noqa: E402
from longseq.utils.config import register_resolvers  # noqa: E402

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    metrics = evaluate(cfg)
    for name, value in sorted(metrics.items()):
        print(f"{name}: {value:.4f}")


if __name__ == "__main__":
    main()
