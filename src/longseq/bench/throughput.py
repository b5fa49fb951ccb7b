"""Training throughput per attention and the Lightning framework overhead.

Model: ``longseq.models.transformer.Transformer`` (the backbone every task uses) on the CIFAR-10
density geometry (L = 3072 sub-pixels, 256-way vocabulary, causal, block size 32), small by default.

For each attention the same model, initial weights, optimizer (AdamW) and batches are run both ways,
alternating for ``rounds`` rounds (the best round of each is kept):
- bare loop: ``zero_grad / forward / next-token cross-entropy / backward / step`` over a DataLoader;
- Lightning: a minimal ``LightningModule`` with the same ``training_step`` under
  ``Trainer(max_steps=N, logger=False, enable_checkpointing=False, ...)``.
Step time is the interval between consecutive step ends (so data fetching and every framework hook
are included), median over the steps after warm-up. tokens/s = batch * L / step time;
``lightning_overhead`` = Lightning step time / bare step time (target <= 1.10).
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from longseq.bench.specs import build_spec
from longseq.models.layer_plan import plan_names


def next_token_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Autoregressive cross-entropy: logits ``(B, L, V)`` at position t predict token t + 1."""
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_step_s(step_ends: list[float], warmup: int) -> float:
    intervals = [b - a for a, b in zip(step_ends, step_ends[1:])][warmup:]
    return statistics.median(intervals) if intervals else math.nan


def bare_loop_step_s(model: torch.nn.Module, loader: Any, steps: int, warmup: int, lr: float,
                     device: torch.device) -> float:
    """Median seconds per step of a plain PyTorch training loop."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    step_ends: list[float] = []
    batches = iter(loader)
    for _ in range(warmup + steps + 1):
        (tokens,) = next(batches)
        tokens = tokens.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        next_token_loss(model, tokens).backward()
        optimizer.step()
        _sync(device)
        step_ends.append(time.perf_counter())
    return _median_step_s(step_ends, warmup)


def lightning_step_s(model: torch.nn.Module, loader: Any, steps: int, warmup: int, lr: float,
                     device: torch.device) -> float:
    """Median seconds per step of the same training under a minimal Lightning Trainer."""
    import lightning as L

    for name in ("lightning.pytorch", "lightning.fabric"):  # "GPU available", tips: one per Trainer
        logging.getLogger(name).setLevel(logging.WARNING)

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.step_ends: list[float] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            _sync(device)
            self.step_ends.append(time.perf_counter())

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            return next_token_loss(self.model, tokens)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=lr)

    timer = StepTimer()
    trainer = L.Trainer(
        max_steps=warmup + steps + 1, accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[timer],
    )
    trainer.fit(Module(), train_dataloaders=loader)
    return _median_step_s(timer.step_ends, warmup)


def plan_presets(plan: Any, cfg: Any, causal: bool) -> dict[str, dict[str, Any]]:
    """The presets of the names a hybrid plan (``train_step.layer_attention``) uses, resolved at this benchmark's
    length and block size as the attentions themselves are (``build_spec``)."""
    head_dim = int(cfg.d_model) // int(cfg.n_heads)
    specs = {name: build_spec(name, int(cfg.seq_len), causal=causal, n_heads=int(cfg.n_heads), head_dim=head_dim,
                              block_size=cfg.block_size) for name in plan_names(plan)}
    return {name: spec.backbone_attention() for name, spec in specs.items() if not spec.skip_reason}


def measure_throughput(names: list[str], cfg: Any, device: str) -> list[dict[str, Any]]:
    """Rows of tokens/s (Lightning and bare) and their ratio, one per attention; failures become statuses."""
    try:
        from longseq.models.transformer import Transformer
    except Exception as error:  # the backbone is optional for the op-level sweep
        note = f"longseq.models.transformer not importable ({type(error).__name__}: {error})"
        return [{"attention": n, "status": "unavailable", "note": note} for n in names]

    torch_device = torch.device(device)
    length, batch = int(cfg.seq_len), int(cfg.batch)
    generator = torch.Generator().manual_seed(0)
    n_batches = cfg.warmup + cfg.steps + 1
    tokens = torch.randint(0, cfg.vocab_size, (n_batches * batch, length), generator=generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=batch, shuffle=False)
    head_dim = cfg.d_model // cfg.n_heads
    plan = cfg.get("layer_attention")
    plan = OmegaConf.to_container(plan) if OmegaConf.is_config(plan) else plan
    rows = []
    for name in names:
        row: dict[str, Any] = {"attention": name, "seq_len": length, "batch": batch, "block_size": cfg.block_size,
                               "n_layers": cfg.n_layers, "d_model": cfg.d_model, "status": "ok", "note": ""}
        spec = build_spec(name, length, causal=bool(cfg.causal), n_heads=cfg.n_heads, head_dim=head_dim,
                          block_size=cfg.block_size)
        if spec.skip_reason:
            rows.append({**row, "status": "skipped", "note": spec.skip_reason})
            continue
        attention = spec.backbone_attention()
        row["note"] = spec.note
        try:
            torch.manual_seed(0)
            model = Transformer(
                vocab_size=cfg.vocab_size, seq_len=length, n_layers=cfg.n_layers, d_model=cfg.d_model,
                n_heads=cfg.n_heads, mlp_ratio=cfg.mlp_ratio, dropout=0.0, attn_dropout=0.0,
                attention=attention, pos_emb="learned", image_shape=None,
                layer_attention=plan, attention_presets=plan_presets(plan, cfg, attention["causal"]),
            ).to(torch_device)
            row["layers"] = ",".join(model.layer_names)
            bare_s, lightning_s = math.inf, math.inf
            # Alternate the two loops and keep each one's best round, so a burst of load from other
            # processes or a one-off start-up cost does not land on one side only.
            for _ in range(max(1, int(cfg.rounds))):
                bare_s = min(bare_s, bare_loop_step_s(copy.deepcopy(model), loader, cfg.steps, cfg.warmup,
                                                      cfg.lr, torch_device))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # num_workers / tensor-cores hints
                    lightning_s = min(lightning_s, lightning_step_s(copy.deepcopy(model), loader, cfg.steps,
                                                                    cfg.warmup, cfg.lr, torch_device))
        except Exception as error:
            status = "oom" if "out of memory" in str(error).lower() else "error"
            rows.append({**row, "status": status, "note": f"{type(error).__name__}: {error}".splitlines()[0][:300]})
            continue
        rows.append({
            **row,
            "bare_ms": bare_s * 1e3, "lightning_ms": lightning_s * 1e3,
            "tokens_per_s_bare": batch * length / bare_s, "tokens_per_s_lightning": batch * length / lightning_s,
            "lightning_overhead": lightning_s / bare_s,
        })
    return rows


THROUGHPUT_COLUMNS = [
    "attention", "tokens_per_s_lightning", "tokens_per_s_bare", "lightning_overhead", "lightning_ms", "bare_ms",
    "status", "note", "seq_len", "batch", "block_size", "n_layers", "d_model", "layers",
]
