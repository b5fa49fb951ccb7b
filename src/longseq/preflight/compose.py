"""A command's config composed before Hydra composes it for the run, and Hydra's composition failures (an unknown
key or option, an ambiguous or unparsable value, a list given where the config holds a dict) as one
``error: <key>: <message>`` line naming the key, instead of Hydra's several lines."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from longseq.preflight.trainer import trainer_arguments
from longseq.utils.errors import ConfigError


def compose_for_check(config_dir: Path, config_name: str, overrides: list[str], output_dir: str | None = None):
    """The job config ``overrides`` compose to (Hydra's own overrides left out), for checks before the run starts.

    ``paths.output_dir`` resolves to ``output_dir`` (the run directory Hydra will use: ``hydra.run.dir`` when the
    command gives it, else the generated name), which nothing here creates."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    job_overrides = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir)):
            cfg = compose(config_name=config_name, overrides=job_overrides, return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = output_dir or str(cfg.hydra.run.dir)
        HydraConfig.instance().set_config(cfg)
        return cfg
    finally:
        GlobalHydra.instance().clear()


def group_options(config_dir: Path, group: str) -> list[str]:
    """Every option of config group ``group`` under ``config_dir``, nested ones as ``<folder>/<name>``
    (``experiment=recall/mqar``)."""
    folder = Path(config_dir) / group
    return sorted(str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml")) if folder.is_dir() else []


def composition_error(exc: Exception, overrides: Sequence[str], compose: Any = None,
                      config_dir: Path | None = None) -> ConfigError | None:
    """A ``ConfigError`` naming the key for Hydra's composition failures (an unknown key or option, an ambiguous
    or unparsable override, a list or a dict where the config holds the other), which Hydra itself prints over
    several lines without the ``error: <key>:`` form.

    ``compose(overrides)`` (optional) composes without the failing override, to list the keys that do exist;
    ``config_dir`` lists a group's nested options. None when the exception is not one of these.
    """
    text = str(exc)
    missing = re.search(r"Could not find '(?P<path>[\w/.-]+)'", text)
    if missing:
        return missing_option_error(missing["path"], text, overrides, config_dir)
    merge = merge_error(exc, compose, overrides)
    if merge is not None:
        return merge
    unknown = re.search(r"Could not override '(?P<key>[\w.]+)'", text)
    if unknown:
        return unknown_key_error(unknown["key"], overrides, compose)
    ambiguous = re.search(r"Ambiguous value for argument '(?P<key>[^=']+)=(?P<value>[^']*)'", text)
    if ambiguous:
        key, value = ambiguous["key"], ambiguous["value"]
        return ConfigError(key.lstrip("+~"), f"{value} is ambiguous: a list is {key}=[{value}], a string "
                                             f"{key}='{value}', a sweep needs -m")
    parse = re.search(r"at input '(?P<input>[^']*)'", text)
    if type(exc).__name__ == "OverrideParseException":
        culprit = next((o for o in overrides if parse and parse["input"] and parse["input"] in o), None)
        key = culprit.split("=", 1)[0].lstrip("+~") if culprit else "overrides"
        return ConfigError(key, f"cannot parse {culprit or 'an override'!r} ({text.splitlines()[0]}; Hydra's override "
                                "grammar: https://hydra.cc/docs/advanced/override_grammar/basic/)")
    return None


def missing_option_error(path: str, text: str, overrides: Sequence[str], config_dir: Path | None) -> ConfigError:
    """``<group>=<name>`` names no config file: the group's options (nested ones too), and the closest."""
    typed = next((o.lstrip("+~").split("=", 1) for o in overrides
                  if "=" in o and "/".join(o.lstrip("+~").split("=", 1)) == path), None)
    group, name = typed if typed else path.rsplit("/", 1)
    options = group_options(config_dir, group) if config_dir is not None else []
    if not options:
        options = [line.strip() for line in text.split("Available options in", 1)[-1].splitlines()[1:]
                   if line.startswith("\t") and "=" not in line] if "Available options in" in text else []
    close = difflib.get_close_matches(name, options, n=1)
    hint = f" (did you mean {group}={close[0]}?)" if close else ""
    return ConfigError(group.replace("/", "."), f"no option '{name}'{hint}; available: {', '.join(options) or '(none)'}")


def merge_error(exc: Exception, compose: Any, overrides: Sequence[str]) -> ConfigError | None:
    """An override of a dict with a list (or a list with a dict), which Hydra cannot merge: ``model.layer_attention``
    holds the pattern ``{every: 2, attention: full}`` in ``recall/arm=combiner_fixed_full`` and the command gives the
    list ``[full, combiner_fixed]``. Says how to replace the value instead: delete it, then add it."""
    failing = re.search(r"Error merging override (?P<override>\S+)", str(exc))
    cause = exc.__cause__
    kinds = re.search(r"Cannot merge (?P<held>\w+Config) with (?P<given>\w+Config)", str(cause)) if cause else None
    if not failing or not kinds:
        return None
    override = failing["override"]
    key, _, value = override.lstrip("+").partition("=")
    held = None
    if compose is not None:
        try:
            held = OmegaConf.select(compose([o for o in overrides if o != override]), key)
        except Exception:  # noqa: BLE001 - the held value is a hint only
            held = None
    shape = {"DictConfig": "a dict", "ListConfig": "a list"}
    holds = shape.get(kinds["held"], kinds["held"])
    if isinstance(held, (DictConfig, ListConfig)):
        holds += f" {OmegaConf.to_container(held)}"
    return ConfigError(key, f"the composed config holds {holds} here, and Hydra cannot merge "
                            f"{shape.get(kinds['given'], kinds['given'])} into it; replace the value instead: "
                            f"'~{key}' '+{key}={value}'")


def unknown_key_error(key: str, overrides: Sequence[str], compose: Any) -> ConfigError:
    """``key=value`` names a key the config does not have: the keys its parent has, and the closest."""
    parent, _, leaf = key.rpartition(".")
    known: list[str] = []
    if parent == "trainer":
        known = sorted(trainer_arguments())
    elif compose is not None:
        try:
            node = OmegaConf.select(compose([o for o in overrides if not o.startswith(f"{key}=")]), parent or "")
            known = sorted(str(k) for k in node if k != "hydra") if isinstance(node, DictConfig) else []
        except Exception:  # noqa: BLE001 - the hint is optional
            known = []
    close = difflib.get_close_matches(leaf, known, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
    where = f"{parent} has " if parent else "the config has "
    listed = f"; {where}{', '.join(known)}" if known else ""
    value = next((o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")), "<value>")
    return ConfigError(key, f"not a key of this config ({hint}a new key needs +{key}={value}){listed}")


def compose_or_exit(config_dir: Path, config_name: str, overrides: list[str],
                    output_dir: str | None = None) -> DictConfig | None:
    """The composed config, or the ``error: <key>:`` line and exit 1 for a composition error that names its key;
    None for any other failure (the run reports it with its context)."""
    from longseq.utils.console import full_errors, report_and_exit

    try:
        return compose_for_check(config_dir, config_name, overrides, output_dir)
    except Exception as exc:  # noqa: BLE001 - only composition errors are reported here; the run reports the rest
        if full_errors():
            raise
        error = composition_error(exc, overrides,
                                  lambda kept: compose_for_check(config_dir, config_name, kept, output_dir),
                                  config_dir)
        if error is not None:
            report_and_exit(error)
        return None


def check_before_run(cfg: DictConfig, check: Callable[[DictConfig], Any]) -> bool:
    """Run ``check(cfg)`` before the run directory exists; True when it passed. An error that names the key or file
    to fix is printed as the one ``error:`` line (exit 1), so a refused run leaves nothing behind; any other error is
    left to the run (False), which reports it with its context (its log holds the traceback)."""
    import logging

    from longseq.utils.console import full_errors, report_and_exit
    from longseq.utils.errors import name_user_key, names_what_to_fix

    try:
        check(cfg)
        return True
    except Exception as exc:  # noqa: BLE001 - sorted below: the user's mistakes now, the rest in the run
        if not names_what_to_fix(exc):
            logging.getLogger(__name__).debug(f"pre-run check: {type(exc).__name__}: {exc} (left to the run)")
            return False
        if full_errors():
            raise
        report_and_exit(name_user_key(exc, cfg))
