"""``train.py``'s pre-flight: check ``ckpt_path`` and resume a run in place, before Hydra makes a run directory."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

from longseq.utils.checkpoint import run_dir_of
from longseq.utils.console import full_errors, report_and_exit
from longseq.utils.errors import ConfigError


def override_value(overrides: list[str], key: str) -> str | None:
    """The value of the last ``key=value`` (or ``+key=value``) among Hydra command-line overrides."""
    value = None
    for item in overrides:
        name, sep, rest = item.partition("=")
        if sep and name.lstrip("+") == key:
            value = rest
    return value


def compose_for_check(config_dir: Path, config_name: str, overrides: list[str]):
    """The job config ``overrides`` compose to (Hydra's own keys left out), for checks before the run starts."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    job_overrides = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir)):
            cfg = compose(config_name=config_name, overrides=job_overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        return cfg
    finally:
        GlobalHydra.instance().clear()


def preflight(argv: list[str], config_dir: Path, config_name: str = "train") -> list[str]:
    """Check ``ckpt_path=`` and return ``argv`` with the overrides that resume its run in place.

    The checkpoint must exist, load and match the model the other overrides compose (``ConfigError`` naming
    the file, or the differing keys and the run's ``.hydra/overrides.yaml``): nothing is created when it
    does not. A checkpoint inside ``<run>/checkpoints/`` adds ``hydra.run.dir=<run>`` (unless given), so the
    resumed training continues in its own directory; Hydra's record of this invocation goes to
    ``<run>/.hydra/resume-<time>/`` and the run's original ``.hydra/overrides.yaml`` stays as it was.
    Multiruns (``-m``) are checked per job by ``runner.train`` instead.
    """
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv[1:])
    if args.multirun or args.cfg or args.info or args.help or args.hydra_help or args.shell_completion:
        return argv
    overrides = list(args.overrides or [])
    ckpt = override_value(overrides, "ckpt_path")
    if not ckpt or ckpt == "null":
        return argv
    from longseq.runner import check_ckpt_path

    try:
        cfg = compose_for_check(config_dir, args.config_name or config_name, overrides)
        check_ckpt_path(cfg)
    except ConfigError as exc:
        if full_errors():
            raise
        report_and_exit(exc)
    except Exception:  # noqa: BLE001 - any other problem is reported by the real run, with its context
        pass
    run = run_dir_of(ckpt)
    if run is None or override_value(overrides, "hydra.run.dir") is not None:
        return argv
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    print(f"resuming in place: {run}", file=sys.stderr)
    return [*argv, f"hydra.run.dir={run}", f"hydra.output_subdir=.hydra/resume-{stamp}"]
