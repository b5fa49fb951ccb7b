"""``make xla-check`` without torch_xla: its pipeline dry (the CPU standing in for the XLA device), how it judges rows,
the training command it runs; the supported torch range and how installs stay on the pinned release
(``longseq.torch_compat``, pyproject.toml, tools/constraints/). The XLA device itself runs in ``make xla-check``."""

from __future__ import annotations

import copy
import json
import re
import tomllib

import pytest
import torch
from conftest import ROOT, compose_config
from omegaconf import OmegaConf
from packaging.requirements import Requirement

from longseq.bench import xla
from longseq.bench.__main__ import prepare_check
from longseq.torch_compat import SUPPORTED_TORCH, remember, supported, torch_release, traced_with_object


def dry_config(tmp_path, *overrides: str):
    cfg = compose_config(["dry=true", f"out_dir={tmp_path / 'xla_check'}", *overrides], config_name="xla_check",
                         fast=False)
    return prepare_check(cfg, ["dry=true", *overrides])


def test_the_dry_check_runs_every_stage_and_writes_its_report(tmp_path):
    out, ok = xla.run_xla_check(dry_config(tmp_path))
    assert ok
    results = json.loads((out / "results.json").read_text())
    assert [r["attention"] for r in results["correctness"]] == ["full", "combiner_fixed", "moba"]
    assert all(r["status"] == "pass" and r["output_err"] == 0.0 for r in results["correctness"])
    assert [r["attention"] for r in results["compiles"]] == ["full"]
    assert all(len(r["per_step"]) == 3 and r["status"] == "pass" for r in results["compiles"])
    training = results["training"]
    assert training["status"] == "pass"
    metrics = [re.fullmatch(r"([\w/]+)=\d+\.\d+", item) for item in training["metrics"].split(", ")]
    assert all(metrics) and {m[1] for m in metrics} == {"test/bpd", "val/bpd", "val/bpd_best"}
    report = (out / "report.md").read_text()
    assert "| combiner_fixed | true |" in report and "## python train.py trainer=tpu" in report
    assert "results: " in (out / "train.log").read_text()
    assert OmegaConf.load(out / "config.yaml").correctness.tolerance == 1e-4


def row(status="pass", **changes):
    return {"attention": "a", "status": status, **changes}


@pytest.mark.parametrize("correctness,compiles,training,ok", [
    ([row()], [row()], {"status": "pass"}, True),
    ([row("refused")], [row("refused")], {"status": "pass"}, True),  # refused with a reason: the contract
    ([row("FAIL")], [row()], {"status": "pass"}, False),
    ([row("error")], [row()], {"status": "pass"}, False),
    ([row()], [row("FAIL")], {"status": "pass"}, False),
    ([row()], [row()], {"status": "FAIL"}, False),
])
def test_the_verdict(correctness, compiles, training, ok):
    assert xla.verdict(correctness, compiles, training) is ok


def test_a_step_that_compiles_after_the_first_fails(tmp_path, monkeypatch):
    """Compilation counts injected through the device's counter: a second step that compiles is a FAIL."""
    cfg = dry_config(tmp_path)
    counts = iter([0, 0, 0, 3, 3, 4, 4, 4])  # state step: 0; steps: 3, 1, 0 new compilations

    device = xla.XlaDevice(dry=True)
    monkeypatch.setattr(device, "compiles", lambda: next(counts))
    r = xla.count_compiles(cfg, "full", device)
    assert r["per_step"] == [3, 1, 0] and r["status"] == "FAIL"


def test_a_refusal_on_the_device_is_reported_with_its_reason(tmp_path, monkeypatch):
    from longseq.attention import AttentionConfigError

    cfg = dry_config(tmp_path)
    calls = iter([None, AttentionConfigError("attention 'moba': attention.backend=auto finds no backend for xla")])
    real = xla._forward_backward

    def device_refuses(*args):
        error = next(calls)
        if error is not None:
            raise error
        return real(*args)

    monkeypatch.setattr(xla, "_forward_backward", device_refuses)
    r = xla.check_attention(cfg, "moba", xla.XlaDevice(dry=True))
    assert r["status"] == "refused" and "finds no backend for xla" in r["note"]


def test_the_training_stage_runs_train_py_with_trainer_tpu(tmp_path):
    cfg = compose_config([f"out_dir={tmp_path}"], config_name="xla_check", fast=False)
    command = xla.train_command(cfg, tmp_path / "runs")
    assert command[1].endswith("train.py") and command[2:4] == ["trainer=tpu", "attention=combiner_fixed"]
    assert "trainer.devices=1" in command and command[-1] == f"paths.log_dir={tmp_path / 'runs'}"


def test_the_real_check_needs_pjrt_device(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    cfg = compose_config([f"out_dir={tmp_path}"], config_name="xla_check", fast=False)
    with pytest.raises(SystemExit, match="error: PJRT_DEVICE: not set; PJRT_DEVICE=CPU runs the check on XLA's CPU"):
        xla.run_xla_check(cfg)
    assert not any(tmp_path.iterdir())


# -- the supported torch range -----------------------------------------------------------------------------------
def project_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {req.name: req for req in map(Requirement, project["dependencies"])}


def constraints(name: str) -> dict[str, str]:
    lines = (ROOT / "tools" / "constraints" / name).read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_pyproject_states_the_range_torch_compat_names_and_both_pins_lie_in_it():
    torch_req = project_requirements()["torch"]
    low, high = SUPPORTED_TORCH
    assert str(torch_req.specifier) == f"<{high},>={low}"
    pinned, xla_env = constraints("pinned.txt"), constraints("xla.txt")
    assert pinned == {"torch": "2.14.1", "torchvision": "0.29.1"}
    assert xla_env == {"torch": "2.9.0", "torchvision": "0.24.0", "torch_xla": "2.9.0"}
    for pins in (pinned, xla_env):
        assert torch_req.specifier.contains(pins["torch"]) and supported(pins["torch"])
        assert project_requirements()["torchvision"].specifier.contains(pins["torchvision"])
    assert not supported("2.8.0") and not supported("2.15.0")


def test_make_install_pins_the_release_the_suite_runs_on():
    makefile = (ROOT / "Makefile").read_text()
    assert "-c tools/constraints/pinned.txt -e '.[dev]'" in makefile
    assert "-c tools/constraints/xla.txt torch_xla -e '.[dev]'" in makefile
    assert torch_release() == torch_release(constraints("pinned.txt")["torch"])


def test_a_function_traced_with_an_object_reaches_a_copy_of_it_under_compile():
    """``traced_with_object`` runs at trace time on every supported torch (torch 2.9's dynamo took only constants);
    a deep copy is its own object, found by its id."""

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []
            remember(self)

        def __setstate__(self, state):
            super().__setstate__(state)
            remember(self)

        def forward(self, x):
            note(self, "called")
            return x * 2

    @traced_with_object
    def note(holder, what: str) -> bool:
        holder.seen.append(what)
        return True

    original = Holder()
    twin = copy.deepcopy(original)
    compiled = torch.compile(twin, backend="eager", fullgraph=True)
    x = torch.ones(3)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), 2 * x)
    assert twin.seen == ["called"] and original.seen == []  # once per compiled graph, on the copy
    original(x)
    assert original.seen == ["called"]


def test_the_preflight_builds_trainer_tpu_with_the_accelerator_the_run_gets(tmp_path, monkeypatch):
    """``trainer=tpu``'s Trainer is built twice, by the pre-flight (Lightning's own checks, before the run directory)
    and by the run, and both get ``utils.xla.trainer_accelerator``'s accelerator (on XLA's CPU device Lightning's own
    ``tpu`` is unavailable: the pre-flight refused what the run would have trained, ``make xla-check`` found it). Here a
    CPU accelerator stands in for XLA's, which needs torch_xla."""
    from lightning.pytorch.accelerators import CPUAccelerator

    from longseq.preflight.trainer import check_with_lightning
    from longseq.utils import xla as xla_utils

    cfg = compose_config(["trainer=tpu", "trainer.devices=1"], tmp_path)
    given = []
    monkeypatch.setattr(xla_utils, "tpu_accelerator", lambda: given.append(CPUAccelerator()) or given[-1])
    assert check_with_lightning(cfg) == 1 and len(given) == 1
