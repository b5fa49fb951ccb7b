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
    guess_floor,
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


@pytest.mark.slow  # a large draw of examples
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


def test_mqar_question_order_says_nothing_about_the_pair_asked():
    """The drawn slots go to the pairs in a random order: the first question asks each pair equally often (Zoology's
    order would give pair 0 most first questions), so answering it with the first value scores 1/D."""
    from scipy.stats import chisquare

    gen, inputs, labels, _ = mqar(2000, num_pairs=8, seq_len=128)
    first = (labels != IGNORE_INDEX).int().argmax(1)
    pair = [inputs[i, 0:16:2].tolist().index(int(inputs[i, t])) for i, t in enumerate(first.tolist())]
    assert chisquare(np.bincount(pair, minlength=8)).pvalue > 0.001
    first_value = (labels[torch.arange(len(first)), first] == inputs[:, 1]).float().mean()
    assert abs(float(first_value) - guess_floor(gen)) < 4 * (1 / 8 * 7 / 8 / 2000) ** 0.5


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


def needles(n: int = 400, split: str = "train", **kw) -> tuple[NeedleGenerator, list[dict]]:
    """``n`` needle examples parsed back from their bytes: the needles (key, digit, start) in text order and the
    questions (key, digit, label position, bucket)."""
    import re

    gen = NeedleGenerator(**(dict(seq_len=256) | kw))
    inputs, labels, buckets = RecallDataset(gen, n, 0, split).tensors()
    parsed = []
    for x, y, b in zip(inputs, labels, buckets):
        text = bytes(x.numpy().astype(np.uint8)).decode()
        tail = gen.num_questions * gen.question_len - 1  # the questions, the last digit cut (it is the last label)
        found = [(m["key"], m["digit"], m.start()) for m in re.finditer(r" (?P<key>[a-z]+):(?P<digit>\d)\.", text)]
        asked = (y != IGNORE_INDEX).nonzero()[:, 0].tolist()
        questions = [(text[t - gen.key_len:t], chr(int(y[t])), t, int(b[t])) for t in asked]
        parsed.append({"text": text, "needles": found, "questions": questions, "hay": text[:-tail]})
    return gen, parsed


def test_needles_carry_distinct_keys_and_digits_and_each_question_asks_one_by_its_key():
    gen, examples = needles(200, num_needles=4, num_questions=3)
    for ex in examples:
        keys, digits = [k for k, _, _ in ex["needles"]], [d for _, d, _ in ex["needles"]]
        assert len(ex["needles"]) == 4 and len(set(keys)) == 4 and len(set(digits)) == 4
        assert ex["hay"].count(":") == 4 and sum(c.isdigit() for c in ex["hay"]) == 4  # only the needles' own
        assert [t for _, _, t, _ in ex["questions"]] == [256 - 1 - 9 * i for i in (2, 1, 0)]  # 9-byte questions
        for key, digit, t, _ in ex["questions"]:
            assert dict(zip(keys, digits))[key] == digit  # the label is the asked needle's digit
            assert ex["text"][t - 1 - gen.key_len:t + 1] == f" {key}:"  # ... predicted right after its key


@pytest.mark.parametrize("split,grid", [("train", [0.0, 0.25, 0.5, 0.75, 1.0]), ("val", [0.0, 0.25, 0.5, 0.75, 1.0]),
                                        ("test", [0.125, 0.375, 0.625, 0.875])])
def test_needle_depths_are_jittered_around_the_split_grid_and_the_test_grid_is_held_out(split, grid):
    """Each needle starts after round(depth x F) filler bytes, depth within the jitter of its split's grid; the
    question's bucket names the grid depth of the needle it asks."""
    gen, examples = needles(300, split, jitter=0.05)
    names = gen.bucket_names()
    seen, repeats = set(), 0
    for ex in examples:
        starts = {k: start for k, _, start in ex["needles"]}
        order = sorted(starts, key=starts.get)
        for q, (key, _, _, bucket) in enumerate(ex["questions"]):
            asked_before = key in [k for k, *_ in ex["questions"][:q]]
            assert (names[bucket] == "repeat") == asked_before  # a needle asked again is not a depth sample
            if asked_before:
                repeats += 1
                continue
            before = starts[key] - gen.needle_len * order.index(key)  # filler bytes before this needle
            depth = float(names[bucket])
            assert depth in grid and abs(before / gen.filler - depth) <= 0.05 + 1 / gen.filler
            seen.add(depth)
    assert seen == set(grid) and repeats > 0  # every grid depth is used, and only those


def test_a_model_without_the_key_cannot_exceed_the_guessing_floor():
    """Whatever a key-blind model reads (the needles' order, their depths, the other questions), the asked needle is
    uniform among the K: every key-blind rule answers at 1/K (here within 4 standard errors), the key-reading rule
    always, and the digits do not help (they are distinct: no majority to bet on)."""
    K = 4
    gen, examples = needles(1500, num_needles=K, num_questions=2)
    assert guess_floor(gen) == 1 / K and chance_accuracy(gen) == 0.1
    rules = {f"needle {r} in text order": (lambda ex, q, r=r: ex["needles"][r][1]) for r in range(K)}
    rules["the needle nearest the grid depth 0.5"] = lambda ex, q: min(
        ex["needles"], key=lambda n: abs(n[2] / len(ex["hay"]) - 0.5))[1]
    rules["the last question's needle"] = lambda ex, q: ex["questions"][0][1]  # q = 1 asks after question 0
    rules["the largest digit"] = lambda ex, q: max(d for _, d, _ in ex["needles"])
    questions = [(ex, q) for ex in examples for q in (1,)]
    stderr = (1 / K * (1 - 1 / K) / len(questions)) ** 0.5
    for name, rule in rules.items():
        accuracy = np.mean([rule(ex, q) == ex["questions"][q][1] for ex, q in questions])
        assert abs(accuracy - 1 / K) < 4 * stderr, (name, accuracy)
    keyed = np.mean([dict((k, d) for k, d, _ in ex["needles"])[ex["questions"][q][0]] == ex["questions"][q][1]
                     for ex, q in questions])
    assert keyed == 1.0


def test_needle_bad_values_name_the_key():
    for kw, key in ((dict(depths=[0.5, 1.2]), "task.depths"), (dict(test_depths=[]), "task.test_depths"),
                    (dict(seq_len=60), "task.seq_len"), (dict(vocab_size=300), "task.vocab_size"),
                    (dict(num_needles=35), "task.num_needles"), (dict(jitter=0.7), "task.depth_jitter"),
                    (dict(num_questions=0), "task.num_questions")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            NeedleGenerator(**(dict(seq_len=256) | kw))
    assert NeedleGenerator(seq_len=2048).filler > 1900  # the study's longest needle


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
# The task module through the real runner


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
    assert 0 <= record["metrics"]["test/in_example"] <= 1 and 0 <= record["metrics"]["test/in_example_acc"] <= 1


def test_in_example_answers_count_the_candidates_and_their_precision(tmp_path):
    """Questions answered right, with another value of the example, with a value absent from it, and with a key:
    the first two are in the example (share 1/2), and half of those are right (precision 1/2)."""
    from longseq.tasks.recall import RecallTask

    gen = dict(vocab_size=64, seq_len=32, num_pairs=4, power_a=1.0)
    task = RecallTask(model=dict(n_layers=1, d_model=16, n_heads=1), attention={"name": "full", "causal": True},
                      optimizer={}, scheduler=None, name="mqar", generator=gen)
    inputs, labels, buckets = RecallDataset(MqarGenerator(**gen), 8, 0, "val").tensors()
    asked = labels != IGNORE_INDEX
    rows, targets = asked.nonzero()[:, 0], labels[asked]
    choice = torch.arange(len(targets)) % 4
    other_value = torch.tensor([next(v for v in inputs[r, 1:8:2].tolist() if v != t) for r, t in zip(rows, targets)])
    absent = torch.tensor([next(v for v in range(32, 64) if v not in inputs[r].tolist()) for r in rows])
    key = inputs[rows, 0]
    predicted = torch.where(choice == 0, targets, torch.where(choice == 1, other_value,
                                                              torch.where(choice == 2, absent, key)))
    task.question_logits = lambda x, y: (torch.nn.functional.one_hot(predicted, 64).float(), asked)
    task.step("val", (inputs, labels, buckets))
    share, precision = task.val_answers.compute()
    assert torch.isclose(share, torch.tensor(0.5)) and torch.isclose(precision, torch.tensor(0.5))
    assert torch.isclose(task.val_acc.compute(), torch.tensor(0.25))


def test_recall_bad_values_fail_at_instantiation_naming_the_key(tmp_path):
    cfg = compose_config(["task=mqar", "task.num_pairs=100", "task.seq_len=256", "task.vocab_size=512"], tmp_path)
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


@pytest.mark.slow  # ~60 s of training
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


def test_mqar_defaults_take_the_tasks_short_conv_on_every_backbone(tmp_path):
    """``task=mqar`` asks for the short causal convolution through ``task.short_conv``; other tasks do not."""
    for model in ("transformer", "transformer_6l512", "transformer_12l768"):
        cfg = compose_config(["task=mqar", f"model={model}"], tmp_path, fast=False)
        assert (cfg.model.short_conv, cfg.task.seq_len, cfg.task.vocab_size, cfg.task.num_pairs) == (4, 64, 128, 8)
    assert compose_config([], tmp_path).model.short_conv is None
    assert compose_config(["task=mqar", "model.short_conv=null"], tmp_path).model.short_conv is None


@pytest.mark.slow
def test_mqar_on_its_defaults_learns_within_the_default_budget(tmp_path):
    """``python train.py task=mqar`` as it comes (the default model and its 300 steps): it used to end at test
    accuracy 0.0004 (V = 8,192 at L = 256)."""
    from longseq.runner import train

    cfg = compose_config(["task=mqar", "trainer.enable_progress_bar=false", "extras.print_config=false"], tmp_path,
                         fast=False)
    assert cfg.trainer.max_steps == 300
    assert train(cfg)["test/acc"] > 0.9


def train_needle(hide_key: bool, steps: int = 400) -> float:
    """Train `full` (the study's backbone and recipe: d 64, 100 warm-up steps to lr 3e-3, gradients clipped at 1) on
    the needle at L = 128, K = 4; test accuracy on held-out depths. ``hide_key``: every question's key bytes are
    replaced by the same letters, in training and test alike."""
    from longseq.tasks.recall import RecallTask

    torch.manual_seed(0)
    gen = dict(seq_len=128, num_needles=4, num_questions=4, key_len=6)
    task = RecallTask(model=dict(n_layers=2, d_model=64, n_heads=1, dropout=0.0, short_conv=4, mlp_ratio=2,
                                 pos_emb="none"), attention={"name": "full", "causal": True}, optimizer={},
                      scheduler=None, name="needle", generator=gen)
    generator = NeedleGenerator(**gen)

    def batch(split: str, count: int, offset: int = 0) -> tuple[torch.Tensor, ...]:
        examples = RecallDataset(generator, offset + count, 0, split)
        inputs, labels, buckets = (torch.stack(c) for c in zip(*(examples[i] for i in range(offset, offset + count))))
        if hide_key:
            for t in (labels[0] != IGNORE_INDEX).nonzero()[:, 0].tolist():  # the questions sit at the same places
                inputs[:, t - generator.key_len:t] = ord("x")
        return inputs, labels, buckets

    optimizer = torch.optim.AdamW(task.parameters(), lr=3e-3, weight_decay=0.0)
    warm_up = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))
    for step in range(steps):
        loss = task.step("train", batch("train", 32, 32 * step))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(task.parameters(), 1.0)
        optimizer.step()
        warm_up.step()
    task.eval()
    with torch.no_grad():
        task.step("test", batch("test", 256))
    return float(task.test_acc.compute())


@pytest.mark.slow
def test_a_trained_model_without_the_question_key_stays_at_the_guessing_floor(one_thread):
    """The same model and budget: with the keys it answers the held-out depths; with every question's key hidden it
    can only pick one of the K needles' digits, 1/K (distractors carry equally plausible answers)."""
    floor = guess_floor(NeedleGenerator(seq_len=128))
    assert train_needle(hide_key=False) > 0.8
    assert train_needle(hide_key=True) < floor + 0.05


# ----------------------------------------------------------------------------------------------------
# Placements and fillers (issue 44)


def issue33_mqar_example(gen: MqarGenerator, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """The MQAR generator as issue 33 ran it (git history, before placements): ``start`` must reproduce it."""
    D, L = gen.num_pairs, gen.seq_len
    chosen = rng.choice(len(gen.key_ids), size=D, replace=False)
    keys = gen.key_ids[chosen]
    values = rng.choice(gen.value_ids, size=D, replace=False)
    gaps = rng.choice(gen.space, size=D, replace=False, p=gen.gap_p)
    asked = rng.permutation(D)
    unused = np.ones(len(gen.key_ids), dtype=bool)
    unused[chosen] = False
    fillers = gen.key_ids[unused]
    inputs = fillers[rng.integers(0, len(fillers), size=L)]
    inputs[0:2 * D:2], inputs[1:2 * D:2] = keys, values
    where = 2 * D + 2 * gaps
    inputs[where] = keys[asked]
    labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
    labels[where] = values[asked]
    buckets = np.full(L, -1, dtype=np.int64)
    buckets[where] = np.floor(np.log2(where - 2 * asked)).astype(np.int64)
    return inputs, labels, buckets


@pytest.mark.parametrize("kw", [dict(), dict(seq_len=1024, vocab_size=1280, num_pairs=16), dict(power_a=1.0)])
def test_mqar_start_is_the_default_and_reproduces_issue_33s_examples(kw):
    from longseq.data.recall import example_rng

    gen = MqarGenerator(**(dict(vocab_size=512, seq_len=256, num_pairs=8) | kw))
    assert (gen.placement, gen.filler) == ("start", "unused_keys")
    for i in range(20):
        new = gen.example(example_rng(1, "train", i), "train")
        old = issue33_mqar_example(gen, example_rng(1, "train", i))
        assert all(np.array_equal(a, b) for a, b in zip(new, old))


def asked_pairs(gen: MqarGenerator, drawn) -> list[tuple[int, int, int, int]]:
    """(example, question position, key position, value position) of every question of ``drawn``."""
    rows, where = np.nonzero(drawn.source >= 0)
    return [(r, t, drawn.source[r, t] - 1, drawn.source[r, t]) for r, t in zip(rows, where)]


@pytest.mark.parametrize("filler", ["unused_keys", "vocab"])
def test_mqar_scattered_puts_the_pairs_anywhere_in_the_first_half_and_the_questions_after(filler):
    """Pairs on random even slots of the first half (so a pair is not tied to a region), each key asked once in the
    second half, the label its value, the source the value's position, the bucket the distance to the key; with key
    fillers the answer and the key occur exactly once before the question."""
    gen = MqarGenerator(512, 256, 8, placement="scattered", filler=filler)
    drawn = RecallDataset(gen, 150, 0, "train").drawn()
    key_slots = set()
    for r, t, key_at, value_at in asked_pairs(gen, drawn):
        x = drawn.inputs[r].tolist()
        assert key_at % 2 == 0 and key_at < 128 <= t and t % 2 == 0
        assert x[key_at] == x[t] and drawn.labels[r, t] == x[value_at] and gen.vocab_size // 2 <= x[value_at]
        assert 2 ** drawn.buckets[r, t] <= t - key_at < 2 ** (drawn.buckets[r, t] + 1)
        assert x[:t].count(x[t]) == 1  # the key occurs once before its question (vocab fillers skip the keys)
        if filler == "unused_keys":
            assert x[:t].count(x[value_at]) == 1
        key_slots.add(key_at // 2)
    assert len(key_slots) == 64  # every slot of the first half holds a pair in some example
    assert (np.count_nonzero(drawn.labels != IGNORE_INDEX, axis=1) == 8).all()


def test_mqar_vocab_fillers_include_values_never_the_examples_keys():
    gen = MqarGenerator(512, 256, 8, placement="scattered", filler="vocab")
    drawn = RecallDataset(gen, 100, 0, "train").drawn()
    own_values = 0
    for r in range(100):
        pairs = {t for _, t, k, v in asked_pairs(gen, drawn) if _ == r for t in (k, v)}
        asked = set(np.nonzero(drawn.labels[r] != IGNORE_INDEX)[0])
        fillers = [drawn.inputs[r, t] for t in range(256) if t not in pairs and t not in asked]
        keys = {drawn.inputs[r, t] for t in asked}
        assert not keys & set(fillers)
        assert np.mean(np.asarray(fillers) >= 256) > 0.3  # about half the fillers are values
        own_values += len(set(fillers) & set(drawn.labels[r][drawn.labels[r] >= 0].tolist()))
    assert own_values > 0  # the example's own values appear as fillers too


def test_mqar_spread_interleaves_pairs_and_questions_each_question_after_its_pair():
    """Each question comes after the pair it asks (its key once before it, the label its value), pairs come after
    questions too, and the floor is 1 / (pairs before the question), between 1/D and 1."""
    gen = MqarGenerator(512, 256, 8, power_a=1.0, placement="spread")
    drawn = RecallDataset(gen, 200, 0, "train").drawn()
    interleaved = 0
    for r, t, key_at, value_at in asked_pairs(gen, drawn):
        assert key_at < t and drawn.inputs[r, key_at] == drawn.inputs[r, t]
        assert drawn.labels[r, t] == drawn.inputs[r, value_at]
        earlier = [j for j in range(t) if drawn.inputs[r, j] == drawn.inputs[r, t]]
        assert [j for j in earlier if drawn.labels[r, j] == IGNORE_INDEX] == [key_at]  # else only earlier questions
    for r in range(200):
        asked = np.nonzero(drawn.labels[r] != IGNORE_INDEX)[0]
        values_at = np.nonzero(drawn.inputs[r] >= 256)[0]
        interleaved += values_at.max() > asked.min()
    assert interleaved > 100  # a pair after a question in most examples
    assert 1 / 8 < guess_floor(gen) < 0.5
    with pytest.raises(ConfigError, match=r"task\.power_a"):
        MqarGenerator(512, 256, 8, placement="spread")
    for key, kw in (("task.placement", dict(placement="middle")), ("task.filler", dict(filler="noise"))):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            MqarGenerator(512, 256, 8, **kw)


@pytest.mark.parametrize("kw", [dict(placement="scattered"), dict(placement="scattered", filler="vocab"),
                                dict(placement="spread", power_a=1.0)])
def test_a_key_blind_rule_stays_at_the_guessing_floor_in_every_layout(kw):
    """Without the question's key a rule can only pick a pair: the first pair's value, the latest pair's before the
    question or the nearest value token before it answer at most the guessing floor (within 4 standard errors)."""
    gen = MqarGenerator(512, 256, 8, **kw)
    drawn = RecallDataset(gen, 600, 0, "test").drawn()
    questions = asked_pairs(gen, drawn)
    # every pair's value position: the value tokens when fillers are keys, else the asked ones (every pair is asked)
    pairs_at = {r: list(np.nonzero(drawn.inputs[r] >= 256)[0]) if kw.get("filler") is None else
                sorted(set(drawn.source[r][drawn.source[r] >= 0])) for r in range(600)}
    rules = {
        "first pair": lambda r, t: drawn.inputs[r, pairs_at[r][0]],
        "latest pair before": lambda r, t: drawn.inputs[r, max(v for v in pairs_at[r] if v < t)],
        "nearest value token": lambda r, t: next(drawn.inputs[r, j] for j in range(t - 1, -1, -1)
                                                 if drawn.inputs[r, j] >= 256),
    }
    floor = guess_floor(gen)
    stderr = (floor * (1 - floor) / len(questions)) ** 0.5
    for name, rule in rules.items():
        accuracy = np.mean([rule(r, t) == drawn.labels[r, t] for r, t, _, _ in questions])
        assert accuracy < floor + 4 * stderr, (name, accuracy, floor)


def test_the_short_window_covers_the_stated_share():
    from longseq.data.recall import covering_window, distances

    for kw in (dict(), dict(placement="scattered", filler="vocab")):
        gen = MqarGenerator(512, 256, 8, **kw)
        window = covering_window(gen, 0.15, 500)
        found = distances(gen, 500)
        assert window & (window - 1) == 0  # a power of two
        assert np.mean(found < window) >= 0.15 > np.mean(found < window // 2)
    with pytest.raises(ConfigError, match="recall_short_share"):
        covering_window(MqarGenerator(512, 256, 8), 1.5)


@pytest.mark.parametrize("placement", ["scattered", "spread"])
def test_needles_scattered_or_spread_keep_their_keys_values_and_labels(placement):
    """Uniform depths in every split (no grid: quarter buckets); spread puts each question after its needle; the
    label is the asked needle's value and the source points at it."""
    gen = NeedleGenerator(seq_len=512, num_needles=6, num_questions=5, placement=placement)
    assert gen.bucket_names() == ["0-0.25", "0.25-0.5", "0.5-0.75", "0.75-1", "repeat"]
    for split in ("train", "test"):
        drawn = RecallDataset(gen, 80, 0, split).drawn()
        interleaved = 0
        for r in range(80):
            text = bytes(drawn.inputs[r].astype(np.uint8)).decode()
            asked = np.nonzero(drawn.labels[r] != IGNORE_INDEX)[0]
            for t in asked:
                v = drawn.source[r, t]
                key = text[t - gen.key_len:t]
                assert text[v - gen.key_len - 1:v - 1] == key and chr(drawn.labels[r, t]) == text[v]  # its needle
                assert v < t - gen.key_len
            if placement == "spread":
                needles = [m.start() for m in __import__("re").finditer(r" [a-z]+:\d\.", text)]
                interleaved += max(needles) > asked.min()
        assert placement == "scattered" or interleaved > 10


def test_more_needles_than_digits_take_capitals_the_haystack_never_shows():
    from longseq.data.recall import DIGITS, HAYSTACK, NEEDLE_VALUES

    gen = NeedleGenerator(seq_len=1024, num_needles=34, num_questions=16, placement="scattered")
    assert len(gen.answer_ids) == 34 and not set(map(chr, NEEDLE_VALUES)) & set(HAYSTACK)
    assert np.array_equal(NeedleGenerator(seq_len=256).answer_ids, DIGITS) and guess_floor(gen) == 1 / 34
    drawn = RecallDataset(gen, 20, 0, "train").drawn()
    for r in range(20):
        asked = drawn.labels[r] != IGNORE_INDEX
        values = {drawn.inputs[r, v] for v in drawn.source[r, asked]}
        assert values <= set(NEEDLE_VALUES.tolist())
    with pytest.raises(ConfigError, match=r"task\.num_needles"):
        NeedleGenerator(seq_len=1024, num_needles=35)
