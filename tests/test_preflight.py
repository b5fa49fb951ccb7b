"""Every refusal before the run directory exists (issue 45): the inputs that used to leave a run directory behind,
or to fail with an exception's name instead of the key, as a new user types them.

Each goes through the pre-flight ``train.py`` / ``eval.py`` run before Hydra makes a run directory
(``preflight.command``), in-process: exit 1, one ``error: <key or file>: <message>`` line, no traceback, nothing
under ``paths.log_dir``. Two go through the CLI end to end, one of them a refusal only the run itself can find
(a training split too small for one batch), after which the run directory it made is gone again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONF, ROOT
from devices import without_gpu
from omegaconf import OmegaConf
from test_messages import refusal

from longseq.preflight.command import check_composition, preflight_train
from longseq.preflight.evaluate import check_eval_config
from longseq.utils.checkpoint import save_atomically

TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "extras.print_config=false",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """An empty data folder and the local corpus files of the ``task.data.path`` inputs."""
    (tmp_path / "data").mkdir()
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "small.txt").write_bytes(b"abc")
    (tmp_path / "random.ckpt").write_bytes(os.urandom(4096))
    return tmp_path


@pytest.fixture(autouse=True)
def user_environment(monkeypatch, tmp_path):
    """A machine without network (enwik8's download and the Hugging Face Hub fail), without W&B credentials, with
    errors printed as one line."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    import urllib.error

    from longseq.data import text

    def unreachable(url, destination, timeout=0):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(text, "download", unreachable)  # enwik8's zip: the download fails as it does offline
    monkeypatch.setattr(text, "hub_reachable", lambda timeout=3.0: False)  # so does the Hugging Face Hub
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no W&B settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))


# (overrides, the start of the error line); {d} is the empty data folder, {f} the folder of the test's files.
TRAIN_INPUTS = [
    # data the task needs and this machine lacks (downloads off: no test downloads a data set)
    (["task=cifar10", "task.data.download=false"], "error: paths.data_dir: CIFAR-10 not found under {d}/cifar10/"),
    (["task=enwik8"], "error: paths.data_dir: enwik8 not found: the download failed (URLError: <urlopen error Name or "
                      "service not known>). Download http://mattmahoney.net/dc/enwik8.zip and place it at "
                      "{d}/enwik8/enwik8.zip"),
    (["task=wikitext103"], "error: paths.data_dir: Salesforce/wikitext (wikitext-103-v1) not found: no saved copy at "
                           "{d}/wikitext103/hf and the Hugging Face Hub (huggingface.co) is unreachable"),
    (["task=imagenet64"], "error: paths.data_dir: ImageNet 64x64 files missing in {d}/imagenet64/: "
                          "train_data_batch_1.npz"),
    (["task=c4_mlm"], "error: paths.data_dir: allenai/c4 (en) not found: no saved copy at {d}/c4/hf and the Hugging "
                      "Face Hub (huggingface.co) is unreachable"),
    (["task=lra_listops"], "error: task.data.root: ListOps train split not found at "
                           "{d}/lra/listops-1000/basic_train.tsv"),
    (["task=enwik8", "paths.data_dir=/nonexistent"],
     "error: paths.data_dir: enwik8 not found: the download failed (URLError: <urlopen error Name or service not "
     "known>). Download http://mattmahoney.net/dc/enwik8.zip and place it at /nonexistent/enwik8/enwik8.zip"),
    (["task=enwik8", "task.data.path={f}/missing.txt"], "error: task.data.path: {f}/missing.txt does not exist"),
    (["task=enwik8", "task.data.path={f}/empty.txt"], "error: {f}/empty.txt: the corpus file (task.data.path) is "
                                                      "empty (0 bytes)"),
    (["task=enwik8", "task.data.path={f}/small.txt"], "error: {f}/small.txt: 3 tokens are too few for a 90%/5%/5% "
                                                      "train/val/test split"),
    # Lightning's own value checks, and the callbacks'
    (["trainer.limit_train_batches=-1"], "error: trainer.limit_train_batches: expected a fraction in [0, 1] (float) "
                                         "or a number of batches >= 0 (int), or null, got -1"),
    (["trainer.limit_val_batches=1.5"], "error: trainer.limit_val_batches: expected a fraction in [0, 1]"),
    (["trainer.val_check_interval=-1"], "error: trainer.val_check_interval: expected a fraction of an epoch in "
                                        "(0, 1] (float) or a number of batches >= 1 (int), or null, got -1"),
    (["callbacks.model_checkpoint.every_n_train_steps=-1"],
     "error: callbacks.model_checkpoint.every_n_train_steps: must be an integer number of steps >= 0 (null or 0: "
     "off), got -1"),
    (["callbacks.model_checkpoint.save_top_k=-2"], "error: callbacks.model_checkpoint.save_top_k: Invalid value for "
                                                   "save_top_k=-2"),
    (["extras.print_config=nope"], "error: extras.print_config: 'nope' is not valid; choose short, full or false"),
    # named by key, not by the exception a library raised
    (["task.data.seed=abc"], "error: task.data.seed: must be an integer >= 0, got 'abc'"),
    (["task.batch_size=abc"], "error: task.batch_size: must be an integer >= 1 (the global batch), got 'abc'"),
    (["+model.bogus=1"], "error: model.bogus: is not an argument of the backbone "
                         "(longseq.models.transformer.Transformer); valid: n_layers, d_model"),
    (["+task.data.bogus=1"], "error: task.data.bogus: is not an argument of longseq.data.images.DigitsDataModule"),
    (["task.data.num_workers=-1"], "error: task.data.num_workers: must be an integer >= 0 (0: load in the main "
                                   "process), got -1"),
    (["logger=wandb"], "error: logger.wandb: W&B has no API key on this machine: run `wandb login` (or set "
                       "WANDB_API_KEY), or log offline with logger.wandb.offline=true"),
    # accepted silently before
    (["trainer.max_steps=0"], "error: trainer.max_steps: 0 trains nothing (the untrained model would be tested as if "
                              "it were a result)"),
    pytest.param(["trainer.precision=16-mixed"], "error: trainer.precision: '16-mixed' is not supported on this "
                                                 "machine's cpu: Lightning would run 'bf16-mixed' instead; valid here: "
                                                 "16-true, bf16-true, bf16-mixed, 32-true, 64-true", marks=without_gpu),
]


@pytest.mark.parametrize("overrides,line", TRAIN_INPUTS)
def test_train_refuses_before_the_run_directory_exists(overrides, line, files, capsys):
    data, logs = files / "data", files / "logs"
    given = [o.format(f=files) for o in overrides]
    argv = ["train.py", f"paths.data_dir={data}", f"paths.log_dir={logs}", *TINY, *given]
    assert refusal(lambda: preflight_train(argv, CONF, "train"), capsys).startswith(line.format(d=data, f=files))
    assert not logs.exists()


def test_online_wandb_with_credentials_and_offline_wandb_pass(files, capsys, monkeypatch):
    """The W&B check refuses only what would fail: offline logging, or a key in the environment, passes."""
    logs = files / "logs"
    for extra in (["logger.wandb.offline=true"], []):
        if not extra:
            monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
        argv, checked = preflight_train(["train.py", f"paths.log_dir={logs}", *TINY, "logger=wandb", *extra], CONF)
        assert checked and not logs.exists()


def test_the_wandb_check_leaves_no_wandb_state_behind(files, capsys, monkeypatch):
    """The check's ``wandb.login`` set W&B up for the whole process with the settings it saw (online, no key): an
    offline run started later in that process (a multirun's next job; the next test on a pytest worker) tried to log
    in and failed. After a refusal, an offline run of Lightning's W&B logger starts."""
    from lightning.pytorch.loggers import WandbLogger

    refusal(lambda: preflight_train(["train.py", f"paths.log_dir={files / 'logs'}", *TINY, "logger=wandb"], CONF,
                                    "train"), capsys)
    monkeypatch.undo()  # the environment as the next job or test has it (WANDB_MODE=offline under pytest)
    logger = WandbLogger(offline=True, save_dir=str(files), project="preflight")
    logger.experiment.finish()
    assert list((files / "wandb").glob("offline-run-*"))


def test_a_key_set_after_an_offline_wandb_run_in_the_same_process_is_seen(files, capsys, monkeypatch):
    """W&B's process-wide setup kept the settings of an earlier offline run (no key), so a key set afterwards (a
    multirun's next job; the next test on a pytest worker) was not seen and an online run was refused."""
    from lightning.pytorch.loggers import WandbLogger

    with monkeypatch.context() as offline:
        offline.setenv("WANDB_MODE", "offline")
        WandbLogger(offline=True, save_dir=str(files), project="preflight").experiment.finish()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    argv, checked = preflight_train(["train.py", f"paths.log_dir={files / 'logs'}", *TINY, "logger=wandb"], CONF)
    assert checked and not (files / "logs").exists()


@pytest.fixture
def checkpoints(tmp_path: Path) -> dict[str, Path]:
    """Checkpoints as eval.py finds them: of an image run and of an LM run (``<run>/checkpoints/last.ckpt`` beside
    ``<run>/config_resolved.yaml``), one outside any run directory, and random bytes."""
    found = {}
    enwik8 = {"_target_": "longseq.data.text.Enwik8DataModule", "data_dir": str(tmp_path / "data"), "seq_len": 64}
    for name, task in (("image", {"name": "digits"}), ("lm", {"name": "enwik8", "data": enwik8})):
        run = tmp_path / name
        save_atomically({"global_step": 1, "state_dict": {}}, run / "checkpoints" / "last.ckpt")
        (run / "config_resolved.yaml").write_text(OmegaConf.to_yaml({"task": task}))
        found[name] = run / "checkpoints" / "last.ckpt"
    found["outside"] = tmp_path / "elsewhere" / "model.ckpt"
    save_atomically({"global_step": 1, "state_dict": {}}, found["outside"])
    found["random"] = tmp_path / "random.ckpt"
    found["random"].write_bytes(os.urandom(4096))
    return found


EVAL_INPUTS = [
    ("image", ["mode=sample", "sample.temperature=-1"], "error: sample.temperature: must be a finite number >= 0 "
                                                        "(0 = greedy), got -1"),
    ("image", ["mode=sample", "sample.temperature=abc"], "error: sample.temperature: must be a finite number >= 0 "
                                                         "(0 = greedy), got 'abc'"),
    ("image", ["mode=sample", "sample.n=0"], "error: sample.n: must be an integer >= 1, got 0"),
    ("lm", ["mode=sample", "sample.tokens=-1"], "error: sample.tokens: must be an integer >= 1, got -1"),
    ("lm", ["mode=sample", "sample.top_k=-1"], "error: sample.top_k: must be null (no cut) or an integer >= 1, got -1"),
    ("lm", ["mode=sample", "sample.top_k=0"], "error: sample.top_k: must be null (no cut) or an integer >= 1, got 0"),
    # the knobs are checked whatever the task: an image checkpoint does not read top_k, but -1 or abc never works
    ("image", ["mode=sample", "sample.top_k=-1"], "error: sample.top_k: must be null (no cut) or an integer >= 1"),
    ("image", ["mode=sample", "sample.top_k=abc"], "error: sample.top_k: must be null (no cut) or an integer >= 1, "
                                                   "got 'abc'"),
    ("image", ["mode=sample", "sample.prompt_fraction=2"], "error: sample.prompt_fraction: must be a number in "
                                                           "[0, 1), got 2"),
    ("lm", ["mode=sample", "sample.completions=-1"], "error: sample.completions: must be an integer >= 0 (0: none), "
                                                     "got -1"),
    ("random", [], "error: ckpt_path: {ckpt} cannot be read as a checkpoint (truncated or not a checkpoint"),
    ("outside", [], "error: run_dir: {run}/config_resolved.yaml not found: {ckpt} is not inside a training run "
                    "directory"),
    ("image", ["trainer.max_steps=abc"], "error: trainer.max_steps: expected an integer number of optimizer steps"),
    pytest.param("image", ["trainer.precision=16-mixed"], "error: trainer.precision: '16-mixed' is not supported on "
                                                          "this machine's cpu", marks=without_gpu),
    ("lm", ["split=val"], "error: task.data.data_dir: enwik8 not found: the download failed"),  # evaluation reads its task's data
]


@pytest.mark.parametrize("which,overrides,line", EVAL_INPUTS)
def test_eval_refuses_before_the_run_directory_exists(which, overrides, line, checkpoints, tmp_path, capsys):
    ckpt, logs = checkpoints[which], tmp_path / "logs"
    argv = ["eval.py", f"ckpt_path={ckpt}", f"paths.log_dir={logs}", *overrides]
    expected = line.format(ckpt=ckpt, run=ckpt.parent.parent)
    assert refusal(lambda: check_composition(argv, CONF, "eval", check=check_eval_config), capsys).startswith(expected)
    assert not logs.exists()


def test_a_good_sampling_command_passes_the_pre_flight(checkpoints, tmp_path):
    argv = ["eval.py", f"ckpt_path={checkpoints['image']}", f"paths.log_dir={tmp_path / 'logs'}", "mode=sample",
            "sample.top_k=5", "sample.temperature=0"]
    assert check_composition(argv, CONF, "eval", check=check_eval_config)


def test_a_plan_given_as_a_list_where_the_config_holds_a_pattern_names_the_replacing_form(capsys):
    """``recall/arm=combiner_fixed_full`` stores ``model.layer_attention`` as a pattern; a list cannot be merged into
    it (Hydra: ``Cannot merge DictConfig with ListConfig``). The error gives the form that works, which composes."""
    from longseq.preflight.compose import compose_for_check

    arm = ["experiment=recall/mqar", "recall/arm=combiner_fixed_full"]
    line = refusal(lambda: check_composition(["train.py", *arm, "model.layer_attention=[full,combiner_fixed]"], CONF),
                   capsys)
    assert line == ("error: model.layer_attention: the composed config holds a dict {'every': 2, 'attention': 'full'} "
                    "here, and Hydra cannot merge a list into it; replace the value instead: '~model.layer_attention' "
                    "'+model.layer_attention=[full,combiner_fixed]'")
    cfg = compose_for_check(CONF, "train", [*arm, "~model.layer_attention", "+model.layer_attention=[full,combiner_fixed]"])
    assert list(cfg.model.layer_attention) == ["full", "combiner_fixed"]


def test_an_unknown_experiment_lists_the_nested_options(capsys):
    line = refusal(lambda: check_composition(["train.py", "experiment=recall/mqr"], CONF), capsys)
    assert line.startswith("error: experiment: no option 'recall/mqr' (did you mean experiment=recall/mqar?); "
                           "available: c4_mlm/axial, ")
    assert "cifar10/ablation_6l, " in line and "recall/needle, " in line


def cli(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "train.py", *TINY, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow  # 13 s; the same refusal in process: test_train_refuses_before_the_run_directory_exists
def test_a_cli_refusal_of_the_preflight_exits_1_and_leaves_no_directory(tmp_path):
    logs = tmp_path / "logs"
    out = cli([f"paths.log_dir={logs}", "task.batch_size=abc"])
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-2] == "error: task.batch_size: must be an integer >= 1 (the global batch), got 'abc'"
    assert not logs.exists()


def test_a_cli_refusal_only_the_run_can_find_exits_1_and_removes_its_directory(tmp_path):
    """End to end: a training split of 90 bytes cannot fill one batch of 4 windows of 64 (the datamodule's check, in
    the run's set-up, after Hydra made the run directory); that directory is removed again, with the folders made for
    it."""
    logs = tmp_path / "logs"
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"0123456789" * 10)
    out = cli([f"paths.log_dir={logs}", "task=enwik8", f"task.data.path={corpus}", "task.seq_len=64",
               "task.batch_size=4", "trainer.max_steps=2"])
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-2].startswith(f"error: {corpus}: the train split has 90 tokens, fewer than one "
                                                  "training batch")
    assert not logs.exists()
