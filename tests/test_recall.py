"""Recall tasks (issue 23): the generators' invariants, the short causal convolution, the study's configs and
a learnability check that proves the labels do not leak."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import compose_config
from hydra.errors import InstantiationException

from longseq.attention import ATTENTION_REGISTRY
from longseq.data.recall import (
    IGNORE_INDEX,
    MqarGenerator,
    NeedleGenerator,
    RecallDataset,
    SelectiveCopyGenerator,
    chance_accuracy,
    gap_probabilities,
)
from longseq.models.transformer import Transformer
from longseq.runner import build_datamodule, build_module
from longseq.utils.errors import ConfigError

# ----------------------------------------------------------------------------------------------------
# MQAR generator


def mqar(n: int = 200, split: str = "train", seed: int = 0, **kw) -> tuple[MqarGenerator, torch.Tensor, ...]:
    args = dict(vocab_size=512, seq_len=128, num_pairs=8, power_a=0.01) | kw
    gen = MqarGenerator(**args)
    return (gen, *RecallDataset(gen, n, seed, split).tensors())


def test_mqar_layout_keys_values_questions_and_labels():
    gen, inputs, labels, buckets = mqar()
    D, V = gen.num_pairs, gen.vocab_size
    for x, y, b in zip(inputs.tolist(), labels.tolist(), buckets.tolist()):
        keys, values = x[0:2 * D:2], x[1:2 * D:2]
        assert len(set(keys)) == D and all(1 <= k < V // 2 for k in keys)  # distinct keys from [1, V/2)
        assert all(V // 2 <= v < V for v in values)
        asked = [t for t, label in enumerate(y) if label != IGNORE_INDEX]
        assert len(asked) == D and all(t >= 2 * D and (t - 2 * D) % 2 == 0 for t in asked)
        assert sorted(x[t] for t in asked) == sorted(keys)  # each key asked exactly once
        for t in asked:
            j = keys.index(x[t])
            assert y[t] == values[j]
            assert x[:t].count(values[j]) == 1  # the answer occurs exactly once before its question
            assert x[:t].count(x[t]) == 1  # ... and so does the key (fillers never repeat one)
            assert 2 ** b[t] <= t - 2 * j < 2 ** (b[t] + 1)  # the distance bucket
        assert all(b[t] == -1 for t in range(len(y)) if y[t] == IGNORE_INDEX)  # no label, no bucket
        assert not any(V // 2 <= x[t] for t in range(2 * D, len(x)))  # no value after the pairs


def test_mqar_gaps_follow_the_power_law():
    """The query slots of 4,000 questions against Zoology's law P(g) ~ a (g + 1)^(a - 1): chi-square over slot
    bins (fixed seed), and a clearly different power_a is rejected by the same test."""
    from scipy.stats import chisquare

    def slots(power_a: float) -> np.ndarray:
        gen, inputs, labels, _ = mqar(500, power_a=power_a, num_pairs=8, seq_len=128)
        where = (labels != IGNORE_INDEX).nonzero()[:, 1].numpy()
        return (where - 2 * gen.num_pairs) // 2

    space = (128 - 16) // 2
    edges = [0, 1, 2, 4, 8, 16, 32, space]

    def test(observed: np.ndarray, power_a: float) -> float:
        # Sampling D slots without replacement flattens the law a little: compare with the same scheme's
        # exact marginal, estimated by a large independent draw (different seed stream).
        rng = np.random.default_rng(99)
        p = gap_probabilities(space, power_a)
        ref = np.concatenate([rng.choice(space, size=8, replace=False, p=p) for _ in range(20_000)])
        expected = np.histogram(ref, edges)[0] / len(ref) * len(observed)
        return chisquare(np.histogram(observed, edges)[0], expected).pvalue

    observed = slots(0.01)
    assert test(observed, 0.01) > 0.001
    assert test(observed, 1.0) < 1e-6  # uniform gaps are not what was drawn
    assert test(slots(1.0), 1.0) > 0.001
    assert np.mean(observed < 8) > 0.4  # power_a = 0.01 favours short gaps (about half in the first 8 slots)


def test_mqar_seeds_reproduce_and_splits_never_overlap():
    _, a, la, _ = mqar(100, "train", seed=3)
    _, b, lb, _ = mqar(100, "train", seed=3)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert not torch.equal(a, mqar(100, "train", seed=4)[1])
    rows = {split: {tuple(r) for r in mqar(300, split, seed=3)[1].tolist()} for split in ("train", "val", "test")}
    assert all(len(r) == 300 for r in rows.values())  # no duplicate inside a split either
    assert not rows["train"] & rows["val"] and not rows["train"] & rows["test"] and not rows["val"] & rows["test"]
    # an example does not depend on how many are generated
    assert torch.equal(mqar(5, "val", seed=3)[1], mqar(300, "val", seed=3)[1][:5])


@pytest.mark.parametrize("kw,key", [
    (dict(vocab_size=128, seq_len=128), "task.vocab_size"),          # V > L
    (dict(num_pairs=33, seq_len=128), "task.num_pairs"),             # 4 D <= L
    (dict(power_a=0.0), "task.power_a"),
    (dict(power_a=1.5), "task.power_a"),
    (dict(seq_len=127, vocab_size=512), "task.seq_len"),
    (dict(num_pairs=0), "task.num_pairs"),
])
def test_mqar_bad_values_name_the_key(kw, key):
    args = dict(vocab_size=512, seq_len=128, num_pairs=8, power_a=0.01) | kw
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        MqarGenerator(**args)


# ----------------------------------------------------------------------------------------------------
# Needle and selective copy


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_needle_sits_at_the_requested_depth_and_the_answer_is_its_value(depth):
    gen = NeedleGenerator(seq_len=200, depths=[depth], key_len=4, value_len=5)
    inputs, labels, buckets = RecallDataset(gen, 20, 0, "train").tensors()
    hay, at = gen.layout(depth)
    assert at == round(depth * (hay - gen.needle_len))
    for x, y, b in zip(inputs, labels, buckets):
        text = bytes(x.numpy().astype(np.uint8)).decode()
        start = text.index(":") - 1 - gen.key_len  # the needle's leading space
        assert start == at
        key, value = text[start + 1:start + 1 + gen.key_len], text[start + gen.key_len + 3:start + gen.key_len + 8]
        assert value.isdigit() and text.count(f" {key}: ") == 2  # the needle and the question
        asked = (y != IGNORE_INDEX).nonzero()[:, 0]
        assert asked.tolist() == list(range(200 - 5, 200))  # the value's digits, predicted at the end
        assert bytes(y[asked].numpy().astype(np.uint8)).decode() == value
        assert text.endswith(f" {key}: {value[:-1]}")
        assert (b[asked] == 0).all() and (b[y == IGNORE_INDEX] == -1).all()


def test_needle_depths_are_bucketed_and_bad_values_name_the_key():
    gen = NeedleGenerator(seq_len=128, depths=[0.0, 0.5, 1.0])
    _, labels, buckets = RecallDataset(gen, 60, 0, "val").tensors()
    assert set(buckets[labels != IGNORE_INDEX].tolist()) == {0, 1, 2} and gen.bucket_names() == ["0", "0.5", "1"]
    with pytest.raises(ConfigError, match=r"task\.depths"):
        NeedleGenerator(seq_len=128, depths=[0.5, 1.2])
    with pytest.raises(ConfigError, match=r"task\.seq_len"):
        NeedleGenerator(seq_len=16)
    with pytest.raises(ConfigError, match=r"task\.vocab_size"):
        NeedleGenerator(seq_len=128, vocab_size=300)


def test_selective_copy_targets_are_the_marked_tokens_in_order():
    gen = SelectiveCopyGenerator(vocab_size=12, seq_len=64, num_tokens=6, num_noise=3)
    inputs, labels, buckets = RecallDataset(gen, 50, 0, "test").tensors()
    for x, y, b in zip(inputs.tolist(), labels.tolist(), buckets.tolist()):
        body = 64 - 6
        marked = [t for t in x[:body] if t >= 1 + 3]
        assert len(marked) == 6 and x[body] == gen.SEP and all(1 <= t < 4 for t in x[:body] if t < 4)
        assert y[body:] == marked and all(v == IGNORE_INDEX for v in y[:body])
        assert x[body + 1:] == marked[:-1]  # teacher forcing: the copy so far is the input
        assert b[body:] == list(range(6))
    with pytest.raises(ConfigError, match=r"task\.num_tokens"):
        SelectiveCopyGenerator(vocab_size=12, seq_len=10, num_tokens=5)
    with pytest.raises(ConfigError, match=r"task\.num_noise"):
        SelectiveCopyGenerator(vocab_size=4, seq_len=64, num_tokens=2, num_noise=3)


# ----------------------------------------------------------------------------------------------------
# model.short_conv


def conv_model(attention: str = "full", short_conv: int | None = 4, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    spec = {"name": attention, "causal": True} | ({"window": 4} if attention == "local" else {})
    net = Transformer(vocab_size=11, seq_len=16, n_layers=2, d_model=16, n_heads=2, attention=spec,
                      short_conv=short_conv, dropout=0.0)
    return net.double().eval()


@pytest.mark.parametrize("kernel", [1, 3, 4])
def test_short_conv_does_not_leak_the_future(kernel):
    net = conv_model(short_conv=kernel)
    tokens = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(0))
    out = net(tokens)
    for t in (0, 5, 14):
        changed = tokens.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1) % 11
        torch.testing.assert_close(net(changed)[:, :t + 1], out[:, :t + 1], rtol=0, atol=0)
        assert not torch.allclose(net(changed)[:, t + 1:], out[:, t + 1:])  # the conv does see the past


def test_short_conv_changes_the_model_and_bad_values_name_the_key():
    tokens = torch.randint(0, 11, (1, 16), generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(conv_model(short_conv=4)(tokens), conv_model(short_conv=None)(tokens))
    assert conv_model(short_conv=0).blocks[0].short_conv is None
    assert conv_model(short_conv=3).blocks[0].short_conv.conv.weight.shape == (16, 1, 3)  # depthwise
    for bad in (-1, 2.5, True, "4"):
        with pytest.raises(ConfigError, match=r"model\.short_conv"):
            conv_model(short_conv=bad)


@pytest.mark.parametrize("attention", ["full", "local"])
def test_short_conv_incremental_decoding_equals_forward(attention):
    """The conv's rolling cache makes prefill + step reproduce forward's logits exactly (fp64)."""
    assert ATTENTION_REGISTRY[attention].cls.supports_decoding
    net = conv_model(attention)
    tokens = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = net(tokens)
    for prefix in (1, 3, 7):
        state = net.new_decoding_state(2)
        logits = [net.prefill(tokens[:, :prefix], state)]
        logits += [net.step(tokens[:, t], state)[:, None] for t in range(prefix, 16)]
        torch.testing.assert_close(torch.cat(logits, dim=1), expected, rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------------------------------
# The task module through the real runner, the study's configs and its driver


def test_mqar_run_writes_metrics_breakdown_and_figures(make_cfg, tmp_path):
    """A 4-step run through ``train``: val/acc (monitor, mode max) and the per-distance scalars land in
    metrics.json; the breakdown table and figure are under <run>/recall and in the CSV logger's folder."""
    import json

    from longseq.runner import train

    cfg = make_cfg(["experiment=recall/mqar", "task.seq_len=64", "task.num_pairs=4", "task.vocab_size=128",
                    "task.data.num_val=32", "task.data.num_test=32", "trainer.max_steps=4",
                    "trainer.val_check_interval=2", "model.d_model=32", "model.n_heads=1"])
    assert (cfg.task.monitor, cfg.task.mode, cfg.model.short_conv) == ("val/acc", "max", 4)
    metrics = train(cfg)
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["status"] == "completed" and 0 <= record["metrics"]["test/acc"] <= 1
    assert {"train/acc", "val/acc", "val/acc_best", "val/loss", "test/loss"} <= set(metrics)
    assert 0 <= metrics["train/acc"] <= 1
    distances = [k for k in record["metrics"] if k.startswith("test/acc_distance/")]
    assert distances and all(k.split("/")[-1] in MqarGenerator(128, 64, 4).bucket_names() for k in distances)
    csv = (tmp_path / "recall" / "test_by_distance.csv").read_text().splitlines()
    assert csv[0] == "distance,acc,questions" and sum(int(r.split(",")[2]) for r in csv[1:]) == 32 * 4
    assert (tmp_path / "recall" / "test_by_distance.png").stat().st_size > 0
    assert list((tmp_path / "csv").rglob("recall/val_by_distance_step*.png"))


def study_attentions() -> list[str]:
    from conftest import CONF
    from omegaconf import OmegaConf

    return OmegaConf.load(CONF / "recall" / "study.yaml").hydra.sweeper.params.attention.split(",")


def test_study_attentions_exist_and_build_at_both_lengths(tmp_path):
    """Every attention of the sweep is registered, gets its searched learning rate from the table, and builds
    the study's model at both lengths, recall/mqar's 256 and recall/mqar_long's 512 (a geometry the partition cannot
    tile would fail here, not in job 97)."""
    names = study_attentions()
    assert set(names) <= set(ATTENTION_REGISTRY) and len(names) == len(set(names))
    assert {"full", "local", "combiner_fixed", "combiner_axial", "linear", "performer", "routing"} <= set(names)
    for experiment, length in (("recall/mqar", 256), ("recall/mqar_long", 512)):
        for name in names:
            cfg = compose_config([f"experiment={experiment}", f"attention={name}"], tmp_path, fast=False)
            assert cfg.task.seq_len == length and cfg.task.vocab_size == length + 256
            assert cfg.optimizer.lr == cfg.recall_lr[name] and cfg.task.batch_size == 8192 // length
            module = build_module(cfg)
            assert module.net.blocks[0].attn.attention.name == name and module.net.blocks[0].short_conv is not None


def test_needle_and_mqar_share_the_study_settings(tmp_path):
    mqar_cfg = compose_config(["experiment=recall/mqar"], tmp_path, fast=False)
    needle = compose_config(["experiment=recall/needle"], tmp_path, fast=False)
    for key in ("model", "optimizer", "scheduler", "recall_lr"):
        assert mqar_cfg[key] == needle[key]
    assert mqar_cfg.trainer.max_steps == needle.trainer.max_steps
    assert needle.task.name == "needle" and build_datamodule(needle).generator.seq_len == 256
    lr_cfg = compose_config(["experiment=recall/mqar_lr"], tmp_path, fast=False)
    assert lr_cfg.hydra.sweeper.params["optimizer.lr"] == "1e-3,3e-3,1e-2" and lr_cfg.task.num_pairs == 8


def test_recall_bad_values_fail_at_instantiation_naming_the_key(tmp_path):
    cfg = compose_config(["task=mqar", "task.num_pairs=100", "task.seq_len=256"], tmp_path)
    with pytest.raises((ConfigError, InstantiationException), match=r"task\.num_pairs"):
        build_datamodule(cfg)
    with pytest.raises(ConfigError, match=r"task\.num_pairs"):
        build_module(cfg)
    cfg = compose_config(["task=mqar", "task.vocab_size=100", "task.seq_len=256"], tmp_path)
    with pytest.raises(ConfigError, match=r"task\.vocab_size"):
        build_module(cfg)
    with pytest.raises((ConfigError, InstantiationException), match=r"task\.data\.num_train"):
        build_datamodule(compose_config(["task=needle", "task.data.num_train=0"], tmp_path))
    with pytest.raises(ConfigError, match=r"model\.short_conv"):
        build_module(compose_config(["task=selective_copy", "model.short_conv=-2"], tmp_path))


def test_study_plan_status_and_lr_pick(tmp_path):
    """The driver's jobs are the sweeps' products; a completed job is skipped, a stopped one re-run, a failed
    one kept; the lr with the best val/acc_best (ties: lower val/loss) wins."""
    import json

    from longseq.report import recall_study as study

    n = len(study_attentions())
    stages = {stage: study.stage_jobs(stage, tmp_path) for stage in study.STAGES["mqar"]}
    assert [len(stages[s]) for s in study.STAGES["mqar"]] == [3 * n, 3 * n, 2 * n, 6 * 3 * 2]  # seeds: 6 headline
    assert len(study.stage_jobs("recall/needle", tmp_path)) == 2 * n
    dirs = [j.directory for jobs in stages.values() for j in jobs]
    assert len(set(dirs)) == len(dirs)

    def record(job, status, acc=None, loss=None, error=None):
        job.directory.mkdir(parents=True)
        metrics = {} if acc is None else {"val/acc_best": acc, "val/loss": loss}
        (job.directory / "metrics.json").write_text(json.dumps({"status": status, "metrics": metrics, "error": error}))

    full = [j for j in stages["recall/mqar_lr"] if "attention=full" in j.overrides]
    record(full[0], "completed", 0.9, 0.5)   # 1e-3
    record(full[1], "completed", 0.9, 0.3)   # 3e-3: same accuracy, lower loss
    record(full[2], "completed", 0.4, 0.1)   # 1e-2
    local = [j for j in stages["recall/mqar_lr"] if "attention=local" in j.overrides]
    record(local[0], "failed", error="ValueError: diverged")
    record(local[1], "failed", error="SystemExit: 1")  # Ctrl-C during fit, as Lightning reports it
    record(local[2], "completed", 0.1, 4.0)
    assert study.pick_lrs(stages["recall/mqar_lr"]) == {"full": 3e-3, "local": 1e-2}
    assert [j.status() for j in local] == ["failed", "stopped", "completed"]
    assert local[0].status() == "failed" and stages["recall/mqar"][0].status() == "not started"
    assert study.print_status({"recall/mqar_lr": stages["recall/mqar_lr"]}) == 3 * n - 4


def test_only_selects_attentions_and_settings(tmp_path):
    from longseq.report import recall_study as study

    jobs = study.stage_jobs("recall/needle", tmp_path)
    assert {j.name for j in jobs if study.selected(j, "full,local")} == {
        f"attention={a},task.seq_len={L},seed=1" for a in ("full", "local") for L in (256, 512)}
    kept = [j for j in jobs if study.selected(j, "task.seq_len=256")]
    assert len(kept) == len(study_attentions()) and all("task.seq_len=256" in j.overrides for j in kept)
    assert [j.name for j in jobs if study.selected(j, "nsa, task.seq_len=512")] == ["attention=nsa,task.seq_len=512,seed=1"]


def test_wide_table_has_a_row_per_attention_and_a_column_per_length_and_pairs():
    import pandas as pd

    from longseq.report.recall_study import wide_table

    table = pd.DataFrame([
        {"attention": "local", "task.seq_len": "256", "task.num_pairs": "8", "mean": 0.03, "std": float("nan"), "n": 1},
        {"attention": "full", "task.seq_len": "256", "task.num_pairs": "8", "mean": 0.968, "std": 0.013, "n": 3},
        {"attention": "full", "task.seq_len": "512", "task.num_pairs": "64", "mean": 0.994, "std": float("nan"), "n": 1},
    ])
    lines = wide_table(table).splitlines()
    assert lines[0] == "| attention | L = 256, D = 8 | L = 512, D = 64 |"
    assert lines[2:] == ["| full | 0.968 ± 0.013 (3) | 0.994 |", "| local | 0.030 |  |"]


def test_study_figure_has_one_panel_per_length(tmp_path):
    import pandas as pd
    from PIL import Image

    from longseq.report.recall_study import draw_figure

    table = pd.DataFrame([{"attention": a, "task.seq_len": str(L), "task.num_pairs": str(D), "mean": m, "std": 0.01}
                          for a, m in (("full", 0.9), ("local", 0.1)) for L in (256, 512) for D in (8, 32, 64)])
    path = draw_figure("mqar", table, tmp_path / "recall_mqar.png")
    width, height = Image.open(path).size
    assert width > 1.8 * height  # two panels side by side


# ----------------------------------------------------------------------------------------------------
# Learnability: labels do not leak


def train_mqar(attention: str, steps: int = 300, seed: int = 0) -> tuple[float, float]:
    """Train a 2-layer d=64 model (short conv 4) on MQAR L = 64, D = 4, V = 128 with uniform gaps; return
    (accuracy on every question, accuracy on questions at distance >= 16) over 256 test examples."""
    from longseq.tasks.recall import RecallTask

    torch.manual_seed(seed)
    gen = dict(vocab_size=128, seq_len=64, num_pairs=4, power_a=1.0)
    spec = {"name": attention, "causal": True} | ({"window": 4} if attention == "local" else {})
    task = RecallTask(model=dict(n_layers=2, d_model=64, n_heads=1, dropout=0.0, short_conv=4, mlp_ratio=2),
                      attention=spec, optimizer={}, scheduler=None, name="mqar", generator=gen)
    data = RecallDataset(MqarGenerator(**gen), steps * 32, seed, "train").tensors()
    test = RecallDataset(MqarGenerator(**gen), 256, seed, "test").tensors()
    optimizer = torch.optim.AdamW(task.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(steps):
        loss = task.step("train", tuple(t[step * 32:(step + 1) * 32] for t in data))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    task.eval()
    with torch.no_grad():
        task.step("test", test)
    per_bucket, counts = task.test_acc.per_bucket()
    far = [i for i, name in enumerate(task.bucket_names) if int(name.split("-")[0]) >= 16]
    far_acc = float((per_bucket[far].nan_to_num() * counts[far]).sum() / counts[far].sum())
    return float(task.test_acc.compute()), far_acc


def test_full_learns_mqar_where_a_short_local_window_stays_at_chance(one_thread):
    """`full` retrieves almost every answer; `local` (window 4: with two layers and the conv it reaches 12 tokens
    back) is at chance on the questions whose key is 16 or more tokens back — if a label leaked into the
    inputs near its question, `local` would find it there."""
    full_all, full_far = train_mqar("full")
    local_all, local_far = train_mqar("local")
    chance = chance_accuracy(MqarGenerator(128, 64, 4, 1.0))  # 1/64: one of the values
    assert full_all > 0.9 and full_far > 0.9
    assert local_far < chance + 0.05
    assert local_all < 0.5


def test_needle_study_takes_the_mqar_search_table(tmp_path):
    from longseq.report import recall_study as study

    table = tmp_path / "lr_table.yaml"
    assert study.lr_table_for("needle", tmp_path, {}, table) == {}  # no search yet: conf/recall/study.yaml's table
    table.write_text("recall_lr:\n  full: 0.01\n  local: 0.003\n")
    assert study.lr_table_for("needle", tmp_path, {}, table) == {"full": 0.01, "local": 0.003}


def test_a_second_driver_on_the_same_study_is_refused(tmp_path):
    """Two drivers on one study would remove each other's live job directories: the second exits, naming it."""
    import subprocess
    import sys

    from longseq.report import recall_study as study

    held = study.hold_study_lock(tmp_path)
    code = f"from pathlib import Path; from longseq.report import recall_study as s; s.hold_study_lock(Path({str(tmp_path)!r}))"
    try:
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert other.returncode != 0 and "another recall_study driver" in other.stderr and str(tmp_path) in other.stderr
    finally:
        held.close()
    study.hold_study_lock(tmp_path).close()  # free again once the first has ended


def test_needle_figure_is_accuracy_by_depth_over_seeds(tmp_path):
    from longseq.report.recall_study import by_bucket, draw_figure
    from longseq.report.runs import RunRecord

    runs = [RunRecord(path=tmp_path / f"{a}{s}", overrides={"attention": a, "task.seq_len": "256", "seed": str(s)},
                      config=None, status="completed",
                      metrics={"test/acc": 0.5, "test/acc_depth/0": 0.2 * s, "test/acc_depth/1": 1.0})
            for a in ("full", "local") for s in (1, 2)]
    table = by_bucket(runs, "test/acc_depth/", ["attention", "task.seq_len"], "depth")
    row = table[(table.attention == "full") & (table.depth == "0")].iloc[0]
    assert (row["n"], round(row["mean"], 6)) == (2, 0.3) and set(table.depth) == {"0", "1"}
    assert draw_figure("needle", table, tmp_path / "needle.png").stat().st_size > 0
