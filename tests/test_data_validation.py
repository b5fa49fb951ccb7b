"""Bad input fails early with a message naming the file (and line) or the config key.

Each test injects one fault into a tiny fixture written in the dataset's real on-disk format (the writers
of test_text_tasks / test_lra / test_image_data) or into the composed config, and asserts the error type,
the message, and for the CLI tests the exit code and that no checkpoint was written.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import urllib.error
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from dataset_files import (
    enwik8_payload,
    write_aan_fixture,
    write_byte_zip,
    write_cifar10_fixture,
    write_imagenet64_fixture,
    write_listops_fixture,
    write_pathfinder_fixture,
)

from longseq.data import text as text_data
from longseq.data.cifar10 import Cifar10DataModule
from longseq.data.imagenet64 import ImageNet64DataModule
from longseq.data.lra import LraListOpsDataModule, LraPathfinderDataModule, LraRetrievalDataModule
from longseq.data.text import Enwik8DataModule, load_hf_split
from longseq.data.validation import MIN_EVAL_TOKENS
from longseq.data.wikitext import WikiText103DataModule
from longseq.runner import build_module
from longseq.utils.errors import ConfigError, DataError

SMALL_SPLIT = "longseq.data.validation"


def loaders(dm) -> None:
    """What ``trainer.fit`` + ``trainer.test`` do to a datamodule: set up, then build every loader."""
    dm.setup("fit")
    dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader()


def local_corpus(tmp_path: Path, payload: bytes, **kw) -> Enwik8DataModule:
    path = tmp_path / "corpus.txt"
    path.write_bytes(payload)
    return Enwik8DataModule(data_dir=str(tmp_path), path=str(path), **{"seq_len": 8, "batch_size": 2, **kw})


# ---------------------------------------------------------------------------------------------------------
# Byte corpora (enwik8 / text8 / task.data.path)


def test_empty_local_corpus_is_rejected_at_construction_naming_the_file(tmp_path):
    with pytest.raises(DataError, match=r"corpus.txt: the corpus file \(task.data.path\) is empty") as err:
        local_corpus(tmp_path, b"")
    assert err.value.path == tmp_path / "corpus.txt"


def test_empty_release_file_names_the_file_not_mmap(tmp_path):
    (tmp_path / "enwik8").mkdir()
    (tmp_path / "enwik8" / "enwik8").write_bytes(b"")  # an interrupted extraction
    dm = Enwik8DataModule(data_dir=str(tmp_path), seq_len=8, batch_size=2, verify_size=False)
    with pytest.raises(DataError, match=r"enwik8/enwik8: the corpus file is empty") as err:
        dm.setup("fit")
    assert "mmap" not in str(err.value)


@pytest.mark.parametrize("archive", [b"", b"PK\x03\x04 truncated download"])
def test_empty_or_broken_zip_names_the_archive(tmp_path, archive):
    write_byte_zip(tmp_path, "enwik8", b"x").write_bytes(archive)
    dm = Enwik8DataModule(data_dir=str(tmp_path), seq_len=8, verify_size=False)
    with pytest.raises(DataError, match=r"enwik8/enwik8.zip: .*(empty|not a readable zip)"):
        dm.prepare_data()


def test_corpus_too_short_for_a_split_names_the_file(tmp_path):
    dm = local_corpus(tmp_path, b"abcdefghij")
    with pytest.raises(DataError, match=r"corpus.txt: 10 tokens are too few for a 90%/5%/5%"):
        dm.setup("fit")


def test_train_split_shorter_than_one_batch_names_split_count_and_seq_len(tmp_path):
    dm = local_corpus(tmp_path, enwik8_payload(400), seq_len=256)  # train = 360 tokens < 2 x 256 + 1
    dm.setup("fit")
    with pytest.raises(DataError, match=r"corpus.txt: the train split has 360 tokens, fewer than one training batch: "
                                        r"2 window\(s\) of task.seq_len=256 \+ 1 = 513 tokens \(task.batch_size"):
        dm.train_dataloader()


def test_tiny_eval_splits_warn_with_their_token_count(tmp_path, caplog):
    # The case: a corpus whose val / test hold 4 tokens trained and reported a metric silently.
    dm = local_corpus(tmp_path, enwik8_payload(80))
    with caplog.at_level(logging.WARNING, logger=SMALL_SPLIT):
        loaders(dm)
    warnings = [r.getMessage() for r in caplog.records if r.name == SMALL_SPLIT]
    assert len(warnings) == 2, warnings
    for split, message in zip(("val", "test"), warnings):
        assert f"corpus.txt: the {split} split holds only 4 tokens (fewer than {MIN_EVAL_TOKENS:,} tokens)" in message


def test_normal_eval_splits_do_not_warn(tmp_path, caplog):
    dm = local_corpus(tmp_path, enwik8_payload(30_000))  # val / test: 1,500 tokens each
    with caplog.at_level(logging.WARNING, logger=SMALL_SPLIT):
        loaders(dm)
    assert not [r for r in caplog.records if r.name == SMALL_SPLIT]


def write_wikitext_cache(data_dir: Path, splits: dict[str, list[int]]) -> Path:
    """The tokenized cache ``wikitext103/<config>/{train,val,test}.npy`` + ``vocab.txt`` the loader memory-maps."""
    cache = data_dir / "wikitext103" / "wikitext-103-v1"
    cache.mkdir(parents=True)
    for split, ids in splits.items():
        np.save(cache / f"{split}.npy", np.asarray(ids, dtype=np.uint8))
    (cache / "vocab.txt").write_text("<eos>\nthe\nof\n<unk>\n")
    return cache


def test_eval_split_without_a_scored_token_is_an_error_naming_its_cache_file(tmp_path):
    cache = write_wikitext_cache(tmp_path, {"train": [1, 2, 0] * 30, "val": [1, 2, 0] * 5, "test": [0]})
    dm = WikiText103DataModule(data_dir=str(tmp_path), seq_len=8, vocab_size=4, batch_size=2)
    dm.setup("fit")
    dm.val_dataloader()
    with pytest.raises(DataError, match=r"test.npy: the test split has 1 tokens, fewer than 2 tokens") as err:
        dm.test_dataloader()
    assert err.value.path == cache / "test.npy"


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_damaged_token_cache_names_the_file_and_how_to_rebuild(tmp_path, damage):
    cache = write_wikitext_cache(tmp_path, {"train": [1, 2, 0] * 30, "val": [1, 2, 0] * 5, "test": [1, 2, 0] * 5})
    val = cache / "val.npy"
    val.write_bytes(b"" if damage == "empty" else val.read_bytes()[:40])
    dm = WikiText103DataModule(data_dir=str(tmp_path), seq_len=8, vocab_size=4, batch_size=2)
    expected = r"val.npy: the token cache is empty" if damage == "empty" else r"val.npy: is not a readable .npy token cache"
    with pytest.raises(DataError, match=expected):
        dm.setup("fit")


def test_token_id_beyond_the_vocabulary_names_the_cache_file(tmp_path):
    write_wikitext_cache(tmp_path, {"train": [1, 2, 0] * 30, "val": [1, 2, 9], "test": [1, 2, 0]})
    dm = WikiText103DataModule(data_dir=str(tmp_path), seq_len=8, vocab_size=4, batch_size=2)
    with pytest.raises(DataError, match=r"val.npy: the val split has token id 9 >= task.vocab_size=4"):
        dm.setup("fit")


# ---------------------------------------------------------------------------------------------------------
# LRA: TSV rows and Pathfinder metadata with their line numbers


def listops_fault(path: Path, fault: str) -> None:
    lines = path.read_text().splitlines()
    if fault == "empty":
        path.write_bytes(b"")
        return
    if fault == "header":
        lines[0] = "Expression\tValue"
    elif fault == "one column":
        lines[3] = lines[3].split("\t")[0]  # the Target lost
    elif fault == "three columns":
        lines[3] += "\textra"
    elif fault == "target not a number":
        lines[3] = lines[3].split("\t")[0] + "\tseven"
    elif fault == "target out of range":
        lines[3] = lines[3].split("\t")[0] + "\t12"
    elif fault == "no expression":
        lines[3] = "( )\t3"
    path.write_text("\n".join(lines) + "\n")


LISTOPS_FAULTS = {
    "empty": r"basic_val.tsv: the ListOps TSV is empty \(0 bytes\)",
    "header": r"basic_val.tsv:1: expected the header 'Source<TAB>Target'",
    "one column": r"basic_val.tsv:4: expected 2 tab-separated columns \(Source, Target\), got 1",
    "three columns": r"basic_val.tsv:4: expected 2 tab-separated columns \(Source, Target\), got 3",
    "target not a number": r"basic_val.tsv:4: the Target column must be a value 0..9, got 'seven'",
    "target out of range": r"basic_val.tsv:4: the Target column must be a value 0..9, got '12'",
    "no expression": r"basic_val.tsv:4: the Source column holds no expression",
}


@pytest.mark.parametrize("fault", sorted(LISTOPS_FAULTS))
def test_malformed_listops_tsv_names_file_and_line(tmp_path, fault):
    write_listops_fixture(tmp_path)
    listops_fault(tmp_path / "listops-1000" / "basic_val.tsv", fault)
    dm = LraListOpsDataModule(root=str(tmp_path), max_length=16, batch_size=2)
    with pytest.raises(DataError, match=LISTOPS_FAULTS[fault]):
        dm.setup("fit")


@pytest.mark.parametrize("row,expected", [
    ("1\tid/x\tid/y\tonly one text", r"new_aan_pairs.test.tsv:3: expected 5 tab-separated columns .* got 4"),
    ("yes\tid/x\tid/y\ta\tb", r"new_aan_pairs.test.tsv:3: the label column must be 0 or 1, got 'yes'"),
    ("2\tid/x\tid/y\ta\tb", r"new_aan_pairs.test.tsv:3: the label column must be 0 or 1, got '2'"),
])
def test_malformed_retrieval_tsv_names_file_and_line(tmp_path, row, expected):
    write_aan_fixture(tmp_path)
    path = tmp_path / "tsv_data" / "new_aan_pairs.test.tsv"
    lines = path.read_text().splitlines()
    lines[2] = row
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=expected):
        LraRetrievalDataModule(root=str(tmp_path), max_length=16, batch_size=2).setup("fit")


def test_split_without_examples_names_the_file(tmp_path):
    write_aan_fixture(tmp_path)
    (tmp_path / "tsv_data" / "new_aan_pairs.eval.tsv").write_text("\n\n")  # blank lines only
    dm = LraRetrievalDataModule(root=str(tmp_path), max_length=16, batch_size=2)
    dm.setup("fit")
    with pytest.raises(DataError, match=r"new_aan_pairs.eval.tsv: the val split has 0 examples, fewer than one example"):
        dm.val_dataloader()


def test_empty_retrieval_tsv_names_the_file(tmp_path):
    write_aan_fixture(tmp_path)
    (tmp_path / "tsv_data" / "new_aan_pairs.train.tsv").write_bytes(b"")
    with pytest.raises(DataError, match=r"new_aan_pairs.train.tsv: the AAN retrieval TSV is empty"):
        LraRetrievalDataModule(root=str(tmp_path), max_length=16, batch_size=2).setup("fit")


def pathfinder_dm(root: Path) -> LraPathfinderDataModule:
    return LraPathfinderDataModule(root=str(root), resolution=32, difficulty="baseline", max_length=1024, batch_size=2)


@pytest.mark.parametrize("fault,expected", [
    ("short line", r"metadata/1.npy:2: a metadata line needs at least 4 fields .* got 3"),
    ("bad label", r"metadata/1.npy:2: the label \(4th field\) must be 0 or 1, got 'x'"),
    ("missing image", r"metadata/1.npy:2: names the image .*imgs/1/sample_1.png, which does not exist"),
    ("corrupt image", r"imgs/1/sample_1.png: is not a readable image .*listed at .*metadata/1.npy:2"),
    ("no metadata", r"curv_baseline/metadata: holds no metadata lines"),
])
def test_malformed_pathfinder_metadata_names_file_and_line(tmp_path, fault, expected):
    write_pathfinder_fixture(tmp_path, 32, "curv_baseline")
    folder = tmp_path / "pathfinder32" / "curv_baseline"
    meta = folder / "metadata" / "1.npy"
    lines = meta.read_text().splitlines()
    fields = lines[1].split()
    if fault == "short line":
        lines[1] = " ".join(fields[:3])
    elif fault == "bad label":
        lines[1] = " ".join([*fields[:3], "x", *fields[4:]])
    elif fault == "missing image":
        (folder / "imgs" / "1" / "sample_1.png").unlink()
    elif fault == "corrupt image":
        (folder / "imgs" / "1" / "sample_1.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    elif fault == "no metadata":
        for path in (folder / "metadata").iterdir():
            path.unlink()
    if meta.exists():
        meta.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=expected):
        pathfinder_dm(tmp_path).setup("fit")


def test_train_split_smaller_than_one_batch_names_split_and_batch(tmp_path, caplog):
    write_listops_fixture(tmp_path)  # 8 examples per split
    dm = LraListOpsDataModule(root=str(tmp_path), max_length=16, batch_size=16)
    dm.setup("fit")
    with pytest.raises(DataError, match=r"basic_train.tsv: the train split has 8 examples, fewer than one training "
                                        r"batch of 16 examples \(task.batch_size over 1 device"):
        dm.train_dataloader()
    with caplog.at_level(logging.WARNING, logger=SMALL_SPLIT):
        dm.val_dataloader()
    assert any("basic_val.tsv: the val split holds only 8 examples" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------------------
# Image releases


def test_empty_cifar10_batch_names_the_file(tmp_path):
    write_cifar10_fixture(tmp_path)
    (tmp_path / "cifar10" / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"")
    dm = Cifar10DataModule(data_dir=str(tmp_path), batch_size=2, val_size=4, verify_checksums=False, download=False)
    with pytest.raises(DataError, match=r"cifar-10-batches-py/data_batch_3: the CIFAR-10 batch is empty"):
        dm.setup("fit")


def test_damaged_cifar10_batch_names_the_folder_and_the_checksum_option(tmp_path):
    write_cifar10_fixture(tmp_path)
    batch = tmp_path / "cifar10" / "cifar-10-batches-py" / "test_batch"
    batch.write_bytes(batch.read_bytes()[:100])
    dm = Cifar10DataModule(data_dir=str(tmp_path), batch_size=2, val_size=4, verify_checksums=False, download=False)
    with pytest.raises(DataError, match=r"cifar-10-batches-py: the CIFAR-10 batches cannot be read .*verify_checksums"):
        dm.setup("fit")


@pytest.mark.parametrize("name,content,expected", [
    ("val_data.npz", b"", r"val_data.npz: the ImageNet 64x64 release file is empty"),
    ("val_data.npz", b"PK\x03\x04 cut", r"val_data.npz: cannot be read as an ImageNet 64x64 batch"),
    ("train_data_batch_2", b"\x80\x04 not a pickle", r"train_data_batch_2: cannot be read as an ImageNet 64x64 batch"),
])
def test_broken_imagenet64_release_file_is_named(tmp_path, name, content, expected):
    write_imagenet64_fixture(tmp_path)
    (tmp_path / "imagenet64" / name).write_bytes(content)
    dm = ImageNet64DataModule(data_dir=str(tmp_path), batch_size=2, train_batches=2, val_size=2)
    with pytest.raises(DataError, match=expected):
        dm.setup("fit")


# ---------------------------------------------------------------------------------------------------------
# Model and optimizer values, through the composed config


@pytest.mark.parametrize("override,key,expected", [
    ("model.n_layers=0", "model.n_layers", "must be an integer >= 1, got 0"),
    ("model.d_model=-8", "model.d_model", "must be an integer >= 1, got -8"),
    ("model.n_heads=0", "model.n_heads", "must be an integer >= 1, got 0"),
    ("model.n_heads=3", "model.n_heads", "model.d_model=32 must be divisible by model.n_heads=3"),
    ("model.mlp_ratio=0", "model.mlp_ratio", "must be a number > 0"),
    ("model.dropout=1.5", "model.dropout", r"must be a number in \[0, 1\), got 1.5"),
    ("model.attn_dropout=-0.1", "model.attn_dropout", r"must be a number in \[0, 1\), got -0.1"),
    ("optimizer.lr=-1", "optimizer.lr", r"must be a finite number in \(0, inf\), got -1"),
    ("optimizer.lr=0", "optimizer.lr", r"must be a finite number in \(0, inf\), got 0"),
    ("optimizer.lr=nan", "optimizer.lr", "got nan"),
    ("optimizer.lr=inf", "optimizer.lr", "got inf"),
    ("optimizer.lr=abc", "optimizer.lr", "got 'abc'"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay", r"must be a finite number in \[0, inf\), got -0.1"),
    ("optimizer.betas=[0.9,1.5]", "optimizer.betas[1]", r"in \[0, 1\), got 1.5"),
    ("optimizer.betas=[0.9]", "optimizer.betas", "must be two numbers"),
    ("+optimizer.lrr=0.1", "optimizer.lrr", r"is not an argument of torch.optim.AdamW; valid: \['lr', 'betas'"),
    ("optimizer._target_=torch.optim.Nope", "optimizer._target_", "cannot import 'torch.optim.Nope'"),
    ("scheduler.warmup_steps=-5", "scheduler.warmup_steps", "must be an integer >= 0, got -5"),
    ("scheduler.min_lr_ratio=2", "scheduler.min_lr_ratio", r"in \[0, 1\], got 2"),
    ("+scheduler.warmup=5", "scheduler.warmup", r"is not an argument of .*warmup_cosine; valid: \['warmup_steps'"),
])
def test_bad_model_and_optimizer_values_are_rejected_naming_the_key(make_cfg, override, key, expected):
    cfg = make_cfg(["optimizer=adamw", "scheduler=cosine", override])
    with pytest.raises(ConfigError, match=expected) as err:
        build_module(cfg)
    assert err.value.key == key and str(err.value).startswith(f"{key}: ")


def test_bad_data_options_are_rejected_naming_the_key(tmp_path):
    from longseq.data.c4 import pack_segments

    with pytest.raises(ConfigError, match=r"task.difficulty: 'medium' is not valid; choose one of \['baseline', 'hard'"):
        LraPathfinderDataModule(root=str(tmp_path), difficulty="medium")
    with pytest.raises(ConfigError, match=r"task.seq_len: 2 is too short"):
        list(pack_segments([[7, 8]], seq_len=2))
    write_imagenet64_fixture(tmp_path)
    with pytest.raises(ConfigError, match=r"task.data.val_size: 9 must be in \[1, 5\]"):
        ImageNet64DataModule(data_dir=str(tmp_path), batch_size=2, train_batches=2, val_size=9).setup("fit")


def test_default_model_and_optimizer_values_pass(make_cfg):
    for overrides in (["optimizer=adamw", "scheduler=cosine"], ["optimizer=adam", "scheduler=none"],
                      ["optimizer=adam", "scheduler=constant"]):
        assert build_module(make_cfg(overrides)).net.blocks


# ---------------------------------------------------------------------------------------------------------
# Offline download errors: one message saying what to place where, no chained traceback


def assert_single_message(err: BaseException) -> None:
    assert err.__cause__ is None and err.__suppress_context__, "the cause is in the message; no chained traceback"


def test_failed_byte_download_is_one_message(tmp_path, monkeypatch):
    def unreachable(*args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(text_data.urllib.request, "urlopen", unreachable)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(FileNotFoundError, match=r"URLError.*place it at .*enwik8/enwik8.zip") as err:
        Enwik8DataModule(data_dir=str(tmp_path)).prepare_data()
    assert_single_message(err.value)


def test_failed_hub_download_is_one_message(tmp_path, monkeypatch):
    import datasets

    def refuse(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub")

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(text_data, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", refuse)
    with pytest.raises(FileNotFoundError, match=r"ConnectionError.*save_to_disk.*wikitext103/hf") as err:
        load_hf_split(tmp_path / "wikitext103" / "hf", "Salesforce/wikitext", "wikitext-103-v1", "train", tmp_path)
    assert_single_message(err.value)


def test_failed_cifar10_download_is_one_message(tmp_path, monkeypatch):
    from longseq.data import cifar10

    def unreachable(self, *args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(cifar10.CIFAR10, "download", unreachable)
    with pytest.raises(FileNotFoundError, match=r"could not be downloaded \(URLError.*cifar-10-python.tar.gz") as err:
        Cifar10DataModule(data_dir=str(tmp_path), batch_size=2).prepare_data()
    assert_single_message(err.value)


# ---------------------------------------------------------------------------------------------------------
# Through the real train.py: the run fails, says why, and leaves no checkpoint (nor run directory) behind

CLI = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "trainer.max_steps=2", "extras.print_config=false",
       "trainer.enable_progress_bar=false"]


def run_train(args: list[str], run_dir: Path) -> tuple[int, str]:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}", *CLI], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=300)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.slow  # CLI runs; the fast set refuses each malformed file in-process
@pytest.mark.parametrize("fault", ["empty corpus", "malformed listops row"])
def test_train_cli_fails_before_writing_a_checkpoint(tmp_path, fault):
    run_dir = tmp_path / "run"
    if fault == "empty corpus":
        corpus = tmp_path / "corpus.txt"
        corpus.write_bytes(b"")
        args, expected = ["task=enwik8", f"task.data.path={corpus}", "task.seq_len=16"], [str(corpus), "is empty"]
    else:  # found in the datamodule's setup, inside trainer.fit
        write_listops_fixture(tmp_path / "lra")
        listops_fault(tmp_path / "lra" / "listops-1000" / "basic_val.tsv", "one column")
        args = ["task=lra_listops", f"paths.data_dir={tmp_path}", "task.seq_len=32", "task.batch_size=2"]
        expected = [f"{tmp_path / 'lra' / 'listops-1000' / 'basic_val.tsv'}:4",
                    "expected 2 tab-separated columns (Source, Target), got 1"]
    code, output = run_train(args, run_dir)
    assert code != 0, output[-3000:]
    for text in expected:
        assert text in output, output[-3000:]
    assert "cannot mmap" not in output
    assert not list(run_dir.rglob("*.ckpt")), "a failed set-up must not leave an (untrained) checkpoint"
    assert not run_dir.exists()  # refused before training: the run directory it had made is gone again (#45)
