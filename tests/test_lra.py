"""Long Range Arena: released-format fixtures through the real loaders, fast_dev_run per task, the ListOps and
Pathfinder generators, key padding masks and the classifier's pooling."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from conftest import compose_config
from dataset_files import (
    CIFAR_PER_BATCH,
    LISTOPS_ROWS,
    write_aan_fixture,
    write_cifar10_fixture,
    write_imdb_fixture,
    write_listops_fixture,
    write_pathfinder_fixture,
)

from longseq.attention import ATTENTION_REGISTRY, AttentionConfigError, build_attention
from longseq.data.lra import (
    LraImageDataModule,
    LraListOpsDataModule,
    LraPathfinderDataModule,
    LraRetrievalDataModule,
    LraTextDataModule,
    listops,
    pathfinder,
)
from longseq.data.lra.common import PadCollate
from longseq.runner import build_module, train

# ----------------------------------------------------------------------------------------------------
# Fixtures written by hand in each released format


def test_listops_fixture_loads_with_lra_tokenization(tmp_path):
    write_listops_fixture(tmp_path)
    dm = LraListOpsDataModule(root=str(tmp_path), max_length=16, batch_size=4)
    dm.setup()
    tokens, labels = next(iter(dm.val_dataloader()))
    assert tokens.shape == (4, 16) and labels.tolist() == [t for _, t in LISTOPS_ROWS[:4]]
    v = listops.VOCAB
    assert tokens[0].tolist() == [v["[MIN"], v["8"], v["6"], v["X"]] + [0] * 12
    assert dm.num_classes == 10 and int(tokens.max()) < dm.vocab_size


def test_listops_hand_written_values_match_evaluator():
    for source, target in LISTOPS_ROWS:
        tree = listops.parse(listops.tokenize(source))
        assert listops.evaluate(tree) == target, source
        assert listops.to_source(tree) == source  # the generator writes exactly the released serialisation


def test_retrieval_fixture_decodes_bytes_literals(tmp_path):
    write_aan_fixture(tmp_path)
    dm = LraRetrievalDataModule(root=str(tmp_path), max_length=40, batch_size=2)
    dm.setup()
    first, second, labels = next(iter(dm.test_dataloader()))
    assert first.shape == second.shape == (2, 40) and labels.tolist() == [1, 0]
    expected = "We cite \u201cattention\u201d here.\n".encode()
    assert (second[0, : len(expected)] - 1).tolist() == list(expected)
    assert int(second[0, len(expected)]) == 0  # padding after the document
    assert dm.datasets["train"].labels.tolist() == [1, 0, 1, 0]  # "1.0" parses as 1


def test_text_reads_saved_imdb_and_validates_on_test(tmp_path):
    write_imdb_fixture(tmp_path)
    dm = LraTextDataModule(root=str(tmp_path), max_length=32, batch_size=2)
    dm.setup()
    assert len(dm.datasets["train"]) == 6 and len(dm.datasets["val"]) == len(dm.datasets["test"]) == 4
    tokens, labels = next(iter(dm.train_dataloader()))
    assert tokens.shape == (2, 32) and set(labels.tolist()) <= {0, 1}


def test_text_fails_fast_without_data(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # offline and no saved copy: the message says what to place where
    dm = LraTextDataModule(root=str(tmp_path), max_length=32, batch_size=2)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="imdb.*save_to_disk"):
        dm.setup()
    assert time.monotonic() - start < 5


def test_image_is_greyscale_cifar_from_the_cifar10_files(tmp_path):
    train_images, _ = write_cifar10_fixture(tmp_path)
    dm = LraImageDataModule(data_dir=str(tmp_path), max_length=1024, batch_size=2, download=False,
                            verify_checksums=False, val_size=4)
    dm.setup()
    tokens, labels = next(iter(dm.val_dataloader()))
    first_val = train_images[len(train_images) - 4].astype(float)
    grey = np.rint(first_val @ np.array([0.2989, 0.5870, 0.1140])).reshape(-1)
    assert tokens.shape == (2, 1024) and np.array_equal(tokens[0].numpy(), grey)
    assert labels[0] == ((len(train_images) - 4) % CIFAR_PER_BATCH) % 10  # the fixture labels i % 10 per batch


def test_pathfinder_metadata_split_and_known_empty_image(tmp_path):
    labels = write_pathfinder_fixture(tmp_path, 32, "curv_baseline", n_files=2, per_file=10)
    dm = LraPathfinderDataModule(root=str(tmp_path), resolution=32, difficulty="baseline", max_length=1024, batch_size=2)
    dm.setup()
    # 20 lines -> 16 / 2 / 2 in file order; the known empty image (file 0, sample_172) is absent here.
    assert [len(dm.datasets[s]) for s in ("train", "val", "test")] == [16, 2, 2]
    assert dm.datasets["test"].labels.tolist() == labels[18:]
    # The blacklisted empty image is skipped even though its metadata line exists.
    folder = tmp_path / "pathfinder32" / "curv_baseline"
    (folder / "imgs" / "0" / "sample_172.png").write_bytes(b"")
    lines = (folder / "metadata" / "0.npy").read_text()
    (folder / "metadata" / "0.npy").write_text("imgs/0 sample_172.png 172 1 1.0 6 2 2 0.5 1 1\n" + lines)
    dm = LraPathfinderDataModule(root=str(tmp_path), resolution=32, difficulty="baseline", max_length=1024, batch_size=2)
    dm.setup()
    assert len(dm.datasets["train"]) == 16  # 21 lines: 17 train lines, one skipped


def test_pathfinder_missing_root_names_the_generator(tmp_path):
    dm = LraPathfinderDataModule(root=str(tmp_path), resolution=32, difficulty="inter", batch_size=2)
    with pytest.raises(FileNotFoundError, match="curv_contour_length_9.*longseq.data.lra.prepare"):
        dm.setup()


# ----------------------------------------------------------------------------------------------------
# fast_dev_run per task through the real config


TINY = ["trainer.fast_dev_run=true", "task.batch_size=2", "model.n_layers=1", "model.d_model=16", "model.n_heads=2"]


@pytest.mark.parametrize("task", ["lra_listops", "lra_text", "lra_retrieval", "lra_image", "lra_pathfinder", "lra_pathx"])
def test_fast_dev_run(task, make_cfg, tmp_path):
    root = tmp_path / "lra"
    root.mkdir()
    extra = {
        "lra_listops": lambda: (write_listops_fixture(root), ["task.seq_len=32"]),
        "lra_text": lambda: (write_imdb_fixture(root), ["task.seq_len=64"]),
        "lra_retrieval": lambda: (write_aan_fixture(root), ["task.seq_len=64"]),
        "lra_image": lambda: (write_cifar10_fixture(tmp_path), ["task.data.download=false",
                                                               "task.data.verify_checksums=false", "task.data.val_size=4"]),
        "lra_pathfinder": lambda: (write_pathfinder_fixture(root, 32, "curv_contour_length_9"), []),
        # 16,384 tokens: a sparse pattern keeps the step cheap (full attention would be 16k x 16k).
        "lra_pathx": lambda: (write_pathfinder_fixture(root, 128, "curv_contour_length_14"), ["attention=fixed"]),
    }[task]()[1]
    cfg = make_cfg([f"task={task}", f"paths.data_dir={tmp_path}", *TINY, *extra])
    metrics = train(cfg)
    assert 0.0 <= metrics["test/acc"] <= 1.0 and np.isfinite(metrics["test/loss"])


def test_padded_task_rejects_attention_without_padding_support(tmp_path):
    cfg = compose_config(["task=lra_listops", "attention=performer", "task.seq_len=64"], tmp_path)
    with pytest.raises(AttentionConfigError, match="'performer' does not support key_padding_mask.*task=lra_listops"):
        build_module(cfg)
    cfg = compose_config(["task=lra_pathfinder", "attention=performer"], tmp_path)  # fixed length: no mask
    assert build_module(cfg).net.blocks[0].attn.attention.name == "performer"


def test_classifier_rejects_image_position_tables_instead_of_rewriting_them(tmp_path):
    from longseq.utils.errors import ConfigError

    cfg = compose_config(["task=lra_listops", "task.seq_len=64"], tmp_path)
    assert build_module(cfg).net.pos_emb == "sinusoidal"  # model.pos_emb follows task.pos_emb
    cfg = compose_config(["task=lra_listops", "task.seq_len=64", "model.pos_emb=image"], tmp_path)
    with pytest.raises(ConfigError, match=r"model\.pos_emb: image does not fit task=lra_listops"):
        build_module(cfg)


def test_lra_experiments_compose(tmp_path):
    for protocol, layers, pooling in (("lra", 4, "cls"), ("lra_small", 2, "mean")):
        cfg = compose_config([f"experiment={protocol}/listops"], tmp_path, fast=False)
        assert (cfg.model.n_layers, cfg.task.pooling, cfg.task.name) == (layers, pooling, "lra_listops")
        assert cfg.task.seq_len == 2048 and cfg.task.max_length == (2047 if pooling == "cls" else 2048)


# ----------------------------------------------------------------------------------------------------
# Key padding mask (full attention) and pooling


def test_full_attention_gives_padded_keys_zero_weight():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[0, 5:] = True
    pad[1, :] = True  # an all-padded document stays finite
    for causal in (False, True):
        attn = build_attention("full", causal=causal).eval()
        P = attn.attention_matrix(q, k, v, key_padding_mask=pad)
        assert torch.allclose(P.sum(-1), torch.ones_like(P[..., 0]))
        assert (P[0, :, :, 5:] == 0).all()
        assert torch.allclose(attn(q, k, v, key_padding_mask=pad), P @ v)
        # Real positions see exactly what the unpadded document gives them.
        assert torch.allclose(attn(q, k, v, key_padding_mask=pad)[0, :, :5], attn(q[:1, :, :5], k[:1, :, :5], v[:1, :, :5])[0])
        assert torch.isfinite(attn(q, k, v, key_padding_mask=pad)).all()


def test_mean_and_cls_pooling_ignore_padding(tmp_path):
    docs = [np.array([3, 5, 7, 2], dtype=np.int16), np.array([4, 4], dtype=np.int16)]
    for pooling in ("mean", "cls"):
        cfg = compose_config(["task=lra_listops", "task.seq_len=16", f"task.pooling={pooling}"], tmp_path)
        module = build_module(cfg).eval()
        batch = [(d, 0) for d in docs]
        short, _ = PadCollate(16, pad_to_longest=True)(batch)  # length 4
        full, _ = PadCollate(cfg.task.max_length)(batch)
        with torch.no_grad():
            assert torch.allclose(module.encode(short), module.encode(full), atol=1e-5)


def test_retrieval_is_a_shared_dual_encoder_with_nli_interaction(tmp_path):
    cfg = compose_config(["task=lra_retrieval", "task.seq_len=16"], tmp_path)
    module = build_module(cfg).eval()
    a, b = torch.randint(1, 257, (3, 15)), torch.randint(1, 257, (3, 15))
    with torch.no_grad():
        u, v = module.encode(a), module.encode(b)
        expected = module.classifier(torch.cat([u, v, u * v, u - v], -1))
        assert torch.allclose(module(a, b), expected, atol=1e-5)
    assert module.classifier[0].in_features == 4 * cfg.model.d_model


# ----------------------------------------------------------------------------------------------------
# Generators


def test_listops_generator_labels_lengths_and_classes():
    rows = listops.generate(1500, seed=3, max_depth=4, min_length=20, max_length=200)
    assert len({s for s, _ in rows}) == len(rows)  # deduplicated
    lengths = []
    for source, target in rows:
        tokens = listops.tokenize(source)
        lengths.append(len(tokens))
        assert listops.evaluate(listops.parse(tokens)) == target
        assert set(tokens) <= set(listops.SYMBOLS)
    assert 20 < min(lengths) and max(lengths) < 200
    assert {t for _, t in rows} == set(range(10))
    assert max(lengths) > 150 and min(lengths) < 40  # the bounds are actually approached
    deep = listops.generate(30, seed=0)  # LRA defaults: 500 < length < 2000
    assert all(500 < len(listops.tokenize(s)) < 2000 for s, _ in deep)


def test_listops_writer_round_trips_through_the_loader(tmp_path):
    listops.write_dataset(tmp_path, n_train=20, n_val=5, n_test=5, seed=1, max_depth=3, min_length=5, max_length=60)
    with open(tmp_path / "listops-1000" / "basic_val.tsv", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    assert rows[0] == ["Source", "Target"] and len(rows) == 6
    dm = LraListOpsDataModule(root=str(tmp_path), max_length=64, batch_size=5)
    dm.setup()
    assert dm.datasets["val"].labels.tolist() == [int(r[1]) for r in rows[1:]]


def test_pathfinder_positive_and_negative_differ_only_in_markers():
    spec = pathfinder.PathfinderSpec.for_release(32, "inter")
    for seed in range(5):
        img0, label0, scene0, markers0 = pathfinder.generate_example(np.random.default_rng(seed), spec, label=0)
        img1, label1, scene1, markers1 = pathfinder.generate_example(np.random.default_rng(seed), spec, label=1)
        assert (label0, label1) == (0, 1)
        for a, b in zip(scene0.targets + scene0.distractors, scene1.targets + scene1.distractors):
            assert np.array_equal(a, b)  # identical scene
        ends_a, ends_b = (pathfinder.snake_ends(t) for t in scene1.targets)
        on = lambda point, ends: any(np.allclose(point, e) for e in ends)  # noqa: E731
        assert on(markers1[0], ends_a) and on(markers1[1], ends_a) and not np.allclose(markers1[0], markers1[1])
        assert np.array_equal(markers0[0], markers1[0]) and on(markers0[1], ends_b)  # one marker moved to snake B
        # Pixels far from every marker are the same in both images.
        yy, xx = np.mgrid[:32, :32]
        near = np.zeros((32, 32), dtype=bool)
        for x, y in np.concatenate([markers0, markers1]) / spec.antialias:
            near |= (xx + 0.5 - x) ** 2 + (yy + 0.5 - y) ** 2 <= (spec.marker_radius + 1.5) ** 2
        assert np.array_equal(img0[~near], img1[~near]) and not np.array_equal(img0, img1)


@pytest.mark.slow  # 2,000 generated images
def test_pathfinder_class_balance_over_2000_samples():
    # Cheap geometry (16 x 16, short snakes, no distractors) so 2,000 full samples render in seconds; the
    # label logic is the same for every geometry.
    spec = pathfinder.PathfinderSpec(resolution=16, contour_length=3, seed_distance=4.0, num_distractor_snakes=0)
    rng = np.random.default_rng(0)
    labels = [pathfinder.generate_example(rng, spec)[1] for _ in range(2000)]
    assert abs(np.mean(labels) - 0.5) <= 0.02


def test_pathfinder_writer_round_trips_through_the_loader(tmp_path):
    spec = pathfinder.PathfinderSpec.for_release(32, "baseline")
    pathfinder.write_dataset(tmp_path, 32, "baseline", n_samples=12, per_file=4, seed=0, spec=spec)
    dm = LraPathfinderDataModule(root=str(tmp_path), resolution=32, difficulty="baseline", max_length=1024, batch_size=2)
    dm.setup()
    lines = pathfinder.metadata_lines(tmp_path / "pathfinder32" / "curv_baseline")
    assert [len(dm.datasets[s]) for s in ("train", "val", "test")] == [10, 1, 1]
    assert dm.datasets["test"].labels.tolist() == [int(lines[-1][3])]
    assert max(int(dm.datasets["train"].fields[0][0].max()), 0) > 200  # white strokes on black


# ----------------------------------------------------------------------------------------------------
# Key padding in the sparse family (softmax over a fixed pattern + the padding channel)


SPARSE_FAMILY = ["local", "longformer", "fixed", "axial", "strided", "logsparse", "random", "bigbird"]


@pytest.mark.parametrize("name", SPARSE_FAMILY)
def test_sparse_family_gives_padded_keys_zero_weight(name):
    from longseq.attention import ATTENTION_REGISTRY
    from longseq.attention.registry import accepted_kwargs

    cls = ATTENTION_REGISTRY[name].cls
    assert cls.supports_padding_mask
    L = 16
    knobs = {key: 4 for key in ("block_size", "window") if key in accepted_kwargs(cls)}
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, L, 4, dtype=torch.float64) for _ in range(3))
    pad = torch.zeros(2, L, dtype=torch.bool)
    pad[0, 11:] = True  # a padded tail
    pad[1, 2:7] = True  # a padded stretch inside (exercises rows whose allowed keys are all padded)
    for causal in [c for c in (False, True) if (cls.supports_causal if c else cls.supports_bidirectional)]:
        attn = build_attention(name, causal=causal, seq_len=L, n_heads=2, head_dim=4, **knobs).eval()
        plain = attn.attention_matrix(q, k, v)
        P = attn.attention_matrix(q, k, v, key_padding_mask=pad)
        padded_key = pad[:, None, None, :].expand_as(P)
        has_real = ((plain > 0) & ~padded_key).any(-1, keepdim=True)
        assert (P[padded_key & has_real.expand_as(P)] == 0).all()
        expected = plain.masked_fill(padded_key, 0.0)
        expected = torch.where(has_real, expected / expected.sum(-1, keepdim=True).clamp_min(1e-300), plain)
        assert torch.allclose(P, expected, atol=1e-9)  # renormalised over the real keys of the pattern
        assert torch.allclose(attn(q, k, v, key_padding_mask=pad), P @ v, atol=1e-10)
        assert torch.allclose(attn(q, k, v), plain @ v, atol=1e-10)  # unchanged without a mask


@pytest.mark.parametrize("name", ["fixed", *sorted(n for n in ATTENTION_REGISTRY if n.startswith("combiner_"))])
def test_padded_task_trains_with_sparse_and_combiner_attentions(name, make_cfg, tmp_path):
    root = tmp_path / "lra"
    root.mkdir()
    write_listops_fixture(root)
    cfg = make_cfg(["task=lra_listops", f"paths.data_dir={tmp_path}", f"attention={name}", "task.seq_len=32", *TINY])
    assert np.isfinite(train(cfg)["test/loss"])


# ----------------------------------------------------------------------------------------------------
# Key padding in Combiner-Fixed: padded keys out of direct sets and summaries, empty regions masked


@pytest.mark.parametrize("summary", ["max", "mean", "deepsets_max"])
@pytest.mark.parametrize("causal", [False, True])
def test_combiner_fixed_key_padding(summary, causal):
    L, m = 16, 4
    attn = build_attention("combiner_fixed", causal=causal, block_size=m, summary=summary, seq_len=L, n_heads=2,
                           head_dim=4).double().eval()
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, L, 4, dtype=torch.float64) for _ in range(3))
    pad = torch.zeros(2, L, dtype=torch.bool)
    pad[0, 9:] = True  # segment 2 half padded, segment 3 entirely padded (an empty region)
    pad[1, 1:3] = True
    P = attn.attention_matrix(q, k, v, key_padding_mask=pad)
    assert torch.allclose(P.sum(-1), torch.ones_like(P[..., 0]))
    assert (P[0, :, :, 9:] == 0).all() and (P[1, :, :, 1:3] == 0).all()
    assert torch.allclose(attn(q, k, v, key_padding_mask=pad), P @ v, atol=1e-10)
    # Padded keys' contents cannot matter: perturbing them leaves every output unchanged.
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 9:] += 5 * torch.randn_like(k2[0, :, 9:])
    v2[0, :, 9:] += 5
    assert torch.allclose(attn(q, k2, v2, key_padding_mask=pad), attn(q, k, v, key_padding_mask=pad), atol=1e-10)
    # A document without padding is unaffected by passing an all-False mask.
    none = torch.zeros_like(pad)
    assert torch.allclose(attn(q, k, v, key_padding_mask=none), attn(q, k, v), atol=1e-10)
    if not causal:  # Combiner keeps full support over the real keys
        assert (P[1][..., ~pad[1]] > 0).all()
