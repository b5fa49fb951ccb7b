"""``attention.backend`` (``ops.dispatch``): validated, decided from plain facts, recorded; ``cpu_flash`` equals
``explicit`` for every variant with a CPU-engine path (parametrized over the registry by ``cpu_flash``, not names)."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from helpers import CASES, L, build, padding_masks, random_qkv

from longseq.attention import ATTENTION_REGISTRY, AttentionConfigError
from longseq.attention.ops import block_select, dispatch
from longseq.attention.ops.dispatch import BACKENDS, CpuFlash, Facts, Variant, choose

CPU_FLASH = [(name, causal) for name, causal in CASES if dispatch.static_reason(
    "cpu_flash", Variant(name, "?", causal, ATTENTION_REGISTRY[name].cls.cpu_flash, None)) is None]


def test_every_grid_and_cluster_fast_path_is_a_cpu_flash_backend():
    """The variants the CPU engine speeds up (the four former ``*_applies`` gates) declare their path."""
    assert {name for name, _ in CPU_FLASH} >= {"axial", "combiner_axial", "combiner_fixed", "combiner_axial_vertical",
                                              "combiner_axial_horizontal", "combiner_mixture", "routing",
                                              "combiner_routing"}


@pytest.mark.parametrize("name,causal", CASES)
def test_every_attention_accepts_the_backend_knob_and_validates_it(name, causal):
    assert build(name, causal, backend="explicit").backend == "explicit"
    with pytest.raises(AttentionConfigError, match=r"attention.backend must be one of auto, flex, cpu_flash, xla, "
                                                   r"explicit; got 'fast'"):
        build(name, causal, backend="fast")


@pytest.mark.parametrize("name,causal", [c for c in CASES if c not in CPU_FLASH])
def test_cpu_flash_by_name_fails_at_construction_without_a_path(name, causal):
    with pytest.raises(AttentionConfigError, match=r"attention.backend=cpu_flash cannot run here: .*cpu_flash path"):
        build(name, causal, backend="cpu_flash")


@pytest.mark.parametrize("name,causal", CASES)
def test_flex_by_name_builds_where_the_variant_has_a_layout_and_fails_naming_the_knob_elsewhere(name, causal):
    reason = build(name, causal).flex_reason()
    if name == "full" or reason is not None:  # full stays on SDPA
        with pytest.raises(AttentionConfigError, match=r"attention.backend=flex cannot run here: "):
            build(name, causal, backend="flex")
    else:
        assert build(name, causal, backend="flex").backend == "flex"


def test_flex_by_name_runs_flex_for_cpu_inference_and_refuses_cpu_training():
    """The dispatch point routes to ``ops.flex`` (its equality with ``attention_matrix`` is tested in test_flex)."""
    attn = build("combiner_fixed", True, backend="flex").double().eval()
    q, k, v = random_qkv(L=L)
    with torch.no_grad():
        torch.testing.assert_close(attn(q, k, v), attn.attention_matrix(q, k, v) @ v, atol=1e-10, rtol=0)
    assert attn.backends_used == {"flex": "flex"}
    with pytest.raises(AttentionConfigError, match="FlexAttention has no CPU backward"):
        attn(q.requires_grad_(), k, v)


@pytest.mark.parametrize("name,causal", CPU_FLASH)
def test_cpu_flash_equals_explicit(name, causal):
    """Forward and gradients of the CPU engine equal the reference paths (fp64); one module's weights and centroids
    (eval mode: the k-means centroids stay put), gradients into q, k and v."""
    torch.manual_seed(0)
    L_two_rows = 2 * L  # at least two rows / segments on every grid
    module = build(name, causal, seq_len=L_two_rows).double().eval()
    outs, grads = [], []
    for backend in ("cpu_flash", "explicit"):
        attn = copy.deepcopy(module)
        attn.backend = backend
        q, k, v = random_qkv(B=2, H=2, L=L_two_rows, D=8, requires_grad=True)
        out = attn(q, k, v)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
        assert attn.backends_used.keys() == {backend}
        outs.append(out.detach())
        grads.append([x.grad for x in (q, k, v)])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-10, rtol=0)
    for fast, reference in zip(*grads):
        torch.testing.assert_close(fast, reference, atol=1e-10, rtol=0)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name,causal", [c for c in CPU_FLASH if ATTENTION_REGISTRY[c[0]].cls.cpu_flash.head_group_rows])
def test_head_groups_give_the_result_of_all_heads_at_once(name, causal, padded, monkeypatch):
    """A CPU-engine path with ``head_group_rows`` runs per group of heads where its temporaries would reach glibc's
    fresh-mmap size; forced here to one head per group: outputs and gradients as with all heads in one call."""
    import longseq.attention.base as base

    attn = build(name, causal, seq_len=2 * L).double().eval()
    pad = padding_masks(2 * L) if padded and attn.supports_padding_mask else None
    q, k, v = random_qkv(B=3, H=4, L=2 * L, D=8, requires_grad=True)  # B 3: padding_masks' three rows
    grad = torch.cos(torch.arange(q.numel(), dtype=q.dtype)).view_as(q)
    results = []
    for group in (4, 1):
        monkeypatch.setattr(base, "heads_in_group", lambda shape, *_, group=group: group)
        out = attn(q, k, v, key_padding_mask=pad)
        results.append((out, *torch.autograd.grad((out * grad).sum(), (q, k, v))))
    assert attn.backends_used.keys() == {"cpu_flash"}
    for grouped, whole in zip(*results):
        torch.testing.assert_close(grouped, whole, atol=1e-12, rtol=0)


def test_head_groups_keep_the_successors_temporaries_under_the_fresh_mmap_size():
    """The measured rule at the bench geometry (B 1 H 8 D 64, fp32): all heads at L = 4096, two per group at 16384
    (the fastest of 8 / 4 / 2 / 1 there); one per group where one head alone is that large."""
    from longseq.attention.ops.cpu.memory import heads_in_group

    rows = block_select.CPU_FLASH.head_group_rows
    assert heads_in_group(torch.Size([1, 8, 4096, 64]), 64, 4, rows) == 8
    assert heads_in_group(torch.Size([1, 8, 16384, 64]), 64, 4, rows) == 2
    assert heads_in_group(torch.Size([8, 8, 16384, 64]), 64, 4, rows) == 1


@pytest.mark.parametrize("name,causal", [c for c in CPU_FLASH if ATTENTION_REGISTRY[c[0]].cls.supports_padding_mask
                                         and not ATTENTION_REGISTRY[c[0]].cls.cpu_flash.key_padding])
def test_cpu_flash_by_name_refuses_key_padding_at_the_call(name, causal):
    """A condition known only at the call (key padding) fails there, naming the knob; auto runs explicit."""
    attn = build(name, causal, backend="cpu_flash").double()
    q, k, v = random_qkv(B=3, L=L)
    with pytest.raises(AttentionConfigError, match=rf"attention '{name}': attention.backend=cpu_flash cannot run "
                                                   r"here: key padding"):
        attn(q, k, v, key_padding_mask=padding_masks())
    auto = build(name, causal).double()
    auto(q, k, v, key_padding_mask=padding_masks())
    assert auto.backends_used.keys() == {"explicit"}


# -- the decision, from plain facts (no GPU needed for the CUDA branch) ----------------------------------------
GRID = Variant("combiner_x", "combiner", True, CpuFlash(half_precision_training=False), None)
NO_FLEX = Variant("combiner_x", "combiner", True, CpuFlash(), "no flex layout for this partition")
FULL = Variant("full", "dense", True, None, None)


def facts(device="cpu", **changes):
    return Facts(**{"device": device, "dtype": torch.float32, "value_width": 32, "head_dim": 32, **changes})


def test_auto_takes_each_devices_first_backend_that_applies():
    assert choose("auto", GRID, facts("cpu", grad=True)).backend == "cpu_flash"
    assert choose("auto", GRID, facts("cuda", grad=True)).backend == "flex"
    assert choose("auto", NO_FLEX, facts("cuda")).backend == "explicit"
    assert choose("auto", GRID, facts("mps")).backend == "explicit"
    assert choose("auto", FULL, facts("cuda")).backend == "explicit"  # full stays on SDPA
    assert choose("auto", FULL, facts("cpu")).backend == "explicit"


@pytest.mark.parametrize("device", ["cpu", "cuda", "meta"])
@pytest.mark.parametrize("condition", [
    {"key_padding": True}, {"dropout": True}, {"value_width": 16}, {"grad": True, "dtype": torch.bfloat16},
    {"geometry": "a single row"}, {"grad": True}, {},
])
def test_auto_never_picks_a_backend_that_does_not_apply(device, condition):
    for variant in (GRID, NO_FLEX, FULL, Variant("linear", "efficient", True, None, "no partition")):
        call = facts(device, **condition)
        choice = choose("auto", variant, call)
        assert dispatch.call_reason(choice.backend, variant, call) is None
        assert choice.backend in dispatch.PRIORITY.get(device, dispatch.OTHER_DEVICES)
        assert choice.backend != "flex" or device == "cuda"  # auto never runs flex unfused on CPU
        assert {b for b, _ in choice.rejected} == set(BACKENDS[1:]) - {choice.backend}  # every other one explained


def test_the_reasons_name_the_condition():
    rejected = dict(choose("auto", GRID, facts("cpu", key_padding=True)).rejected)
    assert rejected["cpu_flash"].startswith("key padding") and "unfused on CPU" in rejected["flex"]
    rejected = dict(choose("auto", GRID, facts("cuda", dropout=True)).rejected)
    assert "no attention-weight dropout" in rejected["flex"] and "CPU tensors only" in rejected["cpu_flash"]
    assert "bfloat16 training" in dispatch.call_reason("cpu_flash", GRID, facts(grad=True, dtype=torch.bfloat16))
    assert "no CPU backward" in choose("flex", GRID, facts("cpu", grad=True)).refusal
    assert choose("flex", GRID, facts("cpu")).backend == "flex"  # CPU inference by name
    assert "stays on SDPA" in choose("flex", FULL, facts("cuda")).refusal
    narrow = facts("cuda", head_dim=8, value_width=8)  # compiled flex lowers widths >= 16 only
    assert "at least 16" in choose("flex", GRID, narrow).refusal and choose("auto", GRID, narrow).backend == "explicit"
    assert choose("flex", GRID, facts("cpu", head_dim=8, value_width=8)).backend == "flex"  # eager on CPU: any width


TILES = Variant("moba", "sparse", True, block_select.CPU_FLASH, "no flex layout", block_select.TILED_PAIRS, True)
HOST_READS = Variant("reads", "sparse", True, None, "no flex layout", "reads a count with int", False)


def test_auto_on_an_xla_device_takes_the_static_shape_forms_and_refuses_host_reads_without_one():
    """The XLA branch of the decision on plain facts (no torch_xla needed): every variant that can run there runs
    ``xla`` (its explicit path, host reads in their static-shape forms); one with host reads and no such form is
    refused naming the variant and why, by auto and by name; flex and cpu_flash are never XLA's."""
    xla = facts("xla", grad=True)
    for variant in (GRID, NO_FLEX, FULL, TILES):
        choice = choose("auto", variant, xla)
        assert choice.backend == "xla" and choice.refusal is None
        rejected = dict(choice.rejected)
        assert "no XLA lowering" in rejected["flex"] and "CPU tensors only" in rejected["cpu_flash"]
        assert "static-shape forms" in rejected["explicit"]
    refused = choose("auto", HOST_READS, xla)
    assert refused.backend is None
    assert refused.refusal == ("attention.backend=auto finds no backend for xla (xla: attention 'reads' has no "
                               "static-shape form of its explicit path, which reads a count with int)")
    assert "on XLA: attention 'reads''s explicit path reads a count with int" in choose("explicit", HOST_READS,
                                                                                       xla).refusal
    assert dispatch.static_reason("xla", HOST_READS) is not None  # named, it fails at construction
    assert choose("explicit", TILES, facts("cpu", grad=True)).backend == "explicit"  # host reads are fine off XLA
    assert choose("xla", TILES, facts("cpu", grad=True)).backend == "xla"  # the static form runs anywhere by name
    assert choose("auto", TILES, facts("cuda", grad=True)).backend == "explicit"  # auto never pads tiles elsewhere


def test_an_attention_refused_on_xla_raises_naming_it_at_the_call(monkeypatch):
    """The refusal reaches the user as ``AttentionConfigError`` naming the variant (the device type faked: a CPU
    tensor whose dispatch facts say xla)."""
    attn = build("moba", True)
    monkeypatch.setattr(type(attn), "xla_path", False)
    real_facts = dispatch.Facts
    monkeypatch.setattr(dispatch, "Facts", lambda **kw: real_facts(**{**kw, "device": "xla"}))
    q, k, v = random_qkv(L=L, dtype=torch.float32)
    with pytest.raises(AttentionConfigError, match=r"attention 'moba': attention.backend=auto finds no backend for "
                                                   r"xla \(xla: attention 'moba' has no static-shape form"):
        attn(q, k, v)


def test_an_eager_fp32_path_runs_explicit_in_half_precision_and_under_compile():
    """Block selection's fused tiles (``block_select.CPU_FLASH``): fp32/fp64 and eager only, key padding fine."""
    tiles = Variant("moba", "sparse", True, block_select.CPU_FLASH, "no flex layout")
    assert choose("auto", tiles, facts(key_padding=True, grad=True)).backend == "cpu_flash"
    for condition, reason in (({"dtype": torch.bfloat16}, "fp32 / fp64 only"), ({"compiling": True}, "eagerly only")):
        assert choose("auto", tiles, facts(**condition)).backend == "explicit"
        assert reason in choose("cpu_flash", tiles, facts(**condition)).refusal
    assert choose("auto", GRID, facts(compiling=True)).backend == "cpu_flash"  # the other paths compile


def test_the_choice_is_logged_once_with_the_reasons(caplog):
    attn = build("combiner_fixed", True).double()
    q, k, v = random_qkv(L=L)
    with caplog.at_level(logging.INFO, logger="longseq.attention.ops.dispatch"):
        attn(q, k, v, key_padding_mask=padding_masks()[:2])
        attn(q, k, v, key_padding_mask=padding_masks()[:2])
    lines = [r.getMessage() for r in caplog.records if "combiner_fixed" in r.getMessage()]
    assert len(lines) == 1  # once per run: building the attention started one
    assert "runs on backend explicit" in lines[0] and "cpu_flash not used because: key padding" in lines[0]


def test_the_decision_compiles_without_graph_breaks_and_is_recorded():
    """The dispatch point is plain Python on shapes, dtypes and flags: ``fullgraph`` tracing passes through it and
    the record (a dict update) survives compilation."""
    attn = build("local", True).eval()
    compiled = torch.compile(attn, backend="eager", fullgraph=True)
    q, k, v = random_qkv(L=L, dtype=torch.float32)
    torch.testing.assert_close(compiled(q, k, v), attn(q, k, v))
    assert attn.backends_used == {"explicit": "auto"}


def test_the_choice_is_recorded_in_metrics_json(make_cfg, tmp_path):
    """A tiny training run records the backend its attention layers used: metrics.json and the logger config."""
    from longseq.runner import train

    metrics = train(make_cfg(["attention=combiner_fixed", "attention.backend=explicit", "logger=csv",
                              "trainer.max_steps=1", "trainer.limit_val_batches=1", "callbacks=none",
                              "test=false"]))
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["attention/backend"] == record["metrics"]["attention/backend"] == "explicit"
    hparams = [p.read_text() for p in tmp_path.rglob("hparams.yaml")]
    assert any("attention_backend:" in text and "attention: explicit" in text for text in hparams), hparams


def test_a_device_the_engine_cannot_serve_fails_at_the_call_naming_the_knob():
    """The branch a non-CPU tensor takes, traced on the meta device: cpu_flash by name refuses, auto runs explicit."""
    q, k, v = (torch.randn(1, 2, L, 8, device="meta") for _ in range(3))
    with pytest.raises(AttentionConfigError, match=r"attention.backend=cpu_flash cannot run here: the CPU engine "
                                                   r"runs on CPU tensors only, got meta"):
        build("combiner_fixed", True, backend="cpu_flash")(q, k, v)
    auto = build("combiner_fixed", True)
    assert auto(q, k, v).shape == (1, 2, L, 8) and auto.backends_used.keys() == {"explicit"}
