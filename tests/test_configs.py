"""Every option of every config group composes and instantiates; bad choices fail with clear messages."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch
from conftest import CONF, ROOT, compose_config
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from longseq.attention import ATTENTION_REGISTRY, AttentionConfigError, build_attention
from longseq.preflight.trainer import check_trainer_types
from longseq.runner import build_datamodule, build_module, build_trainer, instantiate_group
from longseq.utils.errors import ConfigError


def options(group: str) -> list[str]:
    """Option names of a config group (YAML files, recursively, without extension)."""
    base = CONF / group
    return sorted(str(p.relative_to(base).with_suffix("")) for p in base.rglob("*.yaml"))


def test_registry_matches_attention_configs():
    assert set(options("attention")) == set(ATTENTION_REGISTRY) | {"sparse", "combiner"}


@pytest.mark.parametrize("task", options("task"))
def test_task_composes_and_instantiates(task, tmp_path):
    cfg = compose_config([f"task={task}"], tmp_path)
    dm = build_datamodule(cfg)
    module = build_module(cfg)
    assert module.net.seq_len == cfg.task.seq_len
    assert type(dm).__name__.lower().startswith(task.replace("_", "")[:5])
    # The sample grid and its key come with the capability (an image density model), never as a dummy;
    # attention maps are on for every task, with their own key.
    can_sample = callable(getattr(module, "sample", None))
    assert ("samples" in cfg.callbacks) is can_sample and ("sample_every_n_epochs" in cfg.task) is can_sample
    assert cfg.callbacks.attention_maps.every_n_epochs == 10


@pytest.mark.parametrize("attention", options("attention"))
def test_attention_builds_on_digits(attention, tmp_path):
    """Causal-capable attentions build inside the density model; bidirectional-only ones are rejected
    there with a message naming the attention, and build from the same config with causal=false."""
    from longseq.attention.registry import PARTITION_FAMILIES

    geometry = ["partition=fixed"] if attention in PARTITION_FAMILIES else []  # generic entries need partition=
    cfg = compose_config([f"attention={attention}", *geometry], tmp_path)
    factory = ATTENTION_REGISTRY.get(attention)
    if factory is None or factory.cls.supports_causal:
        module = build_module(cfg)
        assert module.net.blocks[0].attn.attention.causal is True
        return
    with pytest.raises(AttentionConfigError, match=f"'{attention}' cannot be causal"):
        build_module(cfg)
    spec = OmegaConf.to_container(cfg.attention, resolve=True)
    spec["causal"] = False
    attn = build_attention(spec.pop("name"), seq_len=cfg.task.seq_len, n_heads=2, head_dim=16, **spec)
    q = k = v = torch.randn(1, 2, cfg.task.seq_len, 16)
    assert attn(q, k, v).shape == q.shape


@pytest.mark.parametrize("family", ["sparse", "combiner"])
@pytest.mark.parametrize("partition", options("partition"))
def test_partition_builds_or_is_rejected_clearly(family, partition, tmp_path):
    from longseq.attention.registry import PARTITION_FAMILIES

    cfg = compose_config([f"attention={family}", f"partition={partition}"], tmp_path)
    target = PARTITION_FAMILIES[family].get(partition)
    if target in ATTENTION_REGISTRY:
        attn = build_module(cfg).net.blocks[0].attn.attention
        assert attn.name == target
    else:
        with pytest.raises(AttentionConfigError, match=f"partition={partition}"):
            build_module(cfg)


@pytest.mark.parametrize("group", ["model", "optimizer", "scheduler"])
def test_model_optimizer_scheduler_options(group, tmp_path):
    for option in options(group):
        cfg = compose_config([f"{group}={option}", "trainer.max_steps=1"], tmp_path)
        module = build_module(cfg)
        trainer = build_trainer(cfg, [], [])
        trainer.strategy.connect(module)
        module.trainer = trainer
        opt = module.configure_optimizers()
        optimizer = opt["optimizer"] if isinstance(opt, dict) else opt
        assert isinstance(optimizer, torch.optim.Optimizer)
        assert optimizer.param_groups[0]["weight_decay"] == cfg.optimizer.weight_decay


HARDWARE = {"gpu", "ddp", "fsdp", "tpu"}


@pytest.mark.parametrize("trainer", options("trainer"))
def test_trainer_options(trainer, tmp_path):
    cfg = compose_config([f"trainer={trainer}"], tmp_path)
    if trainer == "tpu":  # torch_xla is not installed with the project (make xla-check has its own environment)
        assert cfg.trainer.accelerator == "tpu" and cfg.trainer.precision == "bf16-true"
        with pytest.raises(ConfigError, match=r"trainer.accelerator: 'tpu' needs torch_xla, which is not installed in "
                                              r"this environment; .*make xla-check builds .venv-xla"):
            check_trainer_types(cfg.trainer)
    elif trainer in HARDWARE:
        # No accelerator here: the config must still compose, and building the trainer must fail loudly, naming the
        # key, rather than silently falling back to CPU.
        assert cfg.trainer.accelerator == "gpu"
        with pytest.raises(ConfigError, match=rf"trainer.accelerator: '{cfg.trainer.accelerator}' asks for a device "
                                              r"this machine does not have \(present: cpu\)"):
            check_trainer_types(cfg.trainer)  # the pre-flight's trainer check (train.py, runner.train, eval.py)
    else:
        trainer_obj = build_trainer(cfg, [], [])
        assert trainer_obj.num_devices == cfg.trainer.devices


@pytest.mark.parametrize("group", ["callbacks", "logger"])
def test_callbacks_and_loggers(group, tmp_path):
    for option in options(group):
        cfg = compose_config([f"{group}={option}"], tmp_path)
        objs = instantiate_group(cfg.get(group))
        expected = len([k for k, v in (cfg.get(group) or {}).items() if v and "_target_" in v])
        assert len(objs) == expected


def test_sample_grid_keys_exist_only_where_the_task_samples(tmp_path):
    """A non-image task rejects ``callbacks.samples.*`` overrides (no key that does nothing); ``callbacks=none``
    drops the grid an image task adds, like every other callback."""
    with pytest.raises(ConfigCompositionException, match="callbacks.samples.n_samples"):
        compose_config(["task=lra_listops", "callbacks.samples.n_samples=0"], tmp_path)
    with pytest.raises(ConfigCompositionException, match="task.sample_every_n_epochs"):
        compose_config(["task=enwik8", "task.sample_every_n_epochs=1"], tmp_path)
    cfg = compose_config(["task=cifar10", "task.sample_every_n_epochs=3"], tmp_path)
    (grid,) = [c for c in instantiate_group(cfg.callbacks) if type(c).__name__ == "SampleImages"]
    assert grid.every_n_epochs == 3 and cfg.callbacks.attention_maps.every_n_epochs == 10
    for option in ("callbacks=none", "debug=overfit"):
        assert compose_config(["task=cifar10", option], tmp_path).callbacks is None


def test_logger_many_loggers_has_three(tmp_path):
    cfg = compose_config(["logger=many_loggers"], tmp_path)
    assert set(cfg.logger) == {"csv", "tensorboard", "wandb"}


@pytest.mark.parametrize("debug", options("debug"))
def test_debug_options(debug, tmp_path):
    cfg = compose_config([f"debug={debug}"], tmp_path)
    assert cfg.task_name == "debug"
    build_trainer(cfg, instantiate_group(cfg.get("callbacks")), [])


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiments_compose_and_build(experiment, tmp_path):
    cfg = compose_config([f"experiment={experiment}"], tmp_path, fast=False)
    assert cfg.tags
    build_datamodule(cfg)
    if experiment.startswith("cifar10/ablation_6l"):
        assert (cfg.model.n_layers, cfg.model.n_heads, cfg.model.d_model) == (6, 8, 512)
        assert (cfg.task.batch_size, cfg.optimizer.lr) == (32, 1e-3)


def test_hparams_search_composes(tmp_path):
    cfg = compose_config(["hparams_search=digits_optuna"], tmp_path)
    assert cfg.optimized_metric == "val/bpd_best"
    assert cfg.hydra.sweeper.direction == "minimize"
    assert "optimizer.lr" in cfg.hydra.sweeper.params


def test_paths_and_extras_and_eval_config(tmp_path):
    cfg = compose_config([], tmp_path)
    assert cfg.paths.data_dir.endswith("data")
    assert cfg.extras.enforce_tags is True
    ecfg = compose_config(["ckpt_path=x.ckpt"], tmp_path, config_name="eval")
    assert ecfg.ckpt_path == "x.ckpt" and ecfg.split == "test"


def test_unknown_attention_names_the_key(tmp_path):
    with pytest.raises(Exception, match="attention"):
        compose_config(["attention=nope"], tmp_path)
    cfg = compose_config([], tmp_path)
    cfg.attention.name = "nope"
    with pytest.raises(AttentionConfigError, match=r"unknown attention 'nope'.*valid: .*full"):
        build_module(cfg)


def test_unknown_attention_knob_names_the_key(tmp_path):
    cfg = compose_config(["+attention.window=3"], tmp_path)
    with pytest.raises(AttentionConfigError, match="attention.window"):
        build_module(cfg)


def test_impossible_geometry_names_the_key(tmp_path):
    cfg = compose_config(["attention=sparse", "partition=axial", "partition.block_size=7"], tmp_path)
    with pytest.raises(AttentionConfigError, match=r"attention.block_size.*\[1, 2, 4, 8, 16, 32, 64\]"):
        build_module(cfg)


def test_non_causal_attention_on_density_task_is_rejected(tmp_path):
    cfg = compose_config(["attention.causal=false"], tmp_path)
    with pytest.raises(ValueError, match="attention.causal"):
        build_module(cfg)


def test_model_compile_compiles_the_backbone_in_place(tmp_path):
    """``model.compile`` composes (default false); true compiles the backbone's forward once, when the Trainer sets
    the module up (``configure_model``), in place: the parameter names (checkpoints) are those of the plain model."""
    plain = build_module(compose_config([], tmp_path))
    plain.configure_model()
    assert plain.compile_backbone is False and plain.net._compiled_call_impl is None
    module = build_module(compose_config(["model.compile=true", "attention=combiner_logsparse"], tmp_path))
    assert module.compile_backbone is True and module.net._compiled_call_impl is None
    module.configure_model()
    compiled = module.net._compiled_call_impl
    module.configure_model()  # a second fit / validate does not wrap it again
    assert compiled is not None and module.net._compiled_call_impl is compiled
    assert list(module.state_dict()) == list(build_module(compose_config(["attention=combiner_logsparse"],
                                                                         tmp_path)).state_dict())


@pytest.mark.parametrize("hook", ["on_fit_start", "on_validation_start", "on_test_start", "on_predict_start"])
def test_model_compile_prepares_the_flex_layouts_before_the_first_traced_step(tmp_path, hook):
    """Every entry point's start hook builds the layers' static flex layouts on the module's device when the backbone
    is compiled (tests/attention/test_flex.py: the first trace is then one graph), and nothing when it is not."""
    overrides = ["attention=combiner_fixed", "attention.backend=flex"]
    for compiled in (False, True):
        module = build_module(compose_config(overrides + [f"model.compile={str(compiled).lower()}"], tmp_path))
        getattr(module, hook)()
        layouts = [block.attn.attention.flex_layouts for block in module.net.blocks]
        assert all(layouts) if compiled else not any(layouts)
    # a task whose batches carry key padding (LRA) prepares the padded layout (the layout key's 5th field), others not
    for task, padded in (("digits", False), ("lra_listops", True)):
        module = build_module(compose_config(overrides + [f"task={task}", "model.compile=true"], tmp_path))
        getattr(module, hook)()
        assert {key[4] for key in module.net.blocks[0].attn.attention.flex_layouts} == {padded}


def test_model_compile_must_be_a_boolean(tmp_path):
    with pytest.raises(ConfigError, match="model.compile: must be true or false"):
        build_module(compose_config(["model.compile=yes"], tmp_path))


def test_model_compile_mode_passes_to_torch_compile_and_names_the_valid_modes(tmp_path, monkeypatch):
    """``model.compile_mode`` (default: torch.compile's default) reaches ``nn.Module.compile``; an unknown mode fails
    at construction naming the key and the valid modes."""
    seen = []
    module = build_module(compose_config(["model.compile=true", "model.compile_mode=reduce-overhead"], tmp_path))
    monkeypatch.setattr(type(module.net), "compile", lambda self, **kwargs: seen.append(kwargs))
    module.configure_model()
    assert seen == [{"dynamic": False, "mode": "reduce-overhead"}]
    with pytest.raises(ConfigError, match=r"model.compile_mode: 'fastest' is not valid; choose one of .*reduce-overhead"):
        build_module(compose_config(["model.compile=true", "model.compile_mode=fastest"], tmp_path))


@pytest.mark.slow
def test_model_compile_trains(make_cfg):
    """Three steps of the digits task with the backbone compiled by inductor (CPU: about a minute of compilation)."""
    from longseq.runner import train

    metrics = train(make_cfg(["model.compile=true", "attention=combiner_logsparse", "trainer.max_steps=3",
                              "test=false"]))
    assert 0 < metrics["val/bpd"] < 10


def test_global_batch_must_divide(tmp_path):
    cfg = compose_config(["task.batch_size=10", "trainer.accumulate_grad_batches=4"], tmp_path)
    dm = build_datamodule(cfg)
    with pytest.raises(ValueError, match="task.data.batch_size=10"):
        dm.setup("fit")


@pytest.mark.slow  # a CLI run
def test_cli_cfg_job_composes_for_gpu():
    out = subprocess.run(
        [sys.executable, "train.py", "attention=full", "task=cifar10", "trainer=gpu", "--cfg", "job"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    job = OmegaConf.create(out.stdout)
    assert job.trainer.accelerator == "gpu" and job.task.seq_len == 3072


def test_table1_sweep_builds_the_six_attentions(tmp_path):
    """``python train.py -m experiment=digits/table1`` sweeps ``attention=sparse,combiner
    partition=fixed,axial,logsparse`` (and seeds): every job composes with its partition and builds the sparse
    pattern or its Combiner counterpart."""
    params = compose_config(["experiment=digits/table1"], tmp_path).hydra.sweeper.params
    built = set()
    for attention, partition in itertools.product(params.attention.split(","), params.partition.split(",")):
        cfg = compose_config(["experiment=digits/table1", f"attention={attention}", f"partition={partition}"], tmp_path)
        assert cfg.attention.partition.name == partition and cfg.task.block_size == 4
        built.add(build_module(cfg).net.blocks[0].attn.attention.name)
    assert built == {"fixed", "axial", "logsparse", "combiner_fixed", "combiner_axial", "combiner_logsparse"}


def test_partition_is_composed_only_for_the_generic_entries(tmp_path):
    """``partition=`` is the geometry of ``attention=sparse|combiner`` only: other runs do not carry it, and a
    generic entry without one fails naming ``partition=<name>`` and the valid values. ``causal`` comes from the
    task, in one place (``train.yaml``), not from a copy per attention YAML."""
    assert "partition" not in compose_config(["attention=full"], tmp_path)
    assert not any("causal" in line and "task.causal" in line for path in (CONF / "attention").glob("*.yaml")
                   for line in path.read_text().splitlines())
    cfg = compose_config(["attention=combiner", "task=cifar10"], tmp_path)
    assert cfg.attention.causal is True
    with pytest.raises(AttentionConfigError, match=r"partition=<name>; valid: \['axial'"):
        build_module(cfg)
