"""Execute the project's notebooks (``make notebooks``; the test suite runs them at small settings).

``python -m longseq.report.notebooks [name ...] [--out logs/notebooks] [--param 'key = value' ...]`` runs each
``notebooks/<name>.ipynb`` top to bottom with nbclient and writes the executed copy (with its outputs) to
``--out``; the stored notebooks stay without outputs. ``--param`` lines are injected after the cell tagged
``parameters`` (papermill's convention), so a notebook's defaults can be overridden from the command line
(``--param 'logs_dir = "elsewhere/logs"'``). Every notebook runs even when one fails (exit status 1 then); a
notebook whose input is missing (no sweep or checkpoint yet) says so in its output and passes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from traitlets.config import Config

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOK_DIR = ROOT / "notebooks"


def execute_notebook(path: str | Path, parameters: str = "", timeout: int = 600,
                     output: str | Path | None = None) -> nbformat.NotebookNode:
    """Run the notebook at ``path`` (cwd = its folder) with ``parameters`` injected; return the executed node.

    Raises ``nbclient.exceptions.CellExecutionError`` (naming the cell and the traceback) when a cell fails,
    and ``ValueError`` when ``parameters`` is given but the notebook has no ``parameters`` cell.
    """
    path = Path(path)
    book = nbformat.read(path, as_version=4)
    if parameters:
        tagged = [i for i, cell in enumerate(book.cells) if "parameters" in cell.metadata.get("tags", [])]
        if not tagged:
            raise ValueError(f"{path}: no cell tagged 'parameters' to inject {parameters!r} after")
        injected = nbformat.v4.new_code_cell(parameters)
        injected.metadata["tags"] = ["injected-parameters"]
        book.cells.insert(tagged[0] + 1, injected)
    with tempfile.TemporaryDirectory(prefix="longseq-kernel-") as sockets:
        # Local IPC sockets (files in a private folder) instead of TCP ports: the kernel's traffic never leaves this
        # machine, and ipykernel has nothing to warn about (over TCP it warns of plain-text traffic per notebook).
        config = Config({"KernelManager": {"transport": "ipc", "ip": str(Path(sockets) / "kernel")}})
        NotebookClient(book, timeout=timeout, kernel_name="python3", config=config,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(book, output)
    return book


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m longseq.report.notebooks", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebook names (default: every notebooks/*.ipynb)")
    parser.add_argument("--out", type=Path, default=ROOT / "logs" / "notebooks", help="folder for the executed copies")
    parser.add_argument("--param", action="append", default=[], help="a Python line injected after the parameters cell")
    args = parser.parse_args(argv)
    names = args.names or sorted(p.stem for p in NOTEBOOK_DIR.glob("*.ipynb"))
    paths = [NOTEBOOK_DIR / f"{name}.ipynb" for name in names]
    for path in paths:
        if not path.is_file():
            print(f"no notebook {path}; available: {', '.join(p.stem for p in NOTEBOOK_DIR.glob('*.ipynb'))}",
                  file=sys.stderr)
            return 2
    failed = []
    for path in paths:  # one failing notebook does not stop the others; each says itself when its input is missing
        try:
            execute_notebook(path, "\n".join(args.param), output=args.out / path.name)
        except CellExecutionError as error:
            failed.append(path.stem)
            last = [line for line in str(error).strip().splitlines() if line.strip()][-1:]
            print(f"error: {path.relative_to(ROOT)}: a cell failed: {' '.join(last)}", file=sys.stderr)
            continue
        print(f"executed {path.relative_to(ROOT)} -> {args.out / path.name}")
    if failed:
        print(f"{len(failed)} of {len(paths)} notebooks failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
