"""``python -m longseq.bench.xla [dry=true] [key=value ...]`` (``make xla-check``; Hydra, conf/xla_check.yaml): verify
the XLA path in one command and write one markdown report, like ``make gpu-check``.

1. Correctness: every registered attention built once on the CPU (fp32, eval mode), copied to the XLA device, and run
   forward and backward on the same inputs on both; the relative Frobenius errors of the XLA output and of every
   gradient (q, k, v, parameters) to the CPU's, against ``correctness.tolerance``. The backend each ran on XLA is
   the dispatch's (``attention.backend=auto``: ``xla``); a variant the dispatch refuses on XLA (host reads without a
   static-shape form) is reported ``refused`` with its reason.
2. Compilations: a small backbone with each attention trains ``compiles.steps`` AdamW steps on the XLA device, one
   ``torch_xla.sync()`` per step, counting XLA compilations (``torch_xla.debug.metrics``' ``CompileTime``) per step.
   The optimizer's state is made first, by one step on zero gradients (no weight decay: the weights do not move),
   whose own graph is reported apart: AdamW creates its state in its first step, so without it the second step is
   another graph for every model. Every counted step after the first must compile nothing: a data-dependent shape
   or a host read in the step shows up as a new graph per step.
3. ``python train.py trainer=tpu``: Lightning's XLA accelerator (on XLA's CPU device: ``utils.xla.XLACPUAccelerator``)
   for a few steps on the default task with ``train.attention``, its ``results:`` line (the metric) in the report.
4. ``<out_dir>/<timestamp>/report.md``, ``results.json``, ``config.yaml`` and ``train.log``.

``dry=true`` runs the pipeline without torch_xla (the fast suite): the CPU stands in for the XLA device (errors 0,
no compile counts) and the training stage runs ``trainer=cpu``. Exit status 1 when a check fails.
"""

from __future__ import annotations

import copy
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from longseq.bench import report
from longseq.bench.cell import error_text
from longseq.bench.specs import build_spec, select_attentions

PASSED = ("pass", "refused")
REPO_ROOT = Path(__file__).resolve().parents[3]


class XlaDevice:
    """The device the check runs on and how to count its compilations: torch_xla's device (``dry``: the CPU, no
    counts)."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        if dry:
            self.device, self.metrics = torch.device("cpu"), None
            return
        import torch_xla
        import torch_xla.debug.metrics as metrics

        self.device, self.metrics, self._xla = torch_xla.device(), metrics, torch_xla

    def sync(self) -> None:
        """Cut the traced graph here and run it (a training step's end)."""
        if not self.dry:
            self._xla.sync()

    def compiles(self) -> int | None:
        """XLA compilations so far in this process (None: dry)."""
        if self.metrics is None:
            return None
        data = self.metrics.metric_data("CompileTime")
        return int(data[0]) if data else 0


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` in fp64 on the CPU (the difference itself when ``exact`` is zero)."""
    approx, exact = approx.detach().cpu().double(), exact.detach().cpu().double()
    scale = exact.norm().item()
    diff = (approx - exact).norm().item()
    return diff / scale if scale > 0 else diff


def _names(requested: Any) -> list[str]:
    return select_attentions(OmegaConf.to_object(requested) if OmegaConf.is_config(requested) else requested)


# -- 1. correctness ------------------------------------------------------------------------------------------------
def _forward_backward(attn, inputs: list[torch.Tensor], grad_out: torch.Tensor, device, seed: int):
    """Output and gradients (q, k, v and the parameters, by name) of ``sum(attn(q, k, v) * grad_out)`` on ``device``."""
    xs = [x.detach().clone().to(device).requires_grad_() for x in inputs]
    torch.manual_seed(seed)
    out = attn(*xs)
    (out * grad_out.to(device)).sum().backward()
    grads = {"q": xs[0].grad, "k": xs[1].grad, "v": xs[2].grad, **{n: p.grad for n, p in attn.named_parameters()}}
    return out, {name: g for name, g in grads.items() if g is not None}


def check_attention(cfg: DictConfig, name: str, xla: XlaDevice) -> dict[str, Any]:
    """One correctness row: status (pass / FAIL / refused / n/a / error), the backend used on the device, the relative
    errors of the output and the largest over the gradients."""
    from longseq.attention import AttentionConfigError, build_attention

    c = cfg.correctness
    spec = build_spec(name, int(c.seq_len), causal=bool(c.causal), n_heads=int(c.heads), head_dim=int(c.head_dim),
                      block_size=int(c.block_size))
    row: dict[str, Any] = {"attention": name, "causal": spec.causal, "backend": "", "output_err": math.nan,
                           "grad_err": math.nan, "note": spec.note}
    if spec.skip_reason:
        return {**row, "status": "n/a", "note": spec.skip_reason}
    generator = torch.Generator().manual_seed(int(cfg.seed))
    shape = (int(c.batch), int(c.heads), int(c.seq_len), int(c.head_dim))
    q, k, v, grad_out = (torch.randn(shape, generator=generator) for _ in range(4))
    try:
        torch.manual_seed(int(cfg.seed))
        on_cpu = build_attention(spec.registry_name, **spec.kwargs).float().eval()
        on_device = copy.deepcopy(on_cpu).to(xla.device)
        out_cpu, grads_cpu = _forward_backward(on_cpu, [q, k, v], grad_out, "cpu", int(cfg.seed))
        try:
            out, grads = _forward_backward(on_device, [q, k, v], grad_out, xla.device, int(cfg.seed))
        except AttentionConfigError as error:
            return {**row, "status": "refused", "note": str(error)}
        xla.sync()
        row["backend"] = "+".join(sorted(on_device.backends_used))
        row["output_err"] = relative_error(out, out_cpu)
        missing = sorted(set(grads_cpu) - set(grads))
        row["grad_err"] = max((relative_error(grads[n], grads_cpu[n]) for n in grads_cpu if n in grads), default=0.0)
    except Exception as error:  # one broken variant does not stop the check
        return {**row, "status": "error", "note": error_text(error)}
    tolerance = float(c.tolerance)
    ok = row["output_err"] <= tolerance and row["grad_err"] <= tolerance and not missing
    if missing:
        row["note"] = "; ".join(filter(None, [row["note"], f"no gradient on the device for {missing}"]))
    return {**row, "status": "pass" if ok else "FAIL"}


def each_attention(names: list[str], check, describe) -> list[dict[str, Any]]:
    """``check(name)`` for each attention, a console line per row (``describe(row)``, the seconds, its note)."""
    rows = []
    for name in names:
        start = time.perf_counter()
        rows.append(check(name))
        r = rows[-1]
        print(f"  {name}: {describe(r)} ({time.perf_counter() - start:.1f} s) {r['note'][:120]}", flush=True)
    return rows


def check_correctness(cfg: DictConfig, xla: XlaDevice) -> list[dict[str, Any]]:
    return each_attention(_names(cfg.correctness.attentions), lambda name: check_attention(cfg, name, xla),
                          lambda r: f"{r['status']} [{r['backend']}] out {_fmt(r['output_err'], '.1e')} grad "
                                    f"{_fmt(r['grad_err'], '.1e')}")


# -- 2. compilations per training step -----------------------------------------------------------------------------
def _model(cfg: DictConfig, name: str, device) -> torch.nn.Module:
    from longseq.models.transformer import Transformer

    c = cfg.compiles
    spec = build_spec(name, int(c.seq_len), causal=True, n_heads=int(c.n_heads),
                      head_dim=int(c.d_model) // int(c.n_heads), block_size=int(c.block_size))
    if spec.skip_reason:
        raise ValueError(spec.skip_reason)
    torch.manual_seed(int(cfg.seed))
    return Transformer(vocab_size=int(c.vocab_size), seq_len=int(c.seq_len), n_layers=int(c.n_layers),
                       d_model=int(c.d_model), n_heads=int(c.n_heads), mlp_ratio=2, dropout=0.0, attn_dropout=0.0,
                       attention=spec.backbone_attention(), pos_emb="learned", image_shape=None).to(device)


def count_compiles(cfg: DictConfig, name: str, xla: XlaDevice) -> dict[str, Any]:
    """One row: compilations of the optimizer's state step and of each counted training step, the final loss."""
    from longseq.attention import AttentionConfigError
    from longseq.bench.throughput import next_token_loss

    c = cfg.compiles
    row: dict[str, Any] = {"attention": name, "state_compiles": None, "per_step": [], "note": ""}
    try:
        model = _model(cfg, name, xla.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=float(c.lr), weight_decay=0.0)
        generator = torch.Generator().manual_seed(int(cfg.seed))
        tokens = torch.randint(0, int(c.vocab_size), (int(c.batch), int(c.seq_len)), generator=generator)
        tokens = tokens.to(xla.device)
        before = xla.compiles()
        for p in model.parameters():  # AdamW makes its state in its first step: zero gradients move nothing
            p.grad = torch.zeros_like(p)
        optimizer.step()
        xla.sync()
        row["state_compiles"] = None if before is None else xla.compiles() - before
        model.train()
        for _ in range(int(c.steps)):
            before = xla.compiles()
            optimizer.zero_grad(set_to_none=True)
            loss = next_token_loss(model, tokens)
            loss.backward()
            optimizer.step()
            xla.sync()
            row["per_step"].append(None if before is None else xla.compiles() - before)
        row["loss"] = float(loss.detach().cpu())
    except AttentionConfigError as error:
        return {**row, "status": "refused", "note": str(error)}
    except Exception as error:
        return {**row, "status": "error", "note": error_text(error)}
    counted = [n for n in row["per_step"] if n is not None]
    if not counted:
        status = "pass"
        row["note"] = "dry: no XLA compilations to count"
    else:
        status = "pass" if all(n == 0 for n in counted[1:]) and math.isfinite(row["loss"]) else "FAIL"
    return {**row, "status": status}


def check_compiles(cfg: DictConfig, xla: XlaDevice) -> list[dict[str, Any]]:
    return each_attention(_names(cfg.compiles.attentions), lambda name: count_compiles(cfg, name, xla),
                          lambda r: f"{r['status']} compiles per step {r['per_step']} (state {r['state_compiles']})")


# -- 3. python train.py trainer=tpu --------------------------------------------------------------------------------
RESULTS = re.compile(r"^results: (?P<metrics>.*)$", re.M)


def train_command(cfg: DictConfig, run_root: Path) -> list[str]:
    """``python train.py trainer=tpu attention=<train.attention> <train.overrides>`` with its runs under
    ``run_root`` (dry: the overrides name ``trainer=cpu`` instead)."""
    overrides = [str(o) for o in cfg.train.overrides]
    trainer = [] if any(o.startswith("trainer=") for o in overrides) else ["trainer=tpu"]
    return [sys.executable, str(REPO_ROOT / "train.py"), *trainer, f"attention={cfg.train.attention}", *overrides,
            f"paths.log_dir={run_root}"]


def run_training(cfg: DictConfig, out: Path) -> dict[str, Any]:
    """The training run's status (pass: exit 0 and a ``results:`` line), its metrics and the command; its console
    output in ``out/train.log``."""
    command = train_command(cfg, out / "train_runs")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    row: dict[str, Any] = {"command": " ".join(command[1:]), "metrics": "", "seconds": math.nan}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=float(cfg.train.timeout_s))
    except subprocess.TimeoutExpired as error:
        (out / "train.log").write_text(str(error.stdout or "") + str(error.stderr or ""))
        return {**row, "status": "FAIL", "note": f"timed out after {cfg.train.timeout_s} s"}
    row["seconds"] = time.perf_counter() - start
    text = done.stdout + done.stderr
    (out / "train.log").write_text(text)
    found = RESULTS.search(done.stdout)
    row["metrics"] = found["metrics"] if found else ""
    backend = re.search(r"attention '\w+' runs on backend (\w+)", text)
    row["backend"] = backend[1] if backend else ""
    ok = done.returncode == 0 and found is not None
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    note = "" if ok else f"exit {done.returncode}: {errors[-1] if errors else text.strip().splitlines()[-1:]}"
    return {**row, "status": "pass" if ok else "FAIL", "returncode": done.returncode, "note": note}


# -- 4. the report -------------------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return format(value, spec)


def attention_table(correctness: list[dict[str, Any]], compiles: list[dict[str, Any]]) -> str:
    """One row per attention: its correctness and its compilations per step."""
    by_name = {r["attention"]: r for r in compiles}
    lines = ["| attention | causal | backend on XLA | status | output rel. err | max grad rel. err | "
             "compiles per step | compile status | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in correctness:
        c = by_name.get(r["attention"], {})
        counted = [n for n in c.get("per_step", []) if n is not None]
        state = c.get("state_compiles")
        steps = ", ".join(map(str, counted)) + (f" (state: {state})" if state is not None else "")
        notes = "; ".join(filter(None, [r.get("note", ""), c.get("note", "")]))
        lines.append(f"| {r['attention']} | {str(r['causal']).lower()} | {r['backend']} | {r['status']} | "
                     f"{_fmt(r['output_err'], '.1e')} | {_fmt(r['grad_err'], '.1e')} | {steps} | "
                     f"{c.get('status', 'not run')} | {notes} |")
    return "\n".join(lines)


def verdict(correctness: list[dict[str, Any]], compiles: list[dict[str, Any]], training: dict[str, Any]) -> bool:
    """Every attention passed or was refused with a reason, no step after the first compiled, and training ran."""
    return (all(r["status"] in PASSED for r in correctness) and all(r["status"] in PASSED for r in compiles)
            and training.get("status") == "pass")


def write_report(out: Path, cfg: DictConfig, env: dict[str, Any], correctness: list, compiles: list,
                 training: dict[str, Any]) -> str:
    c, k = cfg.correctness, cfg.compiles
    counts = {s: sum(r["status"] == s for r in correctness) for s in ("pass", "FAIL", "refused", "error", "n/a")}
    lines = [f"# longseq xla-check{' (dry: CPU without torch_xla)' if cfg.dry else ''}", "", "## Device", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    lines += ["", "## Attentions", "",
              f"Each attention built once on the CPU (fp32, eval), copied to the XLA device; forward and backward on "
              f"both with the same inputs (L={c.seq_len}, B={c.batch}, H={c.heads}, D={c.head_dim}, "
              f"causal={str(c.causal).lower()}): relative Frobenius errors of the device's output and the largest over "
              f"its gradients (q, k, v, parameters) to the CPU's; tolerance {c.tolerance:g}. Summary: {counts['pass']} "
              f"pass, {counts['refused']} refused, {counts['FAIL']} FAIL, {counts['error']} error, {counts['n/a']} n/a. "
              f"Compiles per step: XLA compilations in each of {k.steps} AdamW training steps of a {k.n_layers}-layer "
              f"backbone (d={k.d_model}, L={k.seq_len}, batch {k.batch}), after one step on zero gradients that makes "
              "the optimizer's state (its compilations in parentheses); a step after the first must compile nothing.",
              "", attention_table(correctness, compiles), "",
              "## python train.py trainer=tpu", ""]
    lines += [f"- {key}: {value}" for key, value in training.items()]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    report.write_json({"env": env, "correctness": correctness, "compiles": compiles, "training": training},
                      out / "results.json")
    return text


def environment(cfg: DictConfig, xla: XlaDevice) -> dict[str, Any]:
    env = {"device": str(xla.device), "torch": torch.__version__, "torch_xla": report._version("torch_xla"),
           "lightning": report._version("lightning"), "PJRT_DEVICE": os.environ.get("PJRT_DEVICE"),
           "cpu": report.cpu_name(), "git_commit": report.git_commit()}
    if not cfg.dry:
        from torch_xla import runtime

        env["xla_device_type"] = runtime.device_type()
        env["xla_devices"] = runtime.global_runtime_device_count()
    return env


def run_xla_check(cfg: DictConfig) -> tuple[Path, bool]:
    """Every stage per ``cfg`` -> (output directory, whether every check passed)."""
    from longseq.bench.run import output_directory

    if not cfg.dry and os.environ.get("PJRT_DEVICE") is None:
        raise SystemExit("error: PJRT_DEVICE: not set; PJRT_DEVICE=CPU runs the check on XLA's CPU device (make "
                         "xla-check sets it), PJRT_DEVICE=TPU on a TPU")
    xla = XlaDevice(bool(cfg.dry))
    out = output_directory(str(cfg.out_dir))
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    env = environment(cfg, xla)
    print(f"xla-check on {env['device']} (torch {env['torch']}, torch_xla {env['torch_xla']}) -> {out}", flush=True)
    done: dict[str, Any] = {"correctness": [], "compiles": [], "training": {"status": "not run yet"}}
    stages = [("correctness", "forward and backward against the CPU", lambda: check_correctness(cfg, xla)),
              ("compiles", "compilations per training step", lambda: check_compiles(cfg, xla)),
              ("training", "python train.py trainer=tpu", lambda: run_training(cfg, out))]
    for index, (key, title, stage) in enumerate(stages, 1):
        print(f"{index}/{len(stages)} {title} ...", flush=True)
        done[key] = stage()
        write_report(out, cfg, env, **done)  # rewritten after every stage: a stopped check keeps what it found
    ok = verdict(**done)
    print((out / "report.md").read_text(), flush=True)
    print(f"wrote {out}/report.md, results.json; {'all checks passed' if ok else 'SOME CHECKS FAILED'}", flush=True)
    return out, ok


def main() -> None:
    from longseq.bench.__main__ import run_check

    run_check("xla_check", run_xla_check)


if __name__ == "__main__":
    main()
