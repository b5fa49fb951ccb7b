"""The pre-flight of ``train.py`` and ``eval.py``: compose the command's config once, before Hydra makes the run
directory, and refuse it there (``error: <key>: <message>``, exit 1, nothing written) when it cannot run.

``preflight_train`` also resumes: ``ckpt_path=<run>/checkpoints/<file>.ckpt`` (or a run / checkpoints directory)
replays the run's saved overrides under the command's own, refuses a change a resume cannot make, says what
changes (from which value), stops at once when the run is already complete, and points Hydra at ``<run>``.
Multiruns (``-m``) are checked per job by ``runner.train``.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from longseq.preflight.compose import check_before_run, compose_or_exit
from longseq.preflight.resume import check_resume_changes, completed_run, describe_changes
from longseq.preflight.train import check_train_config
from longseq.utils.checkpoint import checkpoint_step, resolve_ckpt_path, run_dir_of
from longseq.utils.console import full_errors, report_and_exit
from longseq.utils.errors import ConfigError
from longseq.utils.resume import override_key, override_value, replay, saved_overrides
from longseq.utils.rundir import RESOLVED_CONFIG, describe, live_holder, rank_zero


def parse_command(argv: list[str]):
    """Hydra's parse of ``argv`` (its flags and the overrides), and whether the pre-flight leaves it to Hydra:
    multiruns (checked per job), ``--cfg`` / ``--help`` and friends."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv[1:])
    hydra_only = args.multirun or args.cfg or args.info or args.help or args.hydra_help or args.shell_completion
    return args, bool(hydra_only)


def check_composition(argv: list[str], config_dir: Path, config_name: str = "train",
                      check: Callable[[DictConfig], object] | None = None) -> bool:
    """Compose the command's config once before Hydra does, so a bad override (unknown key or option, an ambiguous
    or unparsable value) prints the one ``error: <key>: <message>`` line and exits 1 like every other error; then
    ``check`` the composed config (``check_before_run``), so a refused run leaves no run directory. Returns True
    when ``check`` ran and passed. Multiruns and ``--cfg`` / ``--help`` are left to Hydra."""
    args, hydra_only = parse_command(argv)
    if hydra_only:
        return False
    overrides = list(args.overrides or [])
    cfg = compose_or_exit(config_dir, args.config_name or config_name, overrides,
                          override_value(overrides, "hydra.run.dir"))
    return cfg is not None and check is not None and check_before_run(cfg, check)


def preflight_train(argv: list[str], config_dir: Path, config_name: str = "train") -> tuple[list[str], bool]:
    """``train.py``'s pre-flight: ``(argv to run, whether the composed config passed check_train_config)``.

    Without ``ckpt_path`` the command is composed and checked as typed. With it (a file, or a run /
    ``checkpoints/`` directory: the newest of ``last.ckpt`` / ``interrupted.ckpt``), inside ``<run>/checkpoints/``
    the run's saved overrides are replayed under the command's own (``utils.resume.replay``), a change of a key
    fixed by the checkpoint is refused naming it (``resume.check_resume_changes``), the changes are printed with
    their old values, a completed run is reported as such (exit 0, nothing written), and ``hydra.run.dir=<run>``
    is added (unless given) so the training continues in its own directory; Hydra's record of this invocation goes
    to ``<run>/.hydra/resume-<time>/`` and the original ``.hydra/overrides.yaml`` stays as it was. The run must not
    be live.
    """
    if not rank_zero():  # a DDP rank re-launched by Lightning: its rank 0 already did this (argv is the result)
        return argv, False
    args, hydra_only = parse_command(argv)
    if hydra_only:
        return argv, False
    name = args.config_name or config_name
    given = list(args.overrides or [])
    ckpt = override_value(given, "ckpt_path")
    if not ckpt or ckpt == "null":
        cfg = compose_or_exit(config_dir, name, given, override_value(given, "hydra.run.dir"))
        return argv, cfg is not None and check_before_run(cfg, check_train_config)
    flags = [a for a in argv[1:] if a not in set(given)]
    explicit_dir = override_value(given, "hydra.run.dir")
    try:
        resolved = resolve_ckpt_path(ckpt, resume=True)
        run = run_dir_of(resolved)
        overrides = [o for o in given if override_key(o)[0] != "ckpt_path"] + [f"ckpt_path={resolved}"]
        holder = live_holder(run) if run is not None and explicit_dir is None else None
        if holder:
            raise ConfigError("ckpt_path", f"{run} is still being written by a live run ({describe(holder)}); "
                                           "stop it first (its checkpoints are not final)")
        if run is not None:
            record, saved = saved_overrides(run)
            overrides, kept, _ = replay(saved, overrides)
            print(f"resume: replaying {record}: {' '.join(kept) or '(no overrides)'}", file=sys.stderr)
        cfg = compose_or_exit(config_dir, name, overrides, explicit_dir or (str(run) if run is not None else None))
        if cfg is not None and run is not None:
            report_resume(cfg, run, resolved, given)
    except ConfigError as exc:
        if full_errors():
            raise
        report_and_exit(exc)
    checked = cfg is not None and check_before_run(cfg, check_train_config)
    if run is None or explicit_dir is not None:
        return [argv[0], *flags, *overrides], checked
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    print(f"resuming in place: {run}", file=sys.stderr)
    return [argv[0], *flags, *overrides, f"hydra.run.dir={run}", f"hydra.output_subdir=.hydra/resume-{stamp}"], checked


def report_resume(cfg: DictConfig, run: Path, ckpt: Path, given: list[str]) -> None:
    """Against the run's resolved config: refuse a fixed key's change (``ConfigError``), print what changes, and
    exit 0 with a note when the run is complete already (resuming it would only validate and test again)."""
    record = run / RESOLVED_CONFIG
    if not record.is_file():
        return
    found = check_resume_changes(OmegaConf.load(record), cfg, ckpt, given)
    if found:
        print(f"resume: this command changes {describe_changes(found)} (optimizer and scheduler settings apply from "
              "the resumed step)", file=sys.stderr)
    step = checkpoint_step(ckpt)
    if completed_run(run, step, cfg):
        print(f"resume: {run} is complete: {ckpt.name} is at step {step} of trainer.max_steps={cfg.trainer.max_steps} "
              f"and its results are in {run / 'metrics.json'}; nothing to train. To train further raise "
              f"trainer.max_steps (python train.py ckpt_path={run} trainer.max_steps=<more>); to evaluate a checkpoint "
              "again: python eval.py ckpt_path=<it>", file=sys.stderr)
        raise SystemExit(0)
