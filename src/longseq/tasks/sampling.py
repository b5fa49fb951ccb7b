"""Autoregressive generation shared by every task that samples: images (``DensityTask.sample``) and text
(``CausalLMTask.generate``, ``XLLanguageModel.generate``).

One loop, two ways to get the next logits:

- **cached** (default, ``sample.cache=true``): the backbone's incremental-decoding state
  (``Transformer.new_decoding_state`` / ``prefill`` / ``step``, one attention state per layer), so each new
  token costs one step per layer instead of a full forward;
- **recompute**: a full-length forward per token (the not-yet-generated positions hold zeros, which causal
  attention never shows to earlier positions, and every attention geometry sees the length it was built
  for). Used when asked (``sample.cache=false``) and as the fallback when the attention has no decoding state
  (``DecodingNotSupported``): one warning line names the variant.

Both give the same logits (tests: to 1e-9 in fp64), so a seeded generator gives the same samples. A
``rich`` progress bar with tokens/s is shown on request (``eval.py mode=sample``).
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from longseq.attention import DecodingNotSupported
from longseq.models.transformer import Transformer, check_positive_int, eval_mode
from longseq.utils.errors import ConfigError

log = logging.getLogger(__name__)
_WARNED: weakref.WeakSet = weakref.WeakSet()  # backbones whose recompute fallback was announced (once each)


def check_sampling(temperature: float, top_k: int | None = None, key: str = "sample") -> None:
    """``<key>.temperature`` must be a finite number >= 0 (0 = greedy) and ``<key>.top_k`` null or an integer >= 1."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < float("inf"):
        raise ConfigError(f"{key}.temperature", f"must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ConfigError(f"{key}.top_k", f"must be null (no cut) or an integer >= 1, got {top_k!r}")


def check_prompt_fraction(prompt_fraction: Any) -> float:
    """``sample.prompt_fraction``: the share of an image's rows given as the prompt, a number in [0, 1)."""
    if isinstance(prompt_fraction, bool) or not isinstance(prompt_fraction, (int, float)) or not 0 <= prompt_fraction < 1:
        raise ConfigError("sample.prompt_fraction", f"must be a number in [0, 1), got {prompt_fraction!r}")
    return float(prompt_fraction)


def check_sample_options(spec: Mapping[str, Any]) -> None:
    """Every ``sample.*`` knob of ``eval.py mode=sample``, whatever the checkpoint's task: an image task does not
    read ``tokens`` / ``top_k`` / ``prompt`` and an LM task not ``completions`` / ``k`` / ``prompt_fraction``, but a
    value that could never work is refused either way (before anything is generated or written)."""
    if spec.get("n") is not None:
        check_positive_int("sample.n", spec["n"])
    for key in ("k", "tokens"):
        if key in spec:
            check_positive_int(f"sample.{key}", spec[key])
    completions = spec.get("completions", 0)
    if isinstance(completions, bool) or not isinstance(completions, int) or completions < 0:
        raise ConfigError("sample.completions", f"must be an integer >= 0 (0: none), got {completions!r}")
    check_sampling(spec.get("temperature", 1.0), spec.get("top_k"))
    check_prompt_fraction(spec.get("prompt_fraction", 0.5))
    if not isinstance(spec.get("cache", True), bool):
        raise ConfigError("sample.cache", f"must be true or false, got {spec['cache']!r}")
    if "prompt" in spec and not isinstance(spec["prompt"], str):
        raise ConfigError("sample.prompt", f"must be a string (sample.prompt='The '), got {spec['prompt']!r}")


def check_can_sample(task_class: type) -> None:
    """``eval.py mode=sample`` needs a task that generates: an image density (``sample``) or a causal LM
    (``generate``); checked on the run's ``task.module._target_`` before anything is loaded."""
    if not (callable(getattr(task_class, "sample", None)) or callable(getattr(task_class, "generate", None))):
        raise ConfigError("mode", f"sample needs an image density or a causal LM task; {task_class.__name__} "
                                  "(task.module._target_ of the run) cannot generate: use mode=evaluate")


def pick_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids drawn from ``softmax(logits / temperature)`` restricted to the
    ``top_k`` most likely tokens (None: all); ``temperature = 0`` takes the most likely token."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp64 stays fp64 (exactness tests)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if temperature == 0:
        return logits.argmax(-1)
    probs = (logits / temperature).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


class TokensPerSecond(ProgressColumn):
    """Progress column: tokens generated per second (the task advances by the batch size per position)."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("-- tokens/s" if speed is None else f"{speed:,.0f} tokens/s", style="progress.data.speed")


def progress_bar(enabled: bool) -> Progress:
    """A ``rich`` progress bar with tokens/s (disabled: renders nothing)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TokensPerSecond(), disable=not enabled, transient=False)


class NextLogits(Protocol):
    """How the loop gets logits: ``start(context (B, T)) -> (B, V)`` at the context's last position (a fresh
    window), then ``feed(token (B,)) -> (B, V)`` for each appended token."""

    def start(self, context: torch.Tensor) -> torch.Tensor: ...

    def feed(self, token: torch.Tensor) -> torch.Tensor: ...


class CachedLogits:
    """Next logits through the backbone's decoding state: ``prefill`` the window, then one ``step`` per token."""

    def __init__(self, net: Transformer, batch_size: int) -> None:
        self.net, self.batch_size = net, batch_size
        self.state = net.new_decoding_state(batch_size)  # raises DecodingNotSupported before any work

    def start(self, context: torch.Tensor) -> torch.Tensor:
        if self.state.length:
            self.state = self.net.new_decoding_state(self.batch_size)
        return self.net.prefill(context, self.state)[:, -1]

    def feed(self, token: torch.Tensor) -> torch.Tensor:
        return self.net.step(token, self.state)


class RecomputedLogits:
    """Next logits by a full-length (``seq_len``) forward per token, the unfilled positions holding zeros."""

    def __init__(self, net: Transformer, batch_size: int, device: torch.device) -> None:
        self.net = net
        self.buffer = torch.zeros(batch_size, net.seq_len, dtype=torch.long, device=device)
        self.length = 0

    def start(self, context: torch.Tensor) -> torch.Tensor:
        self.buffer.zero_()
        self.length = context.shape[1]
        self.buffer[:, : self.length] = context
        return self.net(self.buffer)[:, self.length - 1]

    def feed(self, token: torch.Tensor) -> torch.Tensor:
        self.buffer[:, self.length] = token
        self.length += 1
        return self.net(self.buffer)[:, self.length - 1]


def next_logits_source(net: Transformer, batch_size: int, device: torch.device, cache: bool) -> NextLogits:
    """The cached source when ``cache`` and the attention decodes; else recompute (one warning line per model
    when the attention cannot decode, naming it: the message comes from ``DecodingNotSupported``)."""
    if cache:
        try:
            return CachedLogits(net, batch_size)
        except DecodingNotSupported as exc:
            if net not in _WARNED:  # once per model: a training run samples a grid every few epochs
                _WARNED.add(net)
                log.warning(f"sample.cache=true: {exc}")
    return RecomputedLogits(net, batch_size, device)


@torch.no_grad()
def autoregress(net: Transformer, inputs: torch.Tensor, n_new: int,
                choose: Callable[[torch.Tensor], torch.Tensor], *, cache: bool = True, progress: bool = False,
                description: str = "sampling") -> torch.Tensor:
    """Generate ``n_new`` tokens after the known ``inputs`` (B, P) (P >= 1) -> (B, n_new).

    ``choose`` maps (B, V) logits to (B,) tokens (e.g. ``pick_next``); each chosen token but the last is fed
    back. When the window (``net.seq_len``) is full, generation continues in a fresh window holding the most
    recent ``seq_len // 2`` tokens (text longer than the model's context). Runs ``net`` in eval mode.
    """
    batch, window = inputs.shape[0], net.seq_len
    keep = max(1, window // 2)
    with eval_mode(net), progress_bar(progress) as bar:
        task = bar.add_task(description, total=n_new * batch)
        source = next_logits_source(net, batch, inputs.device, cache)
        context = inputs[:, -window:]
        position = context.shape[1]
        logits = source.start(context)
        out = torch.empty(batch, n_new, dtype=torch.long, device=inputs.device)
        for i in range(n_new):
            out[:, i] = choose(logits)
            bar.advance(task, batch)
            if i == n_new - 1:
                break
            if position == window:  # a fresh window over the most recent tokens
                logits = source.start(torch.cat([inputs, out[:, : i + 1]], dim=1)[:, -keep:])
                position = keep
            else:
                logits = source.feed(out[:, i])
                position += 1
    return out


# ---------------------------------------------------------------------------------------------------------
# What `python eval.py mode=sample` writes (called by longseq.runner.sample)


def sample_out_dir(out_dir: str | None, run_dir: Path) -> Path:
    """Where ``eval.py mode=sample`` writes: ``<run_dir>/samples`` by default; a relative ``sample.out_dir``
    (``figs/``) lands inside the training run directory ``run_dir`` too, never in the directory ``eval.py``
    was started from (the repository root, where it would sit untracked); an absolute one is used as given."""
    if not out_dir:
        return Path(run_dir) / "samples"
    path = Path(str(out_dir)).expanduser()
    return path if path.is_absolute() else Path(run_dir) / path


def completion_prefix_length(image_shape: tuple[int, int, int], prompt_fraction: float) -> int:
    """Sub-pixels in the top ``prompt_fraction`` of an image's rows (whole rows: the completion figure of
    image-transformer papers); ``sample.prompt_fraction`` must leave at least one row to complete."""
    h, w, c = image_shape
    return min(h - 1, round(check_prompt_fraction(prompt_fraction) * h)) * w * c


def write_image_samples(module, datamodule, n: int, temperature: float, cache: bool, out_dir, generator,
                        completions: int, k: int, prompt_fraction: float, progress: bool = True) -> dict[str, str]:
    """Image tasks: ``samples.png`` (an ``n``-image grid, upscaled like the training grid), ``samples.npz``
    (``samples``: (n, H, W, C) uint8 levels) and ``completions.png`` (rows of [original | ``k`` completions]
    of the top ``prompt_fraction`` of the first ``completions`` test images). Returns the written paths by name."""
    import numpy as np
    from torchvision.utils import make_grid, save_image

    from longseq.callbacks.samples import image_grid, upscale
    from longseq.data.images import images_to_tokens

    written = {}
    images = module.sample(n, temperature, generator=generator, cache=cache, progress=progress).cpu()
    save_image(image_grid(images, module.num_levels), out_dir / "samples.png")
    np.savez_compressed(out_dir / "samples.npz", samples=images.numpy())
    written["samples.png"], written["samples.npz"] = str(out_dir / "samples.png"), str(out_dir / "samples.npz")
    if completions > 0 and k > 0:
        given = completion_prefix_length(module.image_shape, prompt_fraction)
        datamodule.prepare_data()
        originals = images_to_tokens(datamodule.load_split("test")[:completions])  # (N, L)
        prefix = originals[:, :given].repeat_interleave(k, dim=0)
        completed = module.sample(len(prefix), temperature, generator=generator, prefix=prefix, cache=cache,
                                  progress=progress).cpu()
        h, w, c = module.image_shape
        rows = torch.cat([originals.view(-1, 1, h, w, c).to(torch.uint8), completed.view(-1, k, h, w, c)], dim=1)
        levels = rows.flatten(0, 1).permute(0, 3, 1, 2).float() / max(1, module.num_levels - 1)
        save_image(upscale(make_grid(levels, nrow=k + 1, padding=1, pad_value=1.0)), out_dir / "completions.png")
        written["completions.png"] = str(out_dir / "completions.png")
    return written


def text_codec(module, datamodule) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """``(encode, decode)`` between text and the model's token ids for the LM tasks: bytes (enwik8 or any
    ``task.data.path`` file), text8's 27 characters, a word vocabulary (wikitext103), or the symbols of an
    imported Transformer-XL checkpoint (``task.module.init_from``)."""
    from longseq.data.text import TEXT8_ALPHABET, ByteCorpusDataModule, Text8DataModule

    symbols = getattr(module, "vocabulary", None)  # an imported XL checkpoint's own vocabulary
    if symbols is None and callable(getattr(datamodule, "vocabulary", None)):
        datamodule.prepare_data()
        symbols = datamodule.vocabulary()
    if symbols is not None and isinstance(datamodule, ByteCorpusDataModule):  # bytes spelled in decimal
        index = {s: i for i, s in enumerate(symbols)}

        def encode(text: str) -> list[int]:
            missing = sorted({b for b in text.encode() if str(b) not in index})
            if missing:
                raise ConfigError("sample.prompt", f"has bytes the checkpoint's vocabulary lacks: {missing[:10]}")
            return [index[str(b)] for b in text.encode()]

        return encode, lambda ids: bytes(int(symbols[i]) for i in ids).decode("utf-8", errors="replace")
    if symbols is not None:
        index = {s: i for i, s in enumerate(symbols)}
        unknown = index.get("<unk>")

        def encode_words(text: str) -> list[int]:
            words = text.split()
            if unknown is None and any(w not in index for w in words):
                raise ConfigError("sample.prompt", f"has words outside the vocabulary: "
                                                   f"{[w for w in words if w not in index][:10]}")
            return [index.get(w, unknown) for w in words]

        return encode_words, lambda ids: " ".join(symbols[i] for i in ids).replace(" <eos> ", "\n")
    if isinstance(datamodule, Text8DataModule):
        def encode_text8(text: str) -> list[int]:
            bad = sorted({ch for ch in text if ch not in TEXT8_ALPHABET})
            if bad:
                raise ConfigError("sample.prompt", f"text8 has only lower-case a-z and space; got {bad[:10]}")
            return [TEXT8_ALPHABET.index(ch) for ch in text]

        return encode_text8, lambda ids: "".join(TEXT8_ALPHABET[i] for i in ids)
    if isinstance(datamodule, ByteCorpusDataModule):
        return lambda text: list(text.encode()), lambda ids: bytes(ids).decode("utf-8", errors="replace")
    raise ConfigError("sample.prompt", f"text sampling needs a task whose tokens have symbols (enwik8, text8, "
                                       f"wikitext103); {type(datamodule).__name__} has none")


def write_text_samples(module, datamodule, prompt: str, n: int, tokens: int, temperature: float,
                       top_k: int | None, cache: bool, out_dir, generator, progress: bool = True) -> list[str]:
    """LM tasks: ``n`` continuations of ``prompt`` by ``tokens`` tokens, printed and saved to ``samples.txt``
    (Transformer-XL generates through its own memory). Returns the texts (prompt + continuation)."""
    from rich.console import Console

    check_positive_int("sample.tokens", tokens)
    encode, decode = text_codec(module, datamodule)
    ids = encode(prompt)
    if not ids:
        raise ConfigError("sample.prompt", "is empty; give the text to continue, e.g. sample.prompt='The '")
    batch = torch.tensor([ids] * n, dtype=torch.long)
    if hasattr(module, "net") and isinstance(module.net, Transformer):
        new = module.generate(batch, tokens, temperature, top_k, generator=generator, cache=cache, progress=progress)
    else:  # Transformer-XL: its own memory, no decoding-state choice
        new = module.generate(batch, tokens, temperature, top_k, generator=generator, progress=progress)
    texts = [prompt + decode(row.tolist()) for row in new.cpu()]
    console = Console(highlight=False)
    for i, text in enumerate(texts):
        console.rule(f"sample {i + 1} / {n}")
        print(text, flush=True)  # verbatim (rich would expand tabs and wrap)
    (out_dir / "samples.txt").write_text("\n\n".join(f"=== sample {i + 1} ===\n{t}" for i, t in enumerate(texts)) + "\n")
    return texts
