"""Prepare LRA data offline: ``python -m longseq.data.lra.prepare [--root data/lra] [options]``.

Writes locally GENERATED ListOps and Pathfinder in the released layout under ``--root`` (seeded; these are
not the released LRA splits, and results on them are not comparable to published numbers). IMDB and
CIFAR-10 cannot be generated; ``--download`` tries them (HF ``datasets`` / torchvision) and reports what
failed. The AAN retrieval pairs only come with the LRA release archive (``<root>/tsv_data/``).

Examples::

    python -m longseq.data.lra.prepare --root data/lra                          # ListOps + Pathfinder-32 inter
    python -m longseq.data.lra.prepare --root data/lra_small --only listops \\
        --listops-max-depth 4 --listops-min-length 20 --listops-max-length 200  # the CPU smoke ListOps
    python -m longseq.data.lra.prepare --only pathfinder --difficulties baseline inter hard --pathx
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from longseq.data.lra import listops, pathfinder

log = logging.getLogger("longseq.data.lra.prepare")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="data/lra", help="output folder (task.data.root)")
    parser.add_argument("--only", choices=["listops", "pathfinder"], help="prepare just one dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="regenerate even when the files exist")
    parser.add_argument("--listops-sizes", type=int, nargs=3, default=[96_000, 2_000, 2_000], metavar=("TRAIN", "VAL", "TEST"))
    parser.add_argument("--listops-max-depth", type=int, default=10)
    parser.add_argument("--listops-max-args", type=int, default=10)
    parser.add_argument("--listops-min-length", type=int, default=500, help="strict lower bound on tokens")
    parser.add_argument("--listops-max-length", type=int, default=2000, help="strict upper bound on tokens")
    parser.add_argument("--difficulties", nargs="+", default=["inter"], choices=sorted(pathfinder.DIFFICULTIES))
    parser.add_argument("--pathfinder-samples", type=int, default=200_000, help="images per difficulty")
    parser.add_argument("--pathx", action="store_true", help="also write pathfinder128 (Path-X) for the difficulties")
    parser.add_argument("--workers", type=int, default=1, help="processes for Pathfinder rendering")
    parser.add_argument("--download", action="store_true", help="also fetch IMDB (HF datasets) and CIFAR-10 (torchvision)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(args.root)

    if args.only in (None, "listops"):
        folder = root / "listops-1000"
        if args.force or not (folder / listops.SPLIT_FILES["test"]).is_file():
            start = time.time()
            n_train, n_val, n_test = args.listops_sizes
            listops.write_dataset(root, n_train, n_val, n_test, seed=args.seed, max_depth=args.listops_max_depth,
                                  max_args=args.listops_max_args, min_length=args.listops_min_length,
                                  max_length=args.listops_max_length)
            log.info(f"ListOps (generated, seed {args.seed}) -> {folder} in {time.time() - start:.0f} s")
        else:
            log.info(f"ListOps: {folder} exists (--force regenerates)")

    if args.only in (None, "pathfinder"):
        for resolution in [32, 128] if args.pathx else [32]:
            for difficulty in args.difficulties:
                folder = root / f"pathfinder{resolution}" / pathfinder.difficulty_dir(difficulty)
                if not args.force and (folder / "metadata").is_dir() and any((folder / "metadata").iterdir()):
                    log.info(f"Pathfinder: {folder} exists (--force regenerates)")
                    continue
                start = time.time()
                pathfinder.write_dataset(root, resolution, difficulty, n_samples=args.pathfinder_samples,
                                         seed=args.seed, workers=args.workers)
                log.info(f"Pathfinder-{resolution} {difficulty} (generated) -> {folder} in {time.time() - start:.0f} s")

    if args.download:
        download_real_datasets(root)


def download_real_datasets(root: Path) -> None:
    """Try IMDB and CIFAR-10 (the datasets LRA takes from TFDS); log what is missing instead of failing."""
    from longseq.data.cifar10 import Cifar10DataModule
    from longseq.data.lra.text import HUB_CONFIG, HUB_NAME
    from longseq.data.text import load_hf_split

    try:
        for split in ("train", "test"):
            load_hf_split(root / "imdb", HUB_NAME, HUB_CONFIG, split, root / "hf_cache")
        log.info("IMDB: available")
    except FileNotFoundError as err:
        log.warning(f"IMDB: {err}")
    try:
        Cifar10DataModule(data_dir=str(root.parent), batch_size=1).prepare_data()
        log.info(f"CIFAR-10: available under {root.parent / 'cifar10'}")
    except FileNotFoundError as err:
        log.warning(f"CIFAR-10: {err}")


if __name__ == "__main__":
    main()
