"""Seconds per training step of a recall arm: what plan.yaml's ``estimate.step_s`` holds, measured by the project
(``python -m longseq.report.recall_study <task> --time-steps`` prints the table for every arm and length it runs)."""

from __future__ import annotations

import itertools
import time

import torch
from omegaconf import DictConfig

from longseq.utils.build import build_datamodule, build_module


def step_seconds(config: DictConfig, steps: int = 20, warmup: int = 5) -> float:
    """Mean wall seconds of one training step (forward, loss, backward, AdamW) of the module ``config`` builds, on one
    thread as a study job runs, over ``steps`` batches after ``warmup`` untimed ones. The batches are generated
    before the clock starts, and validation is not in it: the plan's ``validation`` factor adds both."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module = build_module(config)
        module.train()
        data = build_datamodule(config)
        data.setup("fit")
        batches = list(itertools.islice(data.train_dataloader(), warmup + steps))
        optimizer = torch.optim.AdamW(module.parameters(), lr=float(config.optimizer.lr))
        start = time.perf_counter()
        for index, batch in enumerate(batches):
            if index == warmup:
                start = time.perf_counter()
            loss = module.step("train", batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return (time.perf_counter() - start) / max(1, len(batches) - warmup)
    finally:
        torch.set_num_threads(threads)
