"""AttentionMaps callback: per-layer attention images for csv, TensorBoard and W&B offline runs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from longseq.callbacks.attention_maps import AttentionMaps, attention_modules
from longseq.models.transformer import Transformer

# One validation inside fit (epoch of 3 batches = max_steps), 2 layers, 2 heads.
FIT_WITH_VALIDATION = ["trainer.limit_train_batches=3", "model.n_layers=2", "attention=combiner_fixed",
                       "callbacks.samples.n_samples=0", "callbacks.attention_maps.every_n_epochs=1"]


def png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        return image.size


@pytest.mark.parametrize("logger", ["csv", "tensorboard", "wandb"])
def test_train_writes_attention_maps_for_each_logger(make_cfg, tmp_path: Path, logger: str) -> None:
    from longseq.runner import train

    overrides = FIT_WITH_VALIDATION + [f"logger={logger}"]
    if logger == "wandb":
        overrides.append("logger.wandb.offline=true")
    train(make_cfg(overrides))
    own = sorted((tmp_path / "attention_maps").glob("*.png"))
    assert [p.name for p in own] == ["attention_layer0_step3.png", "attention_layer1_step3.png"]
    width, height = png_size(own[0])
    assert width > 2.5 * height  # mean + 2 heads side by side
    if logger == "csv":
        copies = sorted((tmp_path / "csv" / "attention_maps").glob("*.png"))
        assert [p.name for p in copies] == [p.name for p in own]
    elif logger == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
        events.Reload()
        assert {"attention_maps/layer0", "attention_maps/layer1"} <= set(events.Tags()["images"])
        image = events.Images("attention_maps/layer1")[-1]
        assert image.step == 3 and (image.width, image.height) == (width, height)
    else:
        media = sorted(tmp_path.glob("wandb/offline-run-*/files/media/images/attention_maps/layer*_*.png"))
        assert len(media) == 2 and png_size(media[0]) == (width, height)


@pytest.mark.parametrize("task", ["digits", "lra_listops", "enwik8"])
def test_maps_have_their_own_frequency_key_on_every_task(make_cfg, task: str) -> None:
    """``callbacks.attention_maps.every_n_epochs`` is the maps' own key (default 10) on every task: an image
    task's sample-grid key does not move it, and tasks that cannot sample still get maps."""
    import hydra

    sample_key = ["task.sample_every_n_epochs=3"] if task == "digits" else []
    default = hydra.utils.instantiate(make_cfg([f"task={task}", *sample_key]).callbacks.attention_maps)
    assert isinstance(default, AttentionMaps) and default.every_n_epochs == 10
    cfg = make_cfg([f"task={task}", "callbacks.attention_maps.every_n_epochs=2", *sample_key])
    callback = hydra.utils.instantiate(cfg.callbacks.attention_maps)
    epochs = [SimpleNamespace(sanity_checking=False, fast_dev_run=False, current_epoch=epoch,
                              state=SimpleNamespace(fn="fit")) for epoch in range(4)]
    assert [callback.due(trainer) for trainer in epochs] == [False, True, False, True]


def test_maps_are_the_layers_own_attention_matrix_on_the_captured_example(tmp_path: Path) -> None:
    """The captured (q, k, v) of the chosen example give each layer's attention_matrix; hooks are removed."""
    torch.manual_seed(0)
    model = Transformer(vocab_size=17, seq_len=16, n_layers=2, d_model=16, n_heads=2,
                        attention={"name": "fixed", "causal": True, "block_size": 4})
    callback = AttentionMaps(str(tmp_path), example_index=1)
    layers = attention_modules(model)
    assert len(layers) == 2
    for name, attention in layers:
        callback.handles.append(attention.register_forward_pre_hook(callback.capture_hook(name), with_kwargs=True))
    tokens = torch.randint(0, 17, (3, 16))
    seen = {}

    def probe(name):
        def hook(module, args, kwargs):
            seen[name] = args[:3]
        return hook

    probes = [attn.register_forward_pre_hook(probe(name), with_kwargs=True) for name, attn in layers]
    model.eval()
    with torch.no_grad():
        model(tokens)
    callback.remove_hooks()
    for probe in probes:
        probe.remove()
    assert all(not attn._forward_pre_hooks for _, attn in layers)
    for name, attention in layers:
        _, (q, k, v), _ = callback.captured[name]
        assert q.shape == (1, 2, 16, 8)
        torch.testing.assert_close(q, seen[name][0][1:2])  # row example_index of the batch
        weights = attention.attention_matrix(q, k, v)[0]
        assert (weights == 0).any()  # the sparse pattern drops keys: what the map shows


def test_long_sequences_and_disabled_log_nothing(tmp_path: Path) -> None:
    """L > max_seq_len: nothing is drawn (attention_matrix is O(H L^2)); enabled=false captures nothing."""
    model = Transformer(vocab_size=17, seq_len=16, n_layers=1, d_model=16, n_heads=2, attention={"name": "full", "causal": True})
    trainer = SimpleNamespace(sanity_checking=False, fast_dev_run=False, is_global_zero=True, global_step=1,
                              current_epoch=0, loggers=[], state=SimpleNamespace(fn="fit"))
    for callback in (AttentionMaps(str(tmp_path / "long"), max_seq_len=8),
                     AttentionMaps(str(tmp_path / "off"), enabled=False)):
        callback.on_validation_batch_start(trainer, model, None, 0)
        model(torch.randint(0, 17, (2, 16)))
        callback.on_validation_batch_end(trainer, model, None, None, 0)
        callback.on_validation_epoch_end(trainer, model)
        assert not callback.handles and not callback.captured and not callback.written
    assert not (tmp_path / "long").exists() and not (tmp_path / "off").exists()
    shown = AttentionMaps(str(tmp_path / "on"), max_seq_len=16)  # the same run at the limit draws the map
    shown.on_validation_batch_start(trainer, model, None, 0)
    model(torch.randint(0, 17, (2, 16)))
    shown.on_validation_epoch_end(trainer, model)
    assert [p.name for p in shown.written] == ["attention_layer0_step1.png"]
    with pytest.raises(ValueError, match="callbacks.attention_maps.every_n_epochs"):
        AttentionMaps(str(tmp_path), every_n_epochs=0)


def test_final_weights_get_maps_when_training_ends_between_logged_validations(make_cfg, tmp_path: Path) -> None:
    """every_n_epochs=10 and fit ends after one epoch: no validation draws, the end of training does (step 3)."""
    from longseq.runner import train

    train(make_cfg([o for o in FIT_WITH_VALIDATION if "every_n_epochs" not in o] + ["logger=csv"]))
    own = sorted(p.name for p in (tmp_path / "attention_maps").glob("*.png"))
    assert own == ["attention_layer0_step3.png", "attention_layer1_step3.png"]
    assert sorted(p.name for p in (tmp_path / "csv" / "attention_maps").glob("*.png")) == own


def test_final_maps_replay_the_kept_example_through_the_final_weights(tmp_path: Path) -> None:
    """The example row kept at the last validation is run through the *current* weights at the end of training,
    in eval mode, and every hook is gone afterwards."""
    torch.manual_seed(0)

    class Task(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Transformer(vocab_size=17, seq_len=16, n_layers=2, d_model=16, n_heads=2, dropout=0.5,
                                   attention={"name": "full", "causal": True})

    task = Task().train()
    trainer = SimpleNamespace(sanity_checking=False, fast_dev_run=False, is_global_zero=True, global_step=5,
                              current_epoch=0, loggers=[], state=SimpleNamespace(fn="fit"),
                              strategy=SimpleNamespace())
    callback = AttentionMaps(str(tmp_path), every_n_epochs=10, example_index=1)
    tokens = torch.randint(0, 17, (3, 16))
    callback.on_validation_batch_start(trainer, task, None, 0)
    task.net(tokens)
    callback.on_validation_batch_end(trainer, task, None, None, 0)
    callback.on_validation_epoch_end(trainer, task)
    assert not callback.written and callback.example[0][0].shape == (1, 16)  # not due: nothing drawn, row kept
    with torch.no_grad():  # "training" moves the weights after the last validation
        for p in task.parameters():
            p.add_(0.1 * torch.randn_like(p))
    trainer.global_step = 9
    seen = {}
    callback.log_maps = lambda trainer: seen.update({n: qkv for n, (_, qkv, _) in callback.captured.items()})
    callback.final = False  # callbacks.attention_maps.final=false: no maps at the end
    callback.on_train_end(trainer, task)
    assert not seen
    callback.final = True
    callback.on_train_end(trainer, task)
    assert task.training and all(not m._forward_pre_hooks for m in task.modules())
    probes = {}

    def probe(name):
        def hook(module, args, kwargs):
            probes[name] = args[:3]
        return hook

    for name, attention in attention_modules(task):
        attention.register_forward_pre_hook(probe(name), with_kwargs=True)
    task.eval()
    with torch.no_grad():
        task.net(tokens[1:2])
    assert set(seen) == set(probes) and len(seen) == 2
    for name in seen:
        for got, want in zip(seen[name], probes[name]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
