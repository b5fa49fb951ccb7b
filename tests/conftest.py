"""Shared test fixtures: compose the real Hydra config with test-sized overrides."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
os.environ.setdefault("PROJECT_ROOT", str(ROOT))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
sys.path.insert(0, str(Path(__file__).parent))  # attention_checks, fixtures

FAST = [
    "trainer.max_steps=3",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "extras.print_config=false",
    "model.n_layers=1",
    "model.d_model=32",
    "model.n_heads=2",
]

# The registry-wide tests that cost a second or more a variant (tracing with dynamo, training through Lightning,
# sampling) run these variants in the fast suite and every other one in the slow suite (``make test-slow``): one per
# mechanism — dense; Combiner's axial (the default) and fixed partitions; a window, a fixed grid and logsparse's level
# loops; clustering; random features, chunked linear attention, hashing, low rank and mixing. The cheap registry-wide
# tests (the contract, ``attention_matrix``, gradients, decoding, flex equalities) keep every variant in the fast suite.
FAST_VARIANTS = frozenset({"full", "combiner_axial", "combiner_fixed", "local", "fixed", "logsparse", "routing",
                           "performer", "linear", "reformer", "nystrom", "fnet"})


def fast_variants_first(params: list) -> list:
    """``params`` (variant names, or tuples whose first item is one) as pytest parameters, those of variants outside
    ``FAST_VARIANTS`` marked slow."""
    params = [p if isinstance(p, tuple) else (p,) for p in params]
    return [pytest.param(*p, marks=() if p[0] in FAST_VARIANTS else pytest.mark.slow) for p in params]


@contextlib.contextmanager
def injected_callbacks(*callbacks):
    """Inside, every run's callbacks group (the one holding ``model_checkpoint``) gets ``callbacks`` beside the
    configured ones: how a test injects a fault or a probe into a real run, a resumed one included."""
    from longseq import runner

    original = runner.instantiate_group
    runner.instantiate_group = lambda group: original(group) + (
        list(callbacks) if group and "model_checkpoint" in group else [])
    try:
        yield
    finally:
        runner.instantiate_group = original


def compose_config(overrides: list[str] | None = None, output_dir: Path | None = None, config_name: str = "train",
                   fast: bool = True) -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` as ``train.py`` would, with ``output_dir`` as the run dir.

    ``fast`` prepends small-model / few-step overrides (the caller's overrides win).
    """
    GlobalHydra.instance().clear()
    overrides = (FAST if fast and config_name == "train" else []) + list(overrides or [])
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose(config_name=config_name, return_hydra_config=True, overrides=overrides)
    if output_dir is not None:
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(output_dir)
            cfg.hydra.runtime.cwd = str(ROOT)
            cfg.hydra.job.num = 0
            cfg.paths.log_dir = str(output_dir / "logs")
    HydraConfig.instance().set_config(cfg)
    return cfg


def pytest_configure(config):
    """Under pytest-xdist, each worker's torch gets its share of the cores: with the default (every core) per worker,
    two workers on two cores oversubscribe them, and each small op's parallel region waits for a thread the other
    worker holds (8 ms for a (3, 64) linear layer on the loaded machine instead of microseconds)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the processes a test starts (train.py, DDP ranks, notebooks)


@pytest.fixture(scope="session", autouse=True)
def config_resolvers():
    """The configs' OmegaConf resolvers, registered in the processes that run tests: importing them at the top of this
    file took pytest-xdist's controller 11 s (they pull in torch and the models) before it started any worker."""
    from longseq.utils.config import register_resolvers

    register_resolvers()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny fp64 ops: thread start-up dominates on a loaded 2-core machine (seconds instead of ms)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_cfg(tmp_path):
    """``make_cfg(overrides)`` -> a composed train config writing into ``tmp_path``."""

    def make(overrides=None, **kw):
        return compose_config(overrides, output_dir=tmp_path, **kw)

    yield make
    GlobalHydra.instance().clear()
