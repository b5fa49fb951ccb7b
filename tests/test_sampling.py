"""Incremental decoding above the attention (issue 16): the backbone's decoding state reproduces ``forward``'s
logits, seeded sampling is identical with and without the cache, and attentions without a decoding state
fall back to recompute with a message naming them.

Parametrized over the registry by ``supports_decoding`` (a new decoding variant is tested automatically).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ROOT, compose_config, fast_variants_first
from PIL import Image

from longseq.attention import ATTENTION_REGISTRY
from longseq.bench.specs import GENERIC_NAMES, build_spec
from longseq.models.transformer import Transformer
from longseq.runner import sample, train
from longseq.tasks.density import DensityTask
from longseq.tasks.lm import CausalLMTask
from longseq.tasks.sampling import autoregress, pick_next

L, BLOCK, HEADS, HEAD_DIM = 64, 8, 2, 8  # an 8 x 8 grid: every Combiner region structure is non-trivial
IMAGE = (8, 8, 1)
LEVELS = 5


def registry_decoders() -> list[str]:
    return sorted(name for name, factory in ATTENTION_REGISTRY.items()
                  if name not in GENERIC_NAMES and factory.cls.supports_causal
                  and getattr(factory.cls, "supports_decoding", False))


# Every registered attention that decodes (a new decoding variant is tested automatically).
DECODERS = registry_decoders()


def attention_config(name: str, length: int = L, block: int = BLOCK) -> dict:
    """``{"name": ..., **knobs}`` as training resolves conf/attention/<name>.yaml (default L = 64, block 8)."""
    spec = build_spec(name, length, causal=True, n_heads=HEADS, head_dim=HEAD_DIM, block_size=block)
    knobs = {k: v for k, v in spec.kwargs.items() if k not in {"seq_len", "n_heads", "head_dim", "dropout"}}
    return {"name": name, **knobs}


def tiny_model(name: str, pos_emb: str = "image", seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    net = Transformer(vocab_size=LEVELS + 1, seq_len=L, n_layers=2, d_model=HEADS * HEAD_DIM, n_heads=HEADS,
                      attention=attention_config(name), dropout=0.1, attn_dropout=0.1, pos_emb=pos_emb,
                      image_shape=IMAGE, out_dim=LEVELS)
    return net.double().eval()


def tiny_density_task(name: str, image: tuple[int, int, int] = IMAGE, seed: int = 0) -> DensityTask:
    torch.manual_seed(seed)
    task = DensityTask(model={"n_layers": 2, "d_model": HEADS * HEAD_DIM, "n_heads": HEADS, "pos_emb": "image"},
                       attention=attention_config(name, image[0] * image[1] * image[2], image[1]), optimizer={},
                       scheduler=None, num_levels=LEVELS, image_shape=image)
    return task.double()


# One pass per decoder (the attention-level tests check every variant position by position): a prefill of 5
# tokens, then steps across every block boundary. Positions are the backbone's business: `full` also decodes
# with learned positions from a single token, and prefills the whole sequence at once.
@pytest.mark.parametrize("name,pos_emb,prefix", [(name, "image", 5) for name in DECODERS]
                         + [("full", "learned", 1), ("full", "image", L)])
def test_decoding_state_reproduces_forward_logits(name: str, pos_emb: str, prefix: int) -> None:
    net = tiny_model(name, pos_emb)
    tokens = torch.randint(0, LEVELS + 1, (2, L), generator=torch.Generator().manual_seed(1))
    expected = net(tokens)  # (B, L, V)
    state = net.new_decoding_state(2)
    logits = [net.prefill(tokens[:, :prefix], state)]
    logits += [net.step(tokens[:, t], state)[:, None] for t in range(prefix, L)]
    assert state.length == L
    torch.testing.assert_close(torch.cat(logits, dim=1), expected, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", DECODERS)
def test_decoding_is_dropout_free_even_in_training_mode(name: str) -> None:
    net = tiny_model(name)
    tokens = torch.randint(0, LEVELS + 1, (2, 12), generator=torch.Generator().manual_seed(2))
    expected = net(tokens.new_zeros(2, L).index_copy_(1, torch.arange(12), tokens))[:, :12]
    net.train()
    state = net.new_decoding_state(2)
    torch.testing.assert_close(net.prefill(tokens, state), expected, rtol=0, atol=1e-9)
    assert net.training  # the model's mode is restored


def test_decoding_past_max_len_is_refused() -> None:
    net = tiny_model("full")
    state = net.new_decoding_state(1, max_len=4)
    net.prefill(torch.zeros(1, 4, dtype=torch.long), state)
    with pytest.raises(ValueError, match="max_len=4"):
        net.step(torch.zeros(1, dtype=torch.long), state)
    with pytest.raises(ValueError, match="task.seq_len=64"):
        net.new_decoding_state(1, max_len=L + 1)


@pytest.mark.parametrize("name", fast_variants_first(DECODERS))  # every decoder's logits: test_decoding.py
def test_seeded_sampling_is_identical_with_and_without_the_cache(name: str) -> None:
    task = tiny_density_task(name)
    cached = task.sample(3, generator=torch.Generator().manual_seed(7), cache=True)
    recomputed = task.sample(3, generator=torch.Generator().manual_seed(7), cache=False)
    assert cached.shape == (3, *IMAGE) and cached.dtype == torch.uint8 and int(cached.max()) < LEVELS
    assert torch.equal(cached, recomputed)
    assert len({tuple(img.flatten().tolist()) for img in cached}) > 1  # real samples, not one constant image


def test_completion_keeps_the_prefix_and_matches_recompute() -> None:
    task = tiny_density_task("full")
    prefix = torch.randint(0, LEVELS, (2, L // 2), generator=torch.Generator().manual_seed(3))
    cached = task.sample(2, generator=torch.Generator().manual_seed(4), prefix=prefix, cache=True)
    recomputed = task.sample(2, generator=torch.Generator().manual_seed(4), prefix=prefix, cache=False)
    assert torch.equal(cached.view(2, -1)[:, : L // 2], prefix.to(torch.uint8))
    assert torch.equal(cached, recomputed)


def non_decoding_causal_variant() -> str:
    """A registered causal attention without a decoding state (the fallback path)."""
    for name, factory in sorted(ATTENTION_REGISTRY.items()):
        cls = factory.cls
        if name not in GENERIC_NAMES and cls.supports_causal and not getattr(cls, "supports_decoding", False):
            return name
    raise AssertionError("every causal attention decodes: pick another fallback example")


def test_attention_without_decoding_falls_back_to_recompute_naming_it(caplog) -> None:
    name = non_decoding_causal_variant()
    task = tiny_density_task(name, image=(4, 4, 1))  # recompute: a full forward per sub-pixel
    with caplog.at_level(logging.WARNING, logger="longseq.tasks.sampling"):
        fallback = task.sample(2, generator=torch.Generator().manual_seed(5), cache=True)
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"'{name}'" in message
    assert "falls back to recompute" in message.replace("recomputing", "recompute")
    assert torch.equal(fallback, task.sample(2, generator=torch.Generator().manual_seed(5), cache=False))
    caplog.clear()
    task.sample(1, cache=True)  # a training run samples a grid every few epochs: one warning per model
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_text_generation_past_the_window_slides_identically_with_and_without_cache() -> None:
    torch.manual_seed(0)
    task = CausalLMTask(model={"n_layers": 2, "d_model": HEADS * HEAD_DIM, "n_heads": HEADS},
                        attention=attention_config("full"), optimizer={}, scheduler=None, vocab_size=11, seq_len=L)
    task.double()
    prompt = torch.randint(0, 11, (2, 10), generator=torch.Generator().manual_seed(6))

    def generate(cache: bool) -> torch.Tensor:
        gen = torch.Generator().manual_seed(8)
        return autoregress(task.net, prompt, 2 * L, lambda logits: pick_next(logits, 0.8, 5, gen), cache=cache)

    cached = generate(True)
    assert cached.shape == (2, 2 * L) and int(cached.max()) < 11
    assert torch.equal(cached, generate(False))


def test_pick_next_top_k_and_greedy() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]]).repeat(200, 1)
    draws = pick_next(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {1, 3}
    assert pick_next(logits[:1], 0.0).tolist() == [1]


def test_transformer_xl_generates_through_its_memory() -> None:
    """With a memory long enough to hold everything, XL's one-token segments over carried memory give the
    same greedy continuation as re-running the whole sequence with no memory (the memory is exact)."""
    from longseq.tasks.xl_lm import XLLanguageModel

    torch.manual_seed(0)
    memory = {"mem_len": 64, "mem_init": "empty", "eval_mem_len": 64, "eval_same_length": False,
              "eval_clamp_len": -1, "selection": "none"}
    model = {"n_layers": 2, "d_model": 16, "n_heads": 2, "d_inner": 32, "dropout": 0.1, "tgt_len": 8,
             "same_length": False, "clamp_len": -1, "cutoffs": []}
    task = XLLanguageModel(model=model, attention={"name": "full", "causal": True}, optimizer={}, scheduler=None,
                           memory=memory, vocab_size=13).double()
    prompt = torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(1))
    greedy = task.generate(prompt, 12, temperature=0)
    sequence = prompt
    task.net.eval()
    for _ in range(12):  # reference: the whole sequence as one segment, no memory
        hidden, _ = task.net(sequence, None, task.eval_specs["xl"])
        sequence = torch.cat([sequence, task.net.output.log_prob(hidden[:, -1]).argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, sequence[:, 5:])
    sampled = task.generate(prompt, 12, temperature=1.0, top_k=4, generator=torch.Generator().manual_seed(2))
    assert sampled.shape == (2, 12) and int(sampled.max()) < 13


# ------------------------------------------------------------------------------- eval.py mode=sample


def cli(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "eval.py", *args], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.slow  # ~30 s: CLI train + sample; the fast set samples a byte LM
def test_eval_mode_sample_on_digits_writes_grid_npz_and_completions(tmp_path: Path) -> None:
    metrics = train(compose_config(["trainer.max_steps=2", "test=false", "callbacks.samples.n_samples=0"],
                                   tmp_path / "run"))
    ckpt = metrics.get("ckpt_path") or str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    out = tmp_path / "figures"
    done = cli([f"ckpt_path={ckpt}", "mode=sample", "sample.n=4", "sample.completions=3", "sample.k=2",
                f"sample.out_dir={out}", "seed=1", f"hydra.run.dir={tmp_path / 'eval'}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"samples.png: {out / 'samples.png'}" in done.stdout and "tokens/s" in done.stdout
    levels = np.load(out / "samples.npz")
    assert list(levels) == ["samples"]  # one array: the raw levels
    assert levels["samples"].shape == (4, 8, 8, 1) and levels["samples"].dtype == np.uint8
    assert int(levels["samples"].max()) < 17
    # 2 x 2 grid of 8x8 with 1-pixel padding (19 px), upscaled 27x (nearest neighbour) to >= 512 px
    assert Image.open(out / "samples.png").size == (27 * (2 * 9 + 1),) * 2
    # 3 rows of [original | 2 completions] of the test images' top half: 28 px, upscaled 19x
    assert Image.open(out / "completions.png").size == (19 * (3 * 9 + 1),) * 2

    # the default folder is <run>/samples/, and the same seed gives the same samples with and without the cache
    ecfg = compose_config([f"ckpt_path={ckpt}", "mode=sample", "sample.n=3", "sample.completions=0",
                           "sample.cache=false", "seed=1"], tmp_path / "eval2", config_name="eval")
    written = sample(ecfg)
    assert written == {"samples.png": str(tmp_path / "run" / "samples" / "samples.png"),
                       "samples.npz": str(tmp_path / "run" / "samples" / "samples.npz")}
    recomputed = np.load(written["samples.npz"])["samples"]
    # a relative sample.out_dir lands inside the training run directory, not where eval.py was started
    ecfg.sample.cache = True
    ecfg.sample.out_dir = "figs/"
    assert sample(ecfg)["samples.npz"] == str(tmp_path / "run" / "figs" / "samples.npz")
    assert np.array_equal(np.load(tmp_path / "run" / "figs" / "samples.npz")["samples"], recomputed)
    assert not (ROOT / "figs").exists()


@pytest.mark.parametrize("model", [[], ["model=transformer_xl", "model.tgt_len=16", "memory.mem_len=16"]],
                         ids=["transformer", "transformer_xl"])
def test_eval_mode_sample_on_a_byte_lm_prints_the_continuation(model: list[str], tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the cat sat on the mat. " * 400)
    metrics = train(compose_config(["task=enwik8", f"task.data.path={corpus}", "task.seq_len=32", "task.batch_size=4",
                                    "trainer.max_steps=2", "test=false", *model], tmp_path / "run"))
    ckpt = metrics.get("ckpt_path") or str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    ecfg = compose_config([f"ckpt_path={ckpt}", "mode=sample", "sample.prompt='the cat '", "sample.tokens=40",
                           "sample.n=2", "sample.top_k=5", f"sample.out_dir={tmp_path / 'text'}"],
                          tmp_path / "eval", config_name="eval")
    capsys.readouterr()
    written = sample(ecfg)
    printed = capsys.readouterr().out
    saved = Path(written["samples.txt"]).read_text()
    assert saved.count("the cat ") >= 2 and "sample 2 / 2" in printed
    continuations = [block.split("\n", 1)[1] for block in saved.split("=== sample ")[1:]]
    assert all(text.startswith("the cat ") and len(text.rstrip("\n").encode()) >= len("the cat ") for text in continuations)
    for text in continuations:
        assert text.strip("\n") in printed

    ecfg.sample.prompt = ""
    with pytest.raises(ValueError, match="sample.prompt"):
        sample(ecfg)


def test_an_unknown_eval_mode_is_named_with_the_valid_values() -> None:
    from longseq.runner import check_eval_mode
    from longseq.utils.errors import ConfigError

    with pytest.raises(ConfigError, match=r"mode: 'samples' is not valid; choose one of \('evaluate', 'sample'\)"):
        check_eval_mode("samples")
    assert check_eval_mode("sample") == "sample"


def test_text_codecs_for_word_vocabularies_text8_and_bytes() -> None:
    from longseq.data.text import Enwik8DataModule, Text8DataModule
    from longseq.tasks.sampling import text_codec
    from longseq.utils.errors import ConfigError

    class Words:  # a word-level datamodule (wikitext103): its vocabulary, <eos> first, <unk> for the rest
        def prepare_data(self) -> None: ...

        def vocabulary(self) -> list[str]:
            return ["<eos>", "the", "cat", "<unk>"]

    encode, decode = text_codec(SimpleNamespace(), Words())
    assert encode("the dog cat") == [1, 3, 2]
    assert decode([1, 2, 0, 2]) == "the cat\ncat"
    encode, decode = text_codec(SimpleNamespace(), Text8DataModule(path=None))
    assert decode(encode("a cat")) == "a cat" and encode("ab") == [1, 2]
    with pytest.raises(ConfigError, match="sample.prompt"):
        encode("A")
    encode, decode = text_codec(SimpleNamespace(), Enwik8DataModule(path=None))
    assert encode("é") == [0xC3, 0xA9] and decode(encode("naïve")) == "naïve"


@pytest.mark.parametrize("cache", [True, False])
def test_training_sample_grid_decodes_unless_told_not_to(cache: bool, make_cfg, tmp_path: Path) -> None:
    import hydra

    cfg = make_cfg([f"callbacks.samples.cache={str(cache).lower()}", "callbacks.samples.n_samples=2"])
    callback = hydra.utils.instantiate(cfg.callbacks.samples)
    task = tiny_density_task("full")
    seen = {}
    original = task.sample

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    task.sample = spy
    trainer = SimpleNamespace(global_step=7, loggers=[])
    path = callback.log_samples(trainer, task)
    assert seen["cache"] is cache and path == tmp_path / "samples" / "samples_step7.png" and path.is_file()
    assert max(Image.open(path).size) >= 512  # upscaled to a legible size (callbacks.samples.min_size)


def test_sample_grid_is_upscaled_by_nearest_neighbour_to_the_same_picture_everywhere(tmp_path: Path) -> None:
    """16 digits (8x8, 17 levels) make a 37 px grid; every logger and the PNG get it repeated 14 x 14 (518 px),
    each block one exact level, so the picture is the raw grid, only legible."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from longseq.callbacks.samples import SampleImages, image_grid
    from longseq.utils.errors import ConfigError

    images = torch.randint(0, 17, (16, 8, 8, 1), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    raw = image_grid(images, 17, min_size=0)
    big = image_grid(images, 17)
    assert raw.shape == (3, 37, 37) and big.shape == (3, 14 * 37, 14 * 37)
    assert torch.equal(big[:, ::14, ::14], raw)
    assert torch.equal(big, raw.repeat_interleave(14, 1).repeat_interleave(14, 2))
    assert image_grid(torch.zeros(16, 64, 64, 3, dtype=torch.uint8), 256).shape == (3, 2 * 261, 2 * 261)

    logged = {}

    class Experiment:
        def add_image(self, tag, grid, step):
            logged[tag] = grid

    tensorboard = TensorBoardLogger(str(tmp_path / "tb"))
    tensorboard._experiment = Experiment()
    module = SimpleNamespace(device=torch.device("cpu"), num_levels=17, sample=lambda n, t, generator, cache: images)
    path = SampleImages(str(tmp_path / "samples")).log_samples(SimpleNamespace(global_step=3, loggers=[tensorboard]),
                                                                module)
    assert Image.open(path).size == (518, 518) and torch.equal(logged["samples"], big)
    with pytest.raises(ConfigError, match=r"callbacks\.samples\.min_size: must be an integer >= 0"):
        SampleImages(str(tmp_path), min_size=-1)


def test_training_sample_grid_refuses_a_task_that_cannot_sample_images(make_cfg, tmp_path: Path) -> None:
    """The grid is composed by image tasks only; forced onto an LM (``+callbacks/samples=images``) it fails at
    setup naming its key instead of silently logging nothing."""
    import hydra

    from longseq.callbacks.samples import SampleImages
    from longseq.utils.errors import ConfigError

    grid = hydra.utils.instantiate(make_cfg().callbacks.samples)
    grid.setup(SimpleNamespace(), tiny_density_task("full"), "fit")  # an image density model: accepted
    lm = CausalLMTask(model={"n_layers": 1, "d_model": HEADS * HEAD_DIM, "n_heads": HEADS},
                      attention=attention_config("full"), optimizer={}, scheduler=None, vocab_size=11, seq_len=L)
    with pytest.raises(ConfigError, match=r"callbacks\.samples: CausalLMTask cannot sample images"):
        grid.setup(SimpleNamespace(), lm, "fit")
    with pytest.raises(ConfigError, match=r"callbacks\.samples\.every_n_epochs: must be an integer >= 1, got 0"):
        SampleImages(str(tmp_path), every_n_epochs=0)


def test_eval_mode_sample_names_the_key_for_a_task_that_cannot_generate(tmp_path: Path) -> None:
    """A classifier checkpoint under ``mode=sample``: one ``mode`` error pointing to ``mode=evaluate`` (from the run's
    ``task.module._target_``, before the checkpoint is loaded), nothing written."""
    from omegaconf import OmegaConf

    from longseq.utils.checkpoint import save_atomically
    from longseq.utils.errors import ConfigError

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "last.ckpt"
    save_atomically({"global_step": 1, "state_dict": {}}, ckpt)
    (run / "config_resolved.yaml").write_text(OmegaConf.to_yaml(
        {"task": {"name": "lra_listops", "module": {"_target_": "longseq.tasks.classify.ClassificationTask"}}}))
    out = tmp_path / "figures"
    ecfg = compose_config([f"ckpt_path={ckpt}", "mode=sample", f"sample.out_dir={out}"], tmp_path / "eval",
                          config_name="eval")
    with pytest.raises(ConfigError, match=r"^mode: sample needs an image density or a causal LM task; "
                                          r"ClassificationTask .* use mode=evaluate"):
        sample(ecfg)
    assert not out.exists()
