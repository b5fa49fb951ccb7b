"""What the project publishes reads as finished and stays true: no placeholder left unfilled in docs/ or the
top-level documents, every markdown table renders whole, every command of README and the guides in docs/ composes
or parses, every link and named path resolves, README stays a front page (at most 300 lines) that links every page
of docs/, and every guide opens with its commands."""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from conftest import CONF, ROOT
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

DOCUMENTS = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "CHANGELOG.md"])
# A figure still to be filled in: __NEEDLE_WALL__, {{figure}}, <TODO>, TBD, XXX.
PLACEHOLDER = re.compile(r"__[A-Z][A-Z0-9_]*__|\{\{[^}]*\}\}|<TODO>|\bTBD\b|\bXXX\b")


def table_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every run of consecutive lines that start with ``|`` outside code blocks."""
    blocks: list[tuple[int, list[str]]] = []
    in_code, current, start = False, [], 0
    for number, line in enumerate(text.splitlines() + [""], start=1):
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("|"):
            if not current:
                start = number
            current.append(line)
        elif current:
            blocks.append((start, current))
            current = []
    return blocks


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unfilled_placeholder(document: Path):
    found = [f"{document.name}:{n}: {m.group()}" for n, line in enumerate(document.read_text().splitlines(), start=1)
             for m in PLACEHOLDER.finditer(line)]
    assert not found, found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_starts_with_its_header(document: Path):
    """A table cut by a blank line renders its second half as plain text: each block of ``|`` lines must open with a
    header row and a ``|---|`` separator."""
    separator = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+\s*$")
    text = document.read_text()
    above = {number: line for number, line in enumerate([""] + text.splitlines(), start=1)}  # the line before each
    # GitHub renders a header row without its leading pipe too: then the block opens with the separator
    cut = [f"{document.name}:{start}: {lines[0][:60]}" for start, lines in table_blocks(text)
           if not (len(lines) >= 2 and separator.match(lines[1]))
           and not (separator.match(lines[0]) and "|" in above[start])]
    assert not cut, cut


def test_the_checks_find_what_they_look_for():
    assert PLACEHOLDER.search("the needle another __NEEDLE_WALL__.") and not PLACEHOLDER.search("`__init__.py`")
    cut = "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n"
    assert [start for start, _ in table_blocks(cut)] == [1, 5]


# --- README and the guides: every command composes or parses, every link resolves -------------------------------
# The measured records keep the commands as they ran; every other page of docs/ is a guide.
RECORDS = {"results.md", "gpu_check_h100.md", "gpu_check_h200.md", "gpu_check_h200_layers.md",
           "cpu_engine_measurements.md", "xla_check_cpu.md"}
README = ROOT / "README.md"
GUIDES = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in RECORDS)
README_MAX_LINES = 300
PYTHONS = {"python", "python3", ".venv/bin/python"}
OTHER_PROGRAMS = {"source", "pip", "wandb", "sbatch"}  # not this project's: run as they are documented upstream
PLACEHOLDER_VALUE = re.compile(r"<[A-Za-z_][\w .-]*>")  # <run>, <ckpt>, <time>: a value the reader fills in
INLINE_COMMAND = re.compile(r"^(python3? (train|eval)\.py|python3? -m longseq|make [a-z])")
REPO_PATH = re.compile(r"^(conf|src|tests|notebooks|tools|docs)/[\w./-]*$")


def without_fences(text: str) -> str:
    """``text`` with every fenced code block blanked (line numbers kept)."""
    out, in_code = [], False
    for line in text.splitlines():
        fence = line.lstrip().startswith("```")
        out.append("" if in_code or fence else line)
        in_code ^= fence
    return "\n".join(out)


def bash_blocks(text: str) -> list[list[str]]:
    """The lines of every ```bash block."""
    blocks, current, lang = [], None, None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if lang is None:
                lang = line.strip()[3:] or "text"
                current = []
            else:
                if lang == "bash":
                    blocks.append(current)
                lang, current = None, None
            continue
        if current is not None:
            current.append(line)
    return blocks


def shell_commands(text: str) -> list[str]:
    """Every command of the ```bash blocks of ``text``: comment lines dropped, ``\\`` continuations joined, ``&&``
    chains split; each as one string (shlex drops the trailing comments)."""
    commands = []
    for block in bash_blocks(text):
        joined = "\n".join(block).replace("\\\n", " ")
        for line in joined.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands += [part.strip() for part in line.split(" && ")]
    return commands


def inline_commands(text: str) -> list[tuple[str, bool]]:
    """``(command, marked pending)`` for every inline code span outside code blocks that is a command of this project
    (``python train.py ...``, ``python -m longseq...``, ``make <target>``); a span may wrap lines."""
    prose = without_fences(text)
    found = []
    for match in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(match.group(1).split())
        if INLINE_COMMAND.match(span):
            found.append((span, prose[match.end():match.end() + 10].startswith(" (pending)")))
    return found


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


class ArgumentsParsed(Exception):
    """Raised by the patched ``ArgumentParser`` once a command line parsed: the program itself never runs."""


def parses(main, argv: list[str], monkeypatch) -> argparse.Namespace:
    """The namespace ``main(argv)`` parses from ``argv``, without running the rest of ``main``."""
    seen = {}
    original = argparse.ArgumentParser.parse_known_args

    def parse_and_stop(parser, args=None, namespace=None):
        namespace, extra = original(parser, args, namespace)
        if parser.prog.startswith("python -m longseq"):
            seen["args"] = namespace
            raise ArgumentsParsed
        return namespace, extra

    with monkeypatch.context() as patched:
        patched.setattr(argparse.ArgumentParser, "parse_known_args", parse_and_stop)
        with pytest.raises(ArgumentsParsed):
            main(argv)
    return seen["args"]


def is_group(key: str) -> bool:
    """A config group (``attention``, ``experiment``, ``hydra/launcher``), not a value."""
    return "/" in key or (CONF / key).is_dir()


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Jobs of a ``-m`` command that compose every option of every swept config group at least once (job i takes
    value i of each sweep, cycling), through Hydra's own override grammar and sweep expansion. A swept plain value
    (``seed=1,2,3``) composes like its first one, so only group sweeps add jobs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices, width = [], 1
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override():
            values = [f"{override.get_key_element()}={v}" for v in override.sweep_string_iterator()]
            width = max(width, len(values)) if is_group(override.key_or_group) else width
            choices.append(values)
        else:
            choices.append([override.input_line])
    return [[c[i % len(c)] for c in choices] for i in range(width)]


RUN_DIR = "/nonexistent/longseq-docs-run"  # paths.output_dir of the composed configs: resolved, never written
HYDRA_CONFIG_SET: list[DictConfig | None] = [None]  # the config whose hydra node ${hydra:...} now reads


@functools.cache
def compose_defaults(config_name: str, group_overrides: tuple[str, ...], with_hydra: bool) -> DictConfig:
    """The config the defaults list composes to with these config-group choices (Hydra's expensive step, shared by
    every command that chooses the same groups)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
            cfg = compose(config_name=config_name, overrides=list(group_overrides), return_hydra_config=with_hydra)
    finally:
        GlobalHydra.instance().clear()
    if with_hydra:
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = RUN_DIR
            cfg.hydra.runtime.cwd = str(ROOT)
            cfg.hydra.job.num = 0
    return cfg


def compose_resolved(config_name: str, overrides: list[str]) -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with ``overrides`` as Hydra does, then resolve every interpolation of the
    job's config (the hybrid plans' presets, the task's geometry).

    Hydra's two steps, kept apart so that commands choosing the same config groups compose them once: the defaults
    list with the group overrides (cached), then the value overrides applied by Hydra's own
    ``ConfigLoaderImpl._apply_overrides_to_config`` (unknown keys, ``+`` / ``~`` / ``++`` and merges exactly as the
    CLI). Hydra's own node is composed only where an override touches it."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException

    parsed = OverridesParser.create().parse_overrides(overrides)
    sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
    if sweeps:
        raise ConfigCompositionException(f"Ambiguous value for argument '{sweeps[0]}' (a sweep needs -m)")
    groups = tuple(o.input_line for o in parsed if is_group(o.key_or_group))
    values = [o for o in parsed if not is_group(o.key_or_group)]
    with_hydra = any(o.key_or_group.startswith("hydra") for o in parsed)
    cfg = compose_defaults(config_name, groups, with_hydra)
    if values or with_hydra:  # the cached config stays as composed
        cfg = copy.deepcopy(cfg)
    if with_hydra:
        OmegaConf.set_readonly(cfg.hydra, False)  # as Hydra leaves it for the overrides (set_config closes it)
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    hydra_node = cfg if with_hydra else compose_defaults(config_name, (), True)
    if HYDRA_CONFIG_SET[0] is not hydra_node:
        HydraConfig.instance().set_config(hydra_node)
        HYDRA_CONFIG_SET[0] = hydra_node
    for key in cfg:
        if key != "hydra":  # each top-level value resolved, ??? refused (eval.py's ckpt_path)
            value = cfg[key]
            if isinstance(value, DictConfig | ListConfig):
                OmegaConf.to_container(value, resolve=True, throw_on_missing=True)
    return cfg


def check_hydra_command(config_name: str, args: list[str]) -> None:
    """``train.py`` / ``eval.py`` / a Hydra module: Hydra's own flags parse, and the overrides compose and resolve
    (a ``-m`` sweep: each option of each swept group)."""
    from hydra._internal.utils import get_args_parser

    parsed = get_args_parser().parse_args(args)
    overrides = list(parsed.overrides or [])
    for job in sweep_jobs(overrides) if parsed.multirun else [overrides]:
        compose_resolved(config_name, job)


def check_pytest(args: list[str]) -> None:
    """The test files and folders a pytest command names exist."""
    paths = [a.split("::")[0] for a in args if a.endswith(".py") or "::" in a or a.startswith("tests")]
    assert all((ROOT / p).exists() for p in paths), f"no such test file in {args}"


def check_python(args: list[str], monkeypatch) -> None:
    if args[0] == "-c":
        compile(args[1], "<python -c>", "exec")
    elif args[0] in ("train.py", "eval.py"):
        check_hydra_command(args[0].removesuffix(".py"), args[1:])
    elif args[0] == "-m":
        check_module(args[1], args[2:], monkeypatch)
    else:
        raise AssertionError(f"no check for python {args[0]}: add one to tests/test_docs.py")


def check_module(module: str, args: list[str], monkeypatch) -> None:
    if module == "longseq.bench":
        check_hydra_command("bench", args)
    elif module == "longseq.bench.gpu":
        check_hydra_command("gpu_check", args)
    elif module == "longseq.report":
        from longseq.report.__main__ import parse_args

        parse_args(args)
    elif module == "longseq.report.recall_study":
        from longseq.report.recall_study import parse_args

        parse_args(args)
    elif module == "longseq.report.notebooks":
        from longseq.report.notebooks import main

        names = parses(main, args, monkeypatch).names
        assert all((ROOT / "notebooks" / f"{name}.ipynb").is_file() for name in names), names
    elif module == "longseq.bench.replot":
        from longseq.bench.replot import main

        results = parses(main, args, monkeypatch).results
        assert results.name == "PLACEHOLDER" or (ROOT / results).is_file(), f"no such file {results}"
    elif module == "pytest":
        check_pytest(args)
    else:
        raise AssertionError(f"no check for python -m {module}: add one to tests/test_docs.py")


MAKE_CONFIG = {"train": "train", "bench": "bench", "gpu-check": "gpu_check"}  # targets that pass ARGS to Hydra


def check_make(args: list[str], pending: bool = False) -> None:
    target, variables = args[0], dict(a.split("=", 1) for a in args[1:] if "=" in a)
    if pending:
        assert target not in makefile_targets(), f"make {target} exists now: drop its '(pending)' mark"
        return
    assert target in makefile_targets(), f"make {target}: no such target in the Makefile"
    assert set(variables) <= {"ARGS"}, f"make {target}: only ARGS passes options, got {sorted(variables)}"
    extra = shlex.split(variables.get("ARGS", ""))  # the recipe's shell splits $(ARGS) again
    if target in MAKE_CONFIG:
        check_hydra_command(MAKE_CONFIG[target], extra)
    elif target in ("test", "test-slow"):
        check_pytest(extra)
    else:
        assert not extra, f"make {target} takes no ARGS here, got {extra}"


def check_command(command: str, monkeypatch, pending: bool = False, inline: bool = False) -> None:
    """One documented shell command: its program exists here and its arguments compose or parse as that program
    would take them (``inline``: a span of prose, where ``python -m <module>`` alone names a program). Raises on the
    first problem."""
    tokens = shlex.split(PLACEHOLDER_VALUE.sub("PLACEHOLDER", command), comments=True)
    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):  # HYDRA_FULL_ERROR=1 python ...
        tokens = tokens[1:]
    program, args = tokens[0], tokens[1:]
    if program in PYTHONS and len(args) == 2 and args[0] == "-m" and args[1] != "pytest" and inline:
        assert importlib.util.find_spec(args[1]), f"no module {args[1]}"  # a program named in prose, not a command
    elif program == "make":
        check_make(args, pending)
    elif program in PYTHONS:
        check_python(args, monkeypatch)
    else:
        assert program in OTHER_PROGRAMS, f"no check for {program}: add one to tests/test_docs.py"


def failures(commands: list[tuple[str, bool, bool]], monkeypatch) -> list[str]:
    """The problems of ``(command, marked pending, inline)`` triples, one line each."""
    found = []
    for command, pending, inline in commands:
        try:
            check_command(command, monkeypatch, pending, inline)
        except BaseException as error:  # noqa: BLE001 - argparse exits with SystemExit; report them all at once
            found.append(f"{command}\n    -> {type(error).__name__}: {str(error).strip()[:300]}")
    return found


def test_every_command_of_readme_and_the_guides_composes_or_parses(monkeypatch):
    """Each command of a ```bash block and each inline ``python train.py`` / ``python -m longseq`` / ``make`` span of
    README and every guide composes (Hydra: every override, each option of a ``-m`` sweep's groups, interpolations
    resolved) or parses (the argparse tools), and each ``make`` target exists. A target written
    ``make <target>` (pending)`` must not exist yet. Composition only: nothing trains. One test over all pages, so
    a command or a choice of config groups that several pages share composes once."""
    pages: dict[tuple[str, bool, bool], list[str]] = {}
    for document in [README, *GUIDES]:
        text = document.read_text()
        commands = [(c, False, False) for c in shell_commands(text)] + [(c, p, True) for c, p in inline_commands(text)]
        assert commands, f"{document.name} shows no command"
        for command in commands:
            pages.setdefault(command, []).append(str(document.relative_to(ROOT)))
    found = [f"{', '.join(dict.fromkeys(pages[c]))}: {problem}"
             for c in pages for problem in failures([c], monkeypatch)]
    assert not found, "\n".join(found)


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown page (lower case, punctuation dropped, spaces to
    hyphens, ``-1``, ``-2`` for repeats)."""
    anchors, seen = set(), {}
    for line in without_fences(text).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if not heading:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).replace("`", "").lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(document: Path) -> list[str]:
    """Links of ``document`` whose file (relative to the document) or ``#anchor`` does not exist."""
    text = without_fences(document.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (document.parent / path).resolve() if path else document
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in github_anchors(file.read_text()):
            broken.append(f"{target}: no heading with that anchor")
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(document: Path):
    assert not broken_links(document), broken_links(document)


@pytest.mark.parametrize("document", [README, *GUIDES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_exists(document: Path):
    """A path written in backticks from the repository root (`conf/...`, `src/...`, `tests/...`) names a real file or
    folder, so moving a file without its docs fails here."""
    spans = re.findall(r"`([^`\s]+)`", without_fences(document.read_text()))
    missing = [s for s in spans if REPO_PATH.match(s) and not (ROOT / s).exists()]
    assert not missing, missing


def test_readme_is_a_front_page_that_links_every_page_of_docs():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in re.findall(r"\]\((docs/[^)\s]+)\)", text)}
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"README does not link {unlinked}"


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_every_guide_starts_with_its_commands(guide: Path):
    """A guide opens with its title, a line or two on what it covers, then its commands: the first ```bash block
    comes before the first section."""
    lines = guide.read_text().splitlines()
    assert lines[0].startswith("# ")
    first_block = next(n for n, line in enumerate(lines) if line.strip() == "```bash")
    first_section = next((n for n, line in enumerate(lines) if line.startswith("## ")), len(lines))
    assert first_block < min(first_section, 12), f"{guide.name}: commands at line {first_block + 1}"


def test_the_command_and_link_checks_fail_where_they_should(tmp_path, monkeypatch):
    """Each check refuses what it exists to refuse, so a passing run means something."""
    bad = ["python train.py attention=nope", "python train.py seed=1,2", "python train.py -m attention=full,nope",
           "python train.py model.nope=1", "python train.py '~model.nope'", "python train.py +seed=2",
           "python eval.py split=test", "make nope", "make train ARGS=\"task=nope\"", "make lint ARGS=\"-x\"",
           "python -m longseq.report.recall_study mqar --plan-all", "python -m longseq.report.notebooks nope",
           "python tools/unknown.py", "python -m longseq.bench attentions=[full] nope=1", "curl example.com",
           "python -m longseq.bench.replot docs/missing.csv", "python -m pytest tests/test_nope.py"]
    assert len(failures([(c, False, False) for c in bad], monkeypatch)) == len(bad)
    assert failures([("python -m longseq.nope", False, True)], monkeypatch)
    good = ["python train.py -m attention=sparse,combiner partition=fixed,logsparse,axial",
            "make bench ARGS=\"'attentions=[full,\\\"combiner_fixed:backend=explicit\\\"]'\"",
            "python eval.py ckpt_path=<run>/checkpoints/best.ckpt mode=sample",
            "HYDRA_FULL_ERROR=1 python train.py +recall/arm=combiner_fixed_full '~model.layer_attention' "
            "'+model.layer_attention=[full,full]'", "python train.py hydra.run.dir=/tmp/run",
            "python train.py hydra.run.dir=/tmp/run seed=3"]  # the second one on the cached, once-closed node
    assert not failures([(c, False, False) for c in good], monkeypatch)
    assert not failures([("python -m longseq.report", False, True)], monkeypatch)  # a program named in prose
    assert failures([("make train", True, True)], monkeypatch)  # exists: no longer pending
    assert not failures([("make nope", True, True)], monkeypatch)
    assert sweep_jobs(["attention=full,fixed,axial", "partition=fixed,axial", "seed=1,2", "c=0"]) == [
        ["attention=full", "partition=fixed", "seed=1", "c=0"], ["attention=fixed", "partition=axial", "seed=2", "c=0"],
        ["attention=axial", "partition=fixed", "seed=1", "c=0"]]
    assert shell_commands("```bash\n# note\nmake install && source x  # c\npython a \\\n  b\n```\n") == [
        "make install", "source x  # c", "python a    b"]
    assert inline_commands("run `make bench` or `make xla-check` (pending), not `python -c 1`") == [
        ("make bench", False), ("make xla-check", True)]
    page = tmp_path / "page.md"
    page.write_text("# A `b` c\n## A b c\n[x](#a-b-c-1) [y](#nope) [z](missing.md) [w](https://x.org/#q)\n")
    assert broken_links(page) == ["#nope: no heading with that anchor", "missing.md: no such file"]
