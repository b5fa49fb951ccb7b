"""Backbone, metric, schedule and sampling units."""

from __future__ import annotations

import math

import pytest
import torch

from longseq.data.batching import per_device_batch_size
from longseq.data.images import images_to_tokens, tokens_to_images
from longseq.models.transformer import ImagePositionEmbedding, Transformer, sinusoidal_table
from longseq.tasks.density import DensityTask
from longseq.tasks.metrics import BitsPerDim, MeanNLL
from longseq.tasks.schedules import warmup_constant, warmup_cosine

FULL = {"name": "full", "causal": True}


def tiny(pos_emb="learned", image_shape=None, **kw):
    return Transformer(vocab_size=18, seq_len=12, n_layers=2, d_model=16, n_heads=2, attention=FULL,
                       pos_emb=pos_emb, image_shape=image_shape, **kw)


@pytest.mark.parametrize("pos_emb,shape", [("learned", None), ("sinusoidal", None), ("image", (2, 2, 3)), ("none", None)])
def test_backbone_shapes_and_causality(pos_emb, shape):
    torch.manual_seed(0)
    net = tiny(pos_emb, shape).eval()
    x = torch.randint(0, 18, (3, 12))
    y = net(x)
    assert y.shape == (3, 12, 18)
    x2 = x.clone()
    x2[:, 7] = (x2[:, 7] + 1) % 18
    y2 = net(x2)
    torch.testing.assert_close(y[:, :7], y2[:, :7])
    assert not torch.allclose(y[:, 7:], y2[:, 7:])


def test_backbone_rejects_bad_options():
    with pytest.raises(ValueError, match="model.pos_emb"):
        tiny("alibi")  # not an option (rotary is, model.pos_emb=rotary)
    with pytest.raises(ValueError, match="task.image_shape"):
        tiny("image", (3, 3, 3))
    with pytest.raises(ValueError, match="model.n_heads"):
        Transformer(vocab_size=4, seq_len=4, n_layers=1, d_model=10, n_heads=3, attention=FULL)
    with pytest.raises(ValueError, match="exceeds task.seq_len"):
        tiny()(torch.zeros(1, 13, dtype=torch.long))


def test_image_position_embedding_factorizes_row_column_channel():
    emb = ImagePositionEmbedding((2, 3, 3), 4)
    table = emb(18)
    # positions 0 and 3 differ only in the column; 0 and 9 only in the row
    torch.testing.assert_close(table[3] - table[0], emb.col.weight[1] - emb.col.weight[0])
    torch.testing.assert_close(table[9] - table[0], emb.row.weight[1] - emb.row.weight[0])
    torch.testing.assert_close(table[1] - table[0], emb.channel.weight[1] - emb.channel.weight[0])


def test_sinusoidal_table_values():
    t = sinusoidal_table(5, 4)
    assert t[0, 0] == 0 and t[0, 1] == 1
    assert t[3, 0] == pytest.approx(math.sin(3.0))


def test_bits_per_dim_metric():
    m = BitsPerDim()
    m.update(torch.tensor(10.0), 4)
    m.update(torch.tensor(2.0), 2)
    assert m.compute().item() == pytest.approx(12 / 6 / math.log(2))
    assert MeanNLL().to("cpu") is not None


def test_per_device_batch_size():
    assert per_device_batch_size(64, 2, 4) == 8
    with pytest.raises(ValueError, match="my.key=30.*2 x 4 = 8"):
        per_device_batch_size(30, 2, 4, key="my.key")


def test_schedules():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = warmup_cosine(opt, total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    lrs = []
    for _ in range(110):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    opt2 = torch.optim.SGD([p], lr=2.0)
    const = warmup_constant(opt2, total_steps=10, warmup_steps=4)
    for _ in range(6):
        opt2.step()
        const.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(2.0)


def test_token_image_round_trip_is_channel_interleaved():
    images = torch.arange(2 * 2 * 3 * 3).reshape(2, 2, 3, 3).numpy()
    tokens = images_to_tokens(images)
    assert tokens[0, (1 * 3 + 2) * 3 + 1] == images[0, 1, 2, 1]
    assert torch.equal(tokens_to_images(tokens, (2, 3, 3)), torch.from_numpy(images).long())


def test_density_sampling_returns_uint8_images_in_range():
    torch.manual_seed(0)
    task = DensityTask(model={"n_layers": 1, "d_model": 16, "n_heads": 2}, attention=FULL,
                       optimizer={}, scheduler=None, num_levels=5, image_shape=(2, 3, 1))
    gen = torch.Generator().manual_seed(0)
    a = task.sample(4, generator=gen)
    b = task.sample(4, generator=torch.Generator().manual_seed(0))
    assert a.shape == (4, 2, 3, 1) and a.dtype == torch.uint8 and int(a.max()) < 5
    assert torch.equal(a, b)


def test_density_nll_matches_manual_cross_entropy():
    torch.manual_seed(0)
    task = DensityTask(model={"n_layers": 1, "d_model": 16, "n_heads": 2}, attention=FULL,
                       optimizer={}, scheduler=None, num_levels=5, image_shape=(2, 3, 1)).eval()
    x = torch.randint(0, 5, (3, 6))
    logits = task.net(torch.cat([torch.full((3, 1), 5), x[:, :-1]], 1))
    manual = -logits.log_softmax(-1).gather(-1, x.unsqueeze(-1)).sum()
    torch.testing.assert_close(task.nll_sum(x), manual)
