"""``model.residual_gain=zero`` (ReZero, issue 44): every block starts as the identity and learns its gains."""

from __future__ import annotations

import pytest
import torch

from longseq.models.transformer import Transformer
from longseq.utils.errors import ConfigError


def model(gain: str = "zero", plan=None, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(vocab_size=32, seq_len=32, n_layers=2, d_model=16, n_heads=2, mlp_ratio=2, short_conv=4,
                       pos_emb="none", attention={"name": "combiner_fixed", "causal": True, "block_size": 8},
                       layer_attention=plan, residual_gain=gain).double()


@pytest.mark.parametrize("plan", [None, ["combiner_fixed", "full"], ["full", "combiner_fixed"]])
def test_at_initialization_every_block_is_the_identity(plan):
    """The backbone's output equals its embedding path (final norm and head of the token embeddings) exactly, in
    either order of a hybrid; without the gain it does not."""
    tokens = torch.randint(0, 32, (2, 32), generator=torch.Generator().manual_seed(0))
    net = model(plan=plan)
    embedding_path = net.head(net.norm(net.token(tokens)))
    torch.testing.assert_close(net(tokens), embedding_path, rtol=0, atol=0)
    plain = model("none", plan=plan)
    assert not torch.allclose(plain(tokens), plain.head(plain.norm(plain.token(tokens))))
    assert all(block.gain is None for block in plain.blocks)


def test_gradients_reach_the_gains_and_a_step_opens_the_branches():
    """At zero the gains get a gradient (the branch's output against the loss's), the branches' own weights none yet;
    one optimizer step moves the gains off zero and the model off the identity."""
    tokens = torch.randint(0, 32, (4, 32), generator=torch.Generator().manual_seed(1))
    net = model()
    loss = torch.nn.functional.cross_entropy(net(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    for block in net.blocks:
        assert block.gain.grad is not None and (block.gain.grad.abs() > 0).all()
        assert block.attn.qkv.weight.grad.abs().max() == 0  # scaled by a zero gain
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    assert all((block.gain != 0).all() for block in net.blocks)
    assert not torch.allclose(net(tokens), net.head(net.norm(net.token(tokens))))


def test_gains_are_vectors_and_decoding_matches_forward():
    """The gains are 1-D parameters (the task's AdamW decays matrices only: not the gains, like norms); incremental
    decoding applies them as forward does."""
    net = model(plan=["full", "combiner_fixed"]).eval()
    with torch.no_grad():
        for block in net.blocks:
            block.gain.copy_(torch.tensor([0.7, -1.3], dtype=torch.float64))
    assert all(block.gain.dim() == 1 for block in net.blocks)
    tokens = torch.randint(0, 32, (2, 32), generator=torch.Generator().manual_seed(2))
    state = net.new_decoding_state(2)
    logits = [net.prefill(tokens[:, :5], state)] + [net.step(tokens[:, t], state)[:, None] for t in range(5, 32)]
    torch.testing.assert_close(torch.cat(logits, 1), net(tokens), rtol=0, atol=1e-10)


def test_a_bad_value_names_the_key():
    with pytest.raises(ConfigError, match=r"model\.residual_gain"):
        model("one")
