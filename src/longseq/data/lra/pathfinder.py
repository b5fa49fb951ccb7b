"""Pathfinder (32x32) and Path-X (128x128): are the two circle markers connected by one dashed path?

Released format (``<root>/pathfinder<res>/<difficulty>/``): PNG images under ``imgs/<k>/sample_<i>.png`` and
plain-text metadata files ``metadata/<k>.npy`` (the extension is misleading), one line per image:
``<subdir> <filename> <img_idx> <label> <continuity> <contour_len> <distractor_len> <paddle_len>
<paddle_thickness> <paddle_margin> <n_contrasts>``; the image is ``<difficulty>/<subdir>/<filename>``. Split
80 / 10 / 10 % over the metadata lines in file order (metadata files sorted numerically). The known empty
image ``pathfinder32/curv_baseline/imgs/0/sample_172.png`` (and any zero-byte file) is skipped.

The generator (reference §1.5; a simplified re-implementation of ``snakes2.py``, NOT the released split):
two target "snakes" (chains of short paddles with bounded turning) grown from seeds ``seed_distance`` apart,
distractor snakes, all kept disjoint on an occupancy grid, rendered with PIL at ``antialias`` x resolution
and downsampled. Markers sit on the two ends of the same target snake (label 1) or on one end of each target
snake (label 0). The scene is drawn before the label is used, so a positive and a negative example from the
same random state differ only in where the markers go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from longseq.data.lra.common import Examples, LraDataModule
from longseq.utils.errors import ConfigError, DataError

DIFFICULTIES = {"baseline": "curv_baseline", "inter": "curv_contour_length_9", "hard": "curv_contour_length_14"}
CONTOUR_LENGTHS = {"curv_baseline": 6, "curv_contour_length_9": 9, "curv_contour_length_14": 14}
KNOWN_EMPTY = {("pathfinder32", "curv_baseline", "imgs/0/sample_172.png")}
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)


def difficulty_dir(difficulty: str) -> str:
    """``baseline`` / ``inter`` / ``hard`` or a release directory name -> the directory name."""
    if difficulty in DIFFICULTIES:
        return DIFFICULTIES[difficulty]
    if difficulty in DIFFICULTIES.values():
        return difficulty
    raise ConfigError("task.difficulty", f"{difficulty!r} is not valid; choose one of {sorted(DIFFICULTIES)} "
                                         f"(or {sorted(DIFFICULTIES.values())})")


# ----------------------------------------------------------------------------------------------------
# Loader


class MetadataLine(list):
    """The whitespace-split fields of one metadata line, with where it came from (``path``, 1-based ``line``)."""

    path: Path
    line: int


def metadata_lines(folder: Path) -> list[MetadataLine]:
    """Every metadata line (split into fields) of ``folder/metadata/*.npy``, files in numeric order.

    A line needs ``<subdir> <filename> <img_idx> <label>`` with a 0/1 label; anything else is a ``DataError``
    naming the file and line.
    """
    files = sorted(folder.glob("metadata/*.npy"), key=lambda p: (int(p.stem) if p.stem.isdigit() else 1 << 62, p.stem))
    lines = []
    for path in files:
        for line_no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            fields = MetadataLine(line.split())
            if not fields:
                continue
            if len(fields) < 4:
                raise DataError(path, f"a metadata line needs at least 4 fields (subdir filename index label), got "
                                      f"{len(fields)}: {line!r}", line=line_no)
            if fields[3] not in ("0", "1"):
                raise DataError(path, f"the label (4th field) must be 0 or 1, got {fields[3]!r}", line=line_no)
            fields.path, fields.line = path, line_no
            lines.append(fields)
    if not lines:
        raise DataError(folder / "metadata", "holds no metadata lines (no *.npy files, or only empty ones)")
    return lines


def split_slice(n: int, split: str) -> slice:
    """The ``split`` part of ``n`` items cut 80 / 10 / 10 % in order (each part non-empty when n >= 3)."""
    n_val = max(1, round(n * SPLIT_FRACTIONS[1])) if n >= 3 else 0
    n_test = max(1, round(n * SPLIT_FRACTIONS[2])) if n >= 3 else 0
    n_train = n - n_val - n_test
    return {"train": slice(0, n_train), "val": slice(n_train, n_train + n_val), "test": slice(n_train + n_val, n)}[split]


class LraPathfinderDataModule(LraDataModule):
    """Pathfinder images as ``resolution**2`` pixel tokens (0..255, raster order), 2 classes, no padding.

    Args (beyond ``LraDataModule``'s): ``resolution`` 32 (Pathfinder) or 128 (Path-X); ``difficulty``
    baseline / inter / hard (``curv_baseline`` / ``curv_contour_length_9`` / ``curv_contour_length_14``).
    """

    num_classes = 2
    vocab_size = 256

    def __init__(self, *args, resolution: int = 32, difficulty: str = "inter", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.resolution = int(resolution)
        self.difficulty = difficulty_dir(difficulty)
        self._lines: list[list[str]] | None = None

    @property
    def folder(self) -> Path:
        return self.root / f"pathfinder{self.resolution}" / self.difficulty

    def split_source(self, split: str) -> Path:
        return self.folder / "metadata"

    def check_data(self) -> None:
        """The metadata folder of the chosen resolution and difficulty is on disk (the images it lists are checked
        as they are read)."""
        if not (self.folder / "metadata").is_dir():
            raise self.missing(self.folder / "metadata", f"Pathfinder-{self.resolution} ({self.difficulty})")

    def load_split(self, split: str) -> Examples:
        if self._lines is None:
            self.check_data()
            self._lines = metadata_lines(self.folder)
        lines = self._lines[split_slice(len(self._lines), split)]
        images, labels = [], []
        for fields in lines:
            relative = f"{fields[0]}/{fields[1]}"
            path = self.folder / relative
            if (f"pathfinder{self.resolution}", self.difficulty, relative) in KNOWN_EMPTY:
                continue
            if not path.is_file():
                raise DataError(fields.path, f"names the image {path}, which does not exist", line=fields.line)
            if path.stat().st_size == 0:  # any zero-byte image is skipped like the known one (module docstring)
                continue
            try:
                with Image.open(path) as img:
                    pixels = np.asarray(img.convert("L"), dtype=np.uint8)
            except (OSError, SyntaxError) as err:  # PIL: UnidentifiedImageError, truncated file
                raise DataError(path, f"is not a readable image ({err}); listed at {fields.path}:{fields.line}") from None
            if pixels.shape != (self.resolution, self.resolution):
                raise DataError(path, f"image is {pixels.shape}, expected {self.resolution}x{self.resolution}")
            images.append(pixels.reshape(-1))
            labels.append(int(fields[3]))
            if self.limit is not None and len(images) >= self.limit:
                break
        return Examples([images], np.array(labels, dtype=np.int64))


# ----------------------------------------------------------------------------------------------------
# Generator


@dataclass(frozen=True)
class PathfinderSpec:
    """Geometry in output pixels (the renderer scales by ``antialias``); defaults = LRA's Pathfinder-32.

    ``continuity`` bounds the turn between consecutive paddles: a uniform angle in
    ``[-continuity, continuity] * pi / 4`` (the original's curvature control, re-parameterised).
    """

    resolution: int = 32
    contour_length: int = 9
    paddle_length: float = 2.0
    paddle_margin: float = 1.0
    paddle_thickness: float = 0.5
    marker_radius: float = 1.5
    seed_distance: float = 7.0
    continuity: float = 1.0
    padding: float = 1.0
    antialias: int = 2
    num_distractor_snakes: int | None = None  # default: 20 // distractor_length
    distractor_length: int | None = None  # default: contour_length // 3

    @property
    def n_distractors(self) -> int:
        return self.num_distractor_snakes if self.num_distractor_snakes is not None else 20 // self.d_length

    @property
    def d_length(self) -> int:
        return self.distractor_length if self.distractor_length is not None else max(1, self.contour_length // 3)

    @classmethod
    def for_release(cls, resolution: int, difficulty: str) -> PathfinderSpec:
        """LRA's settings for pathfinder32 / pathfinder128 (Path-X) at a difficulty."""
        contour = CONTOUR_LENGTHS[difficulty_dir(difficulty)]
        if resolution == 32:
            return cls(resolution=32, contour_length=contour)
        if resolution == 128:
            d_length = max(1, contour // 3)
            return cls(resolution=128, contour_length=contour, paddle_length=5.0, paddle_margin=3.0,
                       paddle_thickness=1.5, marker_radius=3.0, seed_distance=20.0, continuity=1.8,
                       padding=3.0, num_distractor_snakes=35 // d_length)
        raise ValueError(f"resolution {resolution} has no release settings; use 32 or 128")


@dataclass
class Scene:
    """Target snakes A and B and the distractors: each a (paddles, 2, 2) array of segment end points."""

    targets: list[np.ndarray]
    distractors: list[np.ndarray] = field(default_factory=list)


class Occupancy:
    """A boolean grid marking where strokes (plus a clearance) already are, so snakes stay disjoint.

    The grid has a border of width ``clearance`` so that cell look-ups near the frame need no clipping.
    """

    def __init__(self, size: int, clearance: float, samples_per_segment: int) -> None:
        r = int(np.ceil(clearance))
        self.grid = np.zeros((size + 2 * r + 1, size + 2 * r + 1), dtype=bool)
        offsets = np.stack(np.meshgrid(np.arange(-r, r + 1), np.arange(-r, r + 1)), -1).reshape(-1, 2)
        self.offsets = offsets[np.linalg.norm(offsets, axis=1) <= clearance + 1e-9] + r  # shifted into the border
        self.fractions = np.linspace(0.0, 1.0, samples_per_segment)[:, None]

    def cells(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Grid cells within ``clearance`` of segment a-b (points sampled about every pixel)."""
        points = (a + self.fractions * (b - a)).astype(np.intp)
        cells = (points[:, None, :] + self.offsets[None]).reshape(-1, 2)
        return cells[:, 1], cells[:, 0]

    def free(self, a: np.ndarray, b: np.ndarray) -> bool:
        return not self.grid[self.cells(a, b)].any()

    def mark(self, a: np.ndarray, b: np.ndarray) -> None:
        self.grid[self.cells(a, b)] = True


def grow_snake(rng: np.random.Generator, spec: PathfinderSpec, occupancy: Occupancy, n_paddles: int,
               start: np.ndarray | None = None, tries: int = 20) -> np.ndarray | None:
    """A chain of ``n_paddles`` paddles (in canvas pixels) that stays inside the frame and off occupied cells.

    Returns (n_paddles, 2, 2) segment end points, or None when no placement was found in ``tries``.
    """
    scale = spec.antialias
    size = spec.resolution * scale
    lo, hi = (spec.padding + spec.marker_radius) * scale, size - (spec.padding + spec.marker_radius) * scale
    length, margin = spec.paddle_length * scale, spec.paddle_margin * scale
    max_turn = spec.continuity * math.pi / 4
    for _ in range(tries):
        point = start.copy() if start is not None else rng.uniform(lo, hi, size=2)
        angle = rng.uniform(0, 2 * math.pi)
        paddles = []
        for _ in range(n_paddles):
            for _ in range(8):  # a few turns tried at each step before giving up on this snake
                direction = np.array([math.cos(angle), math.sin(angle)])
                end = point + length * direction
                if lo <= end[0] <= hi and lo <= end[1] <= hi and occupancy.free(point, end):
                    break
                angle += rng.uniform(-max_turn, max_turn)
            else:
                break
            paddles.append((point.copy(), end))
            point = end + margin * direction
            angle += rng.uniform(-max_turn, max_turn)
        if len(paddles) == n_paddles:
            snake = np.array(paddles)
            for a, b in snake:
                occupancy.mark(a, b)
            return snake
    return None


def sample_scene(rng: np.random.Generator, spec: PathfinderSpec) -> Scene:
    """Two disjoint target snakes from seeds ``seed_distance`` apart, then as many distractors as fit."""
    scale = spec.antialias
    size = spec.resolution * scale
    clearance = (spec.paddle_thickness / 2 + spec.paddle_margin / 2 + 0.5) * scale
    while True:
        occupancy = Occupancy(size, clearance, samples_per_segment=int(spec.paddle_length * scale) + 2)
        lo = (spec.padding + spec.marker_radius) * scale
        seed_a = rng.uniform(lo, size - lo, size=2)
        angle = rng.uniform(0, 2 * math.pi)
        seed_b = seed_a + spec.seed_distance * scale * np.array([math.cos(angle), math.sin(angle)])
        if not ((lo <= seed_b).all() and (seed_b <= size - lo).all()):
            continue
        snake_a = grow_snake(rng, spec, occupancy, spec.contour_length, start=seed_a)
        snake_b = grow_snake(rng, spec, occupancy, spec.contour_length, start=seed_b) if snake_a is not None else None
        if snake_a is None or snake_b is None:
            continue
        scene = Scene(targets=[snake_a, snake_b])
        for _ in range(spec.n_distractors):
            snake = grow_snake(rng, spec, occupancy, spec.d_length, tries=5)
            if snake is not None:
                scene.distractors.append(snake)
        return scene


def snake_ends(snake: np.ndarray) -> np.ndarray:
    """(2, 2): the first paddle's start and the last paddle's end."""
    return np.stack([snake[0, 0], snake[-1, 1]])


def marker_positions(scene: Scene, label: int, end_a: int, end_b: int) -> np.ndarray:
    """(2, 2) marker centres: label 1 -> both ends of snake A; label 0 -> one end of A and one end of B."""
    ends_a, ends_b = snake_ends(scene.targets[0]), snake_ends(scene.targets[1])
    return np.stack([ends_a[end_a], ends_a[1 - end_a] if label else ends_b[end_b]])


def render(scene: Scene, markers: np.ndarray, spec: PathfinderSpec) -> np.ndarray:
    """(resolution, resolution) uint8 image: white strokes and markers on black, drawn at ``antialias`` x and
    box-downsampled."""
    scale = spec.antialias
    size = spec.resolution * scale
    canvas = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(canvas)
    width = max(1, round(spec.paddle_thickness * scale))
    for snake in [*scene.targets, *scene.distractors]:
        for a, b in snake:
            draw.line([tuple(a), tuple(b)], fill=255, width=width)
    r = spec.marker_radius * scale
    for x, y in markers:
        draw.ellipse([x - r, y - r, x + r, y + r], fill=255)
    small = canvas.resize((spec.resolution, spec.resolution), Image.BOX)
    return np.asarray(small, dtype=np.uint8)


def generate_example(rng: np.random.Generator, spec: PathfinderSpec, label: int | None = None
                     ) -> tuple[np.ndarray, int, Scene, np.ndarray]:
    """(image, label, scene, markers). The label ~ Bernoulli(0.5) is drawn first and the marker ends right
    after it, so the random stream (hence the scene) does not depend on the label; ``label`` forces it."""
    drawn = int(rng.random() < 0.5)
    end_a, end_b = (int(e) for e in rng.integers(0, 2, size=2))
    label = drawn if label is None else int(label)
    scene = sample_scene(rng, spec)
    markers = marker_positions(scene, label, end_a, end_b)
    return render(scene, markers, spec), label, scene, markers


def write_metadata_file(folder: Path, k: int, n: int, spec: PathfinderSpec, seed: int) -> None:
    """Images ``imgs/<k>/sample_<i>.png`` (i < n) and ``metadata/<k>.npy``; seeded by ``(seed, k)`` so files
    can be written in any order or in parallel and still come out the same."""
    rng = np.random.default_rng([seed, k])
    (folder / "imgs" / str(k)).mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        image, label, _, _ = generate_example(rng, spec)
        Image.fromarray(image).save(folder / "imgs" / str(k) / f"sample_{i}.png")
        lines.append(f"imgs/{k} sample_{i}.png {i} {label} {spec.continuity} {spec.contour_length} "
                     f"{spec.d_length} {spec.paddle_length} {spec.paddle_thickness} {spec.paddle_margin} 1")
    (folder / "metadata" / f"{k}.npy").write_text("\n".join(lines) + "\n")


def write_dataset(root: Path, resolution: int = 32, difficulty: str = "inter", n_samples: int = 200_000,
                  per_file: int = 1000, seed: int = 0, spec: PathfinderSpec | None = None, workers: int = 1) -> Path:
    """Write ``<root>/pathfinder<res>/<difficulty dir>/{imgs/<k>/sample_<i>.png, metadata/<k>.npy}``."""
    folder = Path(root) / f"pathfinder{resolution}" / difficulty_dir(difficulty)
    spec = spec or PathfinderSpec.for_release(resolution, difficulty)
    (folder / "metadata").mkdir(parents=True, exist_ok=True)
    jobs = [(folder, k, min(per_file, n_samples - k * per_file), spec, seed) for k in range(math.ceil(n_samples / per_file))]
    if workers > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            pool.starmap(write_metadata_file, jobs)
    else:
        for job in jobs:
            write_metadata_file(*job)
    return folder
