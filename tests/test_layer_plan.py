"""Hybrid layer plans (``model.layer_attention``, issue 33): a plan that names one attention everywhere is that
attention, a hybrid decodes as it runs forward, every mistake names the key, and the option composes, trains,
draws its maps, is benchmarked and reloads from its checkpoints."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config

from longseq.models.layer_plan import layer_specs, plan_names
from longseq.models.transformer import Transformer
from longseq.runner import build_module
from longseq.utils.errors import ConfigError

SPECS = {
    "full": {"name": "full", "causal": True},
    "local": {"name": "local", "causal": True, "window": 4},
    "combiner_fixed": {"name": "combiner_fixed", "causal": True, "block_size": 4},
    "moba": {"name": "moba", "causal": True, "block_size": 4, "top_k": 1},
}


def model(attention: dict, plan=None, presets=None, seed: int = 0, n_layers: int = 2, **kw) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(vocab_size=11, seq_len=16, n_layers=n_layers, d_model=16, n_heads=2, attention=attention,
                       dropout=0.0, short_conv=kw.pop("short_conv", 3), layer_attention=plan,
                       attention_presets=presets, **kw).double().eval()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_plan_naming_one_attention_everywhere_is_that_attention(name, one_thread):
    """Same parameters (names and values, from the same seed) and the same outputs, bit for bit, for a list, a
    pattern of every layer, and null entries (the run's own attention)."""
    tokens = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = model(SPECS[name])
    for plan in ([name, name], {"every": 1, "attention": name}, [None, name]):
        planned = model(SPECS[name], plan)
        assert planned.layer_names == [name, name]
        expected, got = plain.state_dict(), planned.state_dict()
        assert list(got) == list(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        assert torch.equal(planned(tokens), plain(tokens))


def test_a_hybrid_differs_from_both_of_its_attentions():
    tokens = torch.randint(0, 11, (1, 16), generator=torch.Generator().manual_seed(0))
    hybrid = model(SPECS["local"], {"every": 2, "attention": "full"}, {"full": {"name": "full"}})
    assert hybrid.layer_names == ["local", "full"]
    for single in (model(SPECS["local"]), model(SPECS["full"])):
        assert not torch.allclose(hybrid(tokens), single(tokens))


@pytest.mark.parametrize("base,other", [("local", "full"), ("combiner_fixed", "full"), ("combiner_fixed", "moba")])
def test_a_hybrid_of_two_causal_attentions_decodes_as_it_runs_forward(base, other, one_thread):
    """prefill + step per layer (each layer its own decoding state) reproduce forward's logits (fp64)."""
    net = model(SPECS[base], [base, SPECS[other]], n_layers=2)
    assert net.layer_names == [base, other]
    tokens = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = net(tokens)
    for prefix in (1, 6):
        state = net.new_decoding_state(2)
        logits = [net.prefill(tokens[:, :prefix], state)]
        logits += [net.step(tokens[:, t], state)[:, None] for t in range(prefix, 16)]
        torch.testing.assert_close(torch.cat(logits, dim=1), expected, rtol=0, atol=1e-10)


def test_layers_take_their_preset_the_run_attention_keeps_its_overrides():
    """A name other than the run's gets its preset plus the shared keys (direction, backend); the run's own name
    gets the run's spec, command-line knobs included; a mapping entry adds its knobs."""
    base = {"name": "local", "causal": True, "backend": "explicit", "window": 300}
    presets = {"combiner_fixed": {"name": "combiner_fixed", "block_size": 16, "summary": "max"}}
    specs = layer_specs(base, ["local", "combiner_fixed", {"name": "combiner_fixed", "summary": "mean"}, "full"], 4,
                        presets)
    assert specs[0] == base
    assert specs[1] == {"name": "combiner_fixed", "block_size": 16, "summary": "max", "causal": True,
                        "backend": "explicit"}
    assert specs[2]["summary"] == "mean" and specs[2]["block_size"] == 16
    assert specs[3] == {"name": "full", "causal": True, "backend": "explicit"}
    assert layer_specs(base, {"every": 2, "attention": "full"}, 4)[1::2] == [specs[3], specs[3]]
    assert [s["name"] for s in layer_specs(base, {"every": 3, "attention": "full"}, 4)] == [
        "local", "local", "full", "local"]
    assert plan_names(["local", None, {"name": "moba"}, "local"]) == ["local", "moba"]
    assert plan_names({"every": 2, "attention": {"name": "full"}}) == ["full"]


@pytest.mark.parametrize("plan,message", [
    (["full"], r"has 1 entries for model\.n_layers=2"),
    (["full", "full", "full"], r"has 3 entries"),
    (["full", "nope"], r"layer 1: unknown attention 'nope'"),
    (["full", "combiner_fixd"], r"did you mean combiner_fixed"),
    (["full", "fnet"], r"layer 1: 'fnet' cannot be causal"),
    ({"every": 2, "attention": "linformer"}, r"'linformer' cannot be causal"),
    ({"every": 0, "attention": "full"}, r"every must be an integer in \[1, model\.n_layers=2\]"),
    ({"every": 3, "attention": "full"}, r"every must be an integer"),
    ({"each": 2, "attention": "full"}, r"exactly the keys every and attention"),
    ("full", r"must be null"),
    (["full", 3], r"layer 1: an entry is an attention name"),
    (["full", {"name": "full", "causal": False}], r"layer 1: causal=False differs from attention\.causal"),
    (["full", {"name": "local", "window": 0}], r"layer 1 \(local\): attention\.window must be an integer >= 1"),
    (["full", {"name": "full", "bogus": 1}], r"layer 1 \(full\): attention 'full' does not accept attention\.bogus"),
])
def test_a_bad_plan_fails_at_construction_naming_the_key(plan, message):
    with pytest.raises(ConfigError, match=message) as error:
        model(SPECS["full"], plan)
    assert error.value.key == "model.layer_attention"


def test_without_a_plan_attention_errors_still_name_the_attention_key():
    with pytest.raises(ValueError, match=r"attention\.window") as error:
        model({"name": "local", "causal": True, "window": 0})
    assert getattr(error.value, "key", None) != "model.layer_attention"


def test_the_option_composes_with_presets_resolved_against_the_task(tmp_path):
    """``model.layer_attention`` in one override: the other names' presets come from conf/attention resolved
    against this task (local's window is task.block_size), the run's own attention keeps attention.*."""
    cfg = compose_config(["task=mqar", "task.seq_len=64", "task.num_pairs=4", "task.vocab_size=128",
                          "attention=combiner_fixed", "attention.summary=mean", "model.n_layers=3",
                          "model.layer_attention=[null,local,full]"], tmp_path)
    assert cfg.model.attention_presets["local"]["window"] == cfg.task.block_size == 8
    net = build_module(cfg).net
    assert net.layer_names == ["combiner_fixed", "local", "full"]
    assert "summary=mean" in repr(net.blocks[0].attn.attention) and net.blocks[1].attn.attention.window == 8
    cfg = compose_config(["attention=combiner_fixed", "model.n_layers=2",
                          "model.layer_attention={every:2,attention:full}"], tmp_path)
    assert build_module(cfg).net.layer_names == ["combiner_fixed", "full"]
    assert compose_config([], tmp_path).model.attention_presets == {}  # no plan: nothing resolved
    for bad in ("model.layer_attention=[full]", "model.layer_attention=[full,fnet]"):
        with pytest.raises(ConfigError) as error:
            build_module(compose_config(["model.n_layers=2", bad], tmp_path))
        assert error.value.key == "model.layer_attention"


def test_a_hybrid_run_draws_maps_per_layer_reloads_and_resumes_from_its_checkpoints(make_cfg, tmp_path):
    """Train a [full, local] hybrid on digits: maps of both layers, eval.py rebuilds the same plan from the run's
    resolved config, and the run resumes from last.ckpt with the same layers."""
    from longseq.runner import evaluate, load_checkpoint_run, train

    plan = ["model.n_layers=2", "model.layer_attention=[full,local]", "callbacks.attention_maps.every_n_epochs=1",
            "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.check_val_every_n_epoch=null"]
    train(make_cfg(plan))
    maps = {p.name.split("_step")[0] for p in (tmp_path / "attention_maps").glob("*.png")}
    assert maps == {"attention_layer0", "attention_layer1"}
    best = tmp_path / "checkpoints" / "best.ckpt"
    eval_cfg = compose_config([f"ckpt_path={best}"], tmp_path / "eval", config_name="eval")
    _, module = load_checkpoint_run(eval_cfg)
    assert module.net.layer_names == ["full", "local"] and module.net.blocks[1].attn.attention.window == 8
    assert 0 < evaluate(eval_cfg)["test/bpd"] < 10
    train(make_cfg([*plan, f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}", "trainer.max_steps=3"]))
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 3


@pytest.mark.slow  # every attention built in a plan
def test_the_throughput_benchmark_builds_the_plan_for_every_attention(tmp_path):
    """``train_step.layer_attention``: each attention's model gets one full layer in two; the rows say so."""
    import csv

    from conftest import CONF
    from omegaconf import OmegaConf

    from longseq.bench.run import run_benchmark

    cfg = OmegaConf.load(CONF / "bench.yaml")
    cfg.merge_with({"attentions": ["full", "combiner_fixed"], "lengths": [], "isolate": False, "device": "cpu",
                    "plot": False, "out_dir": str(tmp_path), "throughput": True,
                    "train_step": {"seq_len": 64, "block_size": 8, "batch": 2, "n_layers": 2, "d_model": 32,
                                   "n_heads": 2, "warmup": 1, "steps": 1, "rounds": 1,
                                   "layer_attention": {"every": 2, "attention": "local"}}})
    run_dir = run_benchmark(cfg)
    with (run_dir / "throughput.csv").open() as handle:
        rows = {row["attention"]: row for row in csv.DictReader(handle)}
    assert {name: row["layers"] for name, row in rows.items()} == {"full": "full,local",
                                                                    "combiner_fixed": "combiner_fixed,local"}
    assert all(row["status"] == "ok" for row in rows.values()), rows
    assert "combiner_fixed (layers combiner_fixed,local)" in (run_dir / "results.md").read_text()
