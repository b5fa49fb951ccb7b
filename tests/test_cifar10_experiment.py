"""experiment=cifar10/ablation_6l: the paper's Table 1 setting, in fp32 even on trainer=gpu."""

from __future__ import annotations

import re

from conftest import CONF, compose_config


def test_table1_experiment_is_the_papers_setting_in_fp32_on_any_trainer(tmp_path) -> None:
    for trainer in ([], ["trainer=gpu"], ["trainer=ddp"]):
        cfg = compose_config(["experiment=cifar10/ablation_6l", "attention=combiner_axial", *trainer], tmp_path,
                             fast=False)
        assert cfg.trainer.precision == "32-true", trainer
        assert (cfg.trainer.max_steps, cfg.task.batch_size, cfg.task.seq_len) == (500_000, 32, 3072)
        assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads) == (6, 512, 8)
    # bf16 stays one override away
    cfg = compose_config(["experiment=cifar10/ablation_6l", "trainer=gpu", "trainer.precision=bf16-mixed"], tmp_path,
                         fast=False)
    assert cfg.trainer.precision == "bf16-mixed"
    # the file states the paper's numbers, their source and the cost estimate
    text = (CONF / "experiment" / "cifar10" / "ablation_6l.yaml").read_text()
    assert "arXiv:2107.05768" in text and "Table 1" in text and "500k iterations at batch 32" in text
    for name, bpd in {"combiner_axial": "3.050", "axial": "3.666", "fixed": "3.408", "combiner_fixed": "3.321",
                      "logsparse": "4.253", "combiner_logsparse": "3.366", "combiner_mixture": "3.040"}.items():
        assert re.search(rf"\b{name} +{re.escape(bpd)}\b", text), name
    assert "ESTIMATE" in text and "GPU-hours" in text
