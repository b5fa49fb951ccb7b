"""Language modeling (enwik8, text8, WikiText-103, Wiki-40B) and masked LM (C4) on tiny fixtures written in each
dataset's real format, through the real download / tokenize / cache / batching code."""

from __future__ import annotations

import time
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config
from dataset_files import english_like, enwik8_payload, text8_payload, write_byte_zip

from longseq.data import text as text_data
from longseq.data.c4 import FIRST_NORMAL_ID, MASK_ID, C4MLMDataModule, bert_mask, pack_segments
from longseq.data.text import (
    BOS_ID,
    EOS_ID,
    IGNORE_INDEX,
    PAD_ID,
    Enwik8DataModule,
    EvalShardSampler,
    EvalWindows,
    Text8DataModule,
    TrainWindows,
    split_bounds,
)
from longseq.data.wiki40b import Wiki40bDataModule, wiki40b_to_text
from longseq.data.wikitext import WikiText103DataModule
from longseq.runner import build_datamodule, build_module, evaluate, train


def save_hf(data_dir: Path, name: str, splits: dict[str, dict[str, list]]) -> None:
    """A ``DatasetDict.save_to_disk`` copy at ``<data_dir>/<name>/hf`` (what an offline machine is told to place)."""
    import datasets

    datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in splits.items()}).save_to_disk(str(data_dir / name / "hf"))


def write_wikitext_fixture(data_dir: Path) -> None:
    def lines(seed, unseen=()):
        out = [" = Title = ", ""]
        for s in english_like(300, seed):
            out.append(" " + s.replace(".", " .") + " ")
        out += ["", *unseen]
        return {"text": [line + "\n" if line else "" for line in out]}

    save_hf(data_dir, "wikitext103", {"train": lines(0), "validation": lines(1), "test": lines(2, [" zyzzyva @-@ word "])})


def wiki40b_article(title: str, seed: int) -> str:
    sents = english_like(60, seed)
    return (f"\n_START_ARTICLE_\n{title}\n_START_SECTION_\nHistory\n_START_PARAGRAPH_\n{' '.join(sents[:3])}_NEWLINE_"
            f"{' '.join(sents[3:])}\n_START_SECTION_\nLegacy\n_START_PARAGRAPH_\n{sents[0]}")


def write_wiki40b_fixture(data_dir: Path) -> None:
    def split(offset, n):
        return {"wikidata_id": [f"Q{offset + i}" for i in range(n)],
                "text": [wiki40b_article(f"Article {offset + i}", offset + i) for i in range(n)],
                "version_id": [str(1000 + i) for i in range(n)]}

    save_hf(data_dir, "wiki40b", {"train": split(0, 30), "validation": split(100, 4), "test": split(200, 4)})


def write_c4_fixture(data_dir: Path) -> None:
    def split(offset, n):
        docs = ["\n".join(english_like(int(10 + 40 * (i % 5)), offset + i)) for i in range(n)]
        return {"text": docs, "timestamp": ["2019-04-25T12:57:54Z"] * n,
                "url": [f"https://example.com/{offset + i}" for i in range(n)]}

    save_hf(data_dir, "c4", {"train": split(0, 60), "validation": split(1000, 30)})


def datamodule(cls, data_dir: Path, **kw):
    dm = cls(data_dir=str(data_dir), batch_size=2, **kw)
    dm.setup("fit")
    return dm


# --- batching: every token scored exactly once ---------------------------------------------------------


@pytest.mark.parametrize("n_tokens", [2, 33, 64, 65, 100])
def test_eval_windows_score_every_target_once(n_tokens):
    stream = np.arange(n_tokens) % 251
    windows = EvalWindows(stream, seq_len=32)
    inputs, targets = map(torch.stack, zip(*[windows[i] for i in range(len(windows))]))
    scored = targets[targets != IGNORE_INDEX]
    assert windows.n_scored == n_tokens - 1 == len(scored)
    assert scored.tolist() == stream[1:].tolist()  # in order, each once
    real = targets != IGNORE_INDEX
    assert inputs[real].tolist() == stream[:-1].tolist()  # input t predicts stream[t + 1]


def test_train_windows_are_shifted_pairs():
    stream = np.arange(100)
    windows = TrainWindows(stream, seq_len=16)
    assert len(windows) == 6
    x, y = windows[5]
    assert x.tolist() == list(range(80, 96)) and y.tolist() == list(range(81, 97))


def test_eval_shard_sampler_covers_each_window_once_without_padding():
    data = list(range(7))
    shards = [list(EvalShardSampler(data, 3, r)) for r in range(3)]
    assert sorted(sum(shards, [])) == data and [len(s) for s in shards] == [3, 2, 2]


def test_split_bounds_match_the_standard_enwik8_split():
    assert split_bounds(100_000_000) == {"train": (0, 90_000_000), "val": (90_000_000, 95_000_000),
                                         "test": (95_000_000, 100_000_000)}
    assert split_bounds(1000) == {"train": (0, 900), "val": (900, 950), "test": (950, 1000)}


# --- byte corpora ------------------------------------------------------------------------------------------


def test_enwik8_zip_is_extracted_split_and_scored(tmp_path):
    payload = enwik8_payload()
    write_byte_zip(tmp_path, "enwik8", payload)
    dm = datamodule(Enwik8DataModule, tmp_path, seq_len=64, verify_size=False)
    assert (tmp_path / "enwik8" / "enwik8").read_bytes() == payload
    raw = np.frombuffer(payload, dtype=np.uint8)
    assert [len(dm.streams[s]) for s in ("train", "val", "test")] == [18_000, 1_000, 1_000]
    assert np.array_equal(dm.streams["test"], raw[19_000:])
    assert dm.scored_tokens("test") == 999
    with pytest.raises(ValueError, match="100000000.*verify_size"):
        datamodule(Enwik8DataModule, tmp_path, seq_len=64)
    newline_free = datamodule(Enwik8DataModule, tmp_path, seq_len=64, verify_size=False, drop_newlines=True)
    assert np.array_equal(newline_free.streams["test"], raw[19_000:][raw[19_000:] != 10])


def test_text8_maps_27_symbols_and_rejects_other_bytes(tmp_path):
    write_byte_zip(tmp_path, "text8", text8_payload())
    dm = datamodule(Text8DataModule, tmp_path, seq_len=64, vocab_size=27, verify_size=False)
    train = np.asarray(dm.streams["train"])
    assert train.max() <= 26 and set(np.unique(train)) <= set(range(27)) and 0 in train  # space = 0
    bad = tmp_path / "mixed.txt"
    bad.write_bytes(b"Hello World\n" * 100)
    with pytest.raises(ValueError, match="task=enwik8"):
        datamodule(Text8DataModule, tmp_path, seq_len=8, vocab_size=27, path=str(bad))


def test_byte_download_failure_is_fast_and_says_where_to_place_the_zip(tmp_path, monkeypatch):
    def unreachable(*args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(text_data.urllib.request, "urlopen", unreachable)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    dm = Enwik8DataModule(data_dir=str(tmp_path), seq_len=64)
    with pytest.raises(FileNotFoundError, match=r"mattmahoney.net/dc/enwik8.zip.*enwik8/enwik8.zip.*task.data.path") as err:
        dm.prepare_data()
    assert "URLError" in str(err.value)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="offline"):
        Text8DataModule(data_dir=str(tmp_path), seq_len=64).prepare_data()
    with pytest.raises(FileNotFoundError, match="task.data.path"):
        Enwik8DataModule(data_dir=str(tmp_path), path=str(tmp_path / "nope.txt")).prepare_data()


def test_hf_download_failure_is_fast_and_names_the_folder(tmp_path, monkeypatch):
    import datasets

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(text_data, "hub_reachable", lambda timeout=3.0: False)
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=r"unreachable.*save_to_disk.*wikitext103/hf"):
        WikiText103DataModule(data_dir=str(tmp_path), vocab_size=100).prepare_data()
    assert time.perf_counter() - start < 5

    def refuse(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'google/wiki40b' on the Hub")

    monkeypatch.setattr(text_data, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", refuse)
    with pytest.raises(FileNotFoundError, match=r"ConnectionError.*wiki40b/hf"):
        Wiki40bDataModule(data_dir=str(tmp_path), vocab_size=100).prepare_data()
    with pytest.raises(FileNotFoundError, match=r"c4/hf"):
        C4MLMDataModule(data_dir=str(tmp_path), vocab_size=100).prepare_data()


# --- Hugging Face corpora ----------------------------------------------------------------------------------


def test_wikitext_vocab_from_train_eos_per_line_unk_for_unseen(tmp_path):
    write_wikitext_fixture(tmp_path)
    dm = datamodule(WikiText103DataModule, tmp_path, seq_len=32, vocab_size=200)
    vocab = dm.vocabulary()
    assert vocab[0] == "<eos>" and "<unk>" in vocab and "zyzzyva" not in vocab
    import datasets

    test_lines = datasets.load_from_disk(str(tmp_path / "wikitext103" / "hf"))["test"]["text"]
    expected = [w for line in test_lines for w in (*line.split(), "<eos>")]
    decoded = [vocab[i] for i in dm.streams["test"]]
    assert decoded == [w if w in vocab else "<unk>" for w in expected]
    assert decoded[:5] == ["=", "Title", "=", "<eos>", "<eos>"]  # the blank line is a lone <eos>
    with pytest.raises(ValueError, match="task.vocab_size="):
        (tmp_path / "small").mkdir()
        write_wikitext_fixture(tmp_path / "small")
        WikiText103DataModule(data_dir=str(tmp_path / "small"), vocab_size=10).prepare_data()


def test_wiki40b_markers_and_sentencepiece_trained_on_the_fixture(tmp_path):
    marked = "\n_START_ARTICLE_\nTitle\n_START_SECTION_\nSection\n_START_PARAGRAPH_\nOne._NEWLINE_Two."
    assert wiki40b_to_text(marked) == "Title\nSection\nOne.\nTwo."
    write_wiki40b_fixture(tmp_path)
    dm = datamodule(Wiki40bDataModule, tmp_path, seq_len=32, vocab_size=120)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "wiki40b" / "spm120.model"))
    assert 20 < sp.get_piece_size() <= 120
    test = np.asarray(dm.streams["test"])
    assert (test == EOS_ID).sum() == 4  # one </s> per article
    first = test[: int(np.argmax(test == EOS_ID))].tolist()
    assert sp.decode(first) == wiki40b_to_text(wiki40b_article("Article 200", 200))
    assert list((tmp_path / "wiki40b" / "spm120").glob("*.npy"))  # cached token streams


def test_bert_masking_rates_and_specials():
    rng = np.random.default_rng(0)
    tokens = rng.integers(FIRST_NORMAL_ID, 1000, 200_000)
    tokens[::10] = PAD_ID
    inputs, targets = bert_mask(tokens, rng, vocab_size=1000)
    chosen = targets != IGNORE_INDEX
    assert not chosen[::10].any()  # specials are never chosen
    assert chosen.mean() / 0.9 == pytest.approx(0.15, abs=0.005)
    assert np.array_equal(targets[chosen], tokens[chosen])
    masked, kept = inputs[chosen] == MASK_ID, inputs[chosen] == tokens[chosen]
    assert masked.mean() == pytest.approx(0.8, abs=0.01)
    assert kept.mean() == pytest.approx(0.1 + 0.1 / 995, abs=0.01)  # kept, or drawn equal by chance
    assert (inputs[chosen & (inputs != MASK_ID)] >= FIRST_NORMAL_ID).all()
    assert np.array_equal(inputs[~chosen], tokens[~chosen])


def test_pack_segments_two_per_example_nothing_dropped():
    docs = [[10] * 3, [11] * 4, [12] * 20, [13] * 2]
    examples = list(pack_segments(docs, seq_len=12))
    S, E, P = BOS_ID, EOS_ID, PAD_ID
    assert [e.tolist() for e in examples] == [
        [S, *[10] * 3, E, *[11] * 4, E, P, P],
        [S, *[12] * 10, E],
        [S, *[12] * 10, E],
        [S, *[13] * 2, E] + [P] * 8,
    ]


def test_c4_streams_trains_sentencepiece_and_caches_fixed_eval_masks(tmp_path):
    write_c4_fixture(tmp_path)
    dm = datamodule(C4MLMDataModule, tmp_path, seq_len=32, vocab_size=120, val_docs=10, test_docs=20,
                    shuffle_buffer=1)
    assert dm.pieces <= 120 and (tmp_path / "c4" / "spm120.model").is_file()
    val = dm.val_dataloader().dataset
    assert val.examples.shape[1] == 32 and (np.asarray(val.examples)[:, 0] == BOS_ID).all()
    a, b = val[3], val[3]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # the same mask every evaluation
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (2, 32)
    assert ((y != IGNORE_INDEX).sum() > 0) and (x == MASK_ID).any()


# --- tasks end to end ----------------------------------------------------------------------------------------

TASK_FIXTURES = {
    "enwik8": (lambda d: write_byte_zip(d, "enwik8", enwik8_payload()), ["task.data.verify_size=false"]),
    "text8": (lambda d: write_byte_zip(d, "text8", text8_payload()), ["task.data.verify_size=false"]),
    "wikitext103": (write_wikitext_fixture, ["task.vocab_size=200"]),
    "wiki40b": (write_wiki40b_fixture, ["task.vocab_size=120"]),
    "c4_mlm": (write_c4_fixture, ["task.vocab_size=120", "task.data.val_docs=10", "task.data.test_docs=10",
                                  "attention=combiner_fixed"]),
}


@pytest.mark.parametrize("task", sorted(TASK_FIXTURES))
def test_fast_dev_run_on_fixture(task, make_cfg, tmp_path):
    write, extra = TASK_FIXTURES[task]
    data_dir = tmp_path / "data"
    write(data_dir)
    cfg = make_cfg([f"task={task}", f"paths.data_dir={data_dir}", "task.seq_len=32", "task.batch_size=2",
                    "trainer.fast_dev_run=true", *extra])
    metrics = train(cfg)
    metric = cfg.task.monitor.split("/")[1]
    assert np.isfinite(metrics[f"test/{metric}"]) and metrics["test/tokens"] > 0
    if metric == "bpc":
        assert 0 < metrics["test/bpc"] < 10
    else:
        assert 1 < metrics["test/ppl"] < 10 * cfg.task.vocab_size


def test_eval_reports_metric_and_every_test_token(tmp_path):
    data_dir = tmp_path / "data"
    write_byte_zip(data_dir, "enwik8", enwik8_payload())
    run = compose_config(["task=enwik8", f"paths.data_dir={data_dir}", "task.data.verify_size=false",
                          "task.seq_len=64", "task.batch_size=4", "trainer.max_steps=3", "trainer.limit_test_batches=null"],
                         tmp_path / "run")
    metrics = train(run)
    ecfg = compose_config([f"ckpt_path={metrics['ckpt_path']}"], tmp_path / "eval", config_name="eval")
    evaluated = evaluate(ecfg)
    assert evaluated["test/tokens"] == 1_000 - 1  # the 5 % test split minus its first (context-free) byte
    assert evaluated["test/bpc"] == pytest.approx(metrics["test/bpc"], rel=1e-5)
    assert evaluated["test/bpc"] == pytest.approx(evaluated["test/nll"] / np.log(2), rel=1e-6)


def test_acceptance_style_local_file_run_uses_the_90_5_5_split(make_cfg, tmp_path):
    local = tmp_path / "corpus.txt"
    local.write_bytes(enwik8_payload(10_000))
    cfg = make_cfg(["task=enwik8", f"task.data.path={local}", "attention=combiner_fixed", "task.seq_len=64",
                    "trainer.fast_dev_run=true", "task.batch_size=2"])
    dm = build_datamodule(cfg)
    dm.setup("fit")
    assert [len(dm.streams[s]) for s in ("train", "val", "test")] == [9_000, 500, 500]
    module = build_module(cfg)
    assert module.net.pos_emb == "learned"  # text tasks set no task.pos_emb: the model default
    assert module.net.blocks[0].attn.attention.name == "combiner_fixed"


@pytest.mark.parametrize("task,attention,needs", [("enwik8", "full", "causal"), ("wiki40b", "bigbird", "causal"),
                                                  ("c4_mlm", "combiner_axial", "bidirectional")])
def test_wrong_direction_attention_is_rejected_naming_it(task, attention, needs, tmp_path):
    flip = "false" if needs == "causal" else "true"
    cfg = compose_config([f"task={task}", f"attention={attention}", f"attention.causal={flip}", "task.vocab_size=64"],
                         tmp_path)
    with pytest.raises(ValueError, match=rf"needs {needs} attention but attention '{attention}'"):
        build_module(cfg)


def paper_experiments() -> list[str]:
    from conftest import CONF

    # The paper rows: paper.yaml and the files built on it (other experiments may share these folders).
    return sorted(str(p.relative_to(CONF / "experiment").with_suffix("")) for task in ("enwik8", "wiki40b", "c4_mlm")
                  for p in (CONF / "experiment" / task).glob("*.yaml")
                  if p.stem == "paper" or f"/experiment/{task}/paper" in p.read_text())


def test_paper_backbone_and_optimization_settings(tmp_path):
    cfg = compose_config(["experiment=wiki40b/paper"], tmp_path, fast=False)
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads, cfg.model.mlp_ratio) == (12, 768, 12, 4)
    assert (cfg.task.batch_size, cfg.trainer.max_steps, cfg.scheduler.warmup_steps) == (128, 125_000, 10_000)
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer._target_ == "torch.optim.AdamW"


@pytest.mark.parametrize("experiment", paper_experiments())
def test_paper_experiment_rows_build_their_attention(experiment, tmp_path):
    # Tiny widths keep the build fast; the geometry (seq_len, block_size) and the settings are the paper's.
    cfg = compose_config([f"experiment={experiment}", "model.n_layers=1", "model.d_model=48", "task.vocab_size=64"],
                         tmp_path, fast=False)
    assert (cfg.task.batch_size, cfg.trainer.max_steps, cfg.model.n_heads) == (128, 125_000, 12)
    assert cfg.task.seq_len == (8192 if experiment.endswith("_8k") else 2048) and cfg.task.block_size == 128
    row = experiment.split("/")[1]
    attn = build_module(cfg).net.blocks[0].attn.attention
    assert attn.name == (row.removesuffix("_8k") if row != "paper" else "full")
    assert attn.causal is (not experiment.startswith("c4_mlm"))
