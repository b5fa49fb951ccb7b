"""Import of the released Transformer-XL checkpoints (``task.module.init_from=hf:<dir>`` / ``kimiyoung:<file>``).

The checkpoints are written here from tiny configs with the official key names, shapes, ties, cluster order and
companion vocabulary files (HF: config.json + pytorch_model.bin or model.safetensors + vocab.pkl; kimiyoung: a MemTransformerLM state
dict + the corpus cache.pt its data_utils writes). The numbers against the official HF forward itself are checked
by ``tools/xl_hf_crosscheck.py`` (it needs transformers <= 4.35, outside the project's pins).
"""

from __future__ import annotations

import json
import math
import pickle
import re
import sys
import types
from collections import Counter, OrderedDict

import numpy as np
import pytest
import torch

from longseq.models.trams import TramsSpec
from longseq.models.transformer_xl import MemorySpec, TransformerXL
from longseq.models.xl_import import import_checkpoint, model_ids, read_vocabulary
from longseq.utils.errors import ConfigError, DataError

VOCAB, CUTOFFS, D_MODEL, HEADS, D_HEAD, D_INNER, LAYERS = 30, [8, 16], 16, 2, 8, 32, 2
SYMBOLS = ["<eos>"] + [f"w{i}" for i in range(1, VOCAB - 1)] + ["<unk>"]
TRIPPED: list[str] = []


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def hf_config(**changes) -> dict:
    """config.json as TransfoXLConfig.to_dict() writes it, for a tiny model."""
    config = {"vocab_size": VOCAB, "cutoffs": CUTOFFS, "d_model": D_MODEL, "d_embed": D_MODEL, "n_head": HEADS,
              "d_head": D_HEAD, "d_inner": D_INNER, "div_val": 2, "pre_lnorm": False, "n_layer": LAYERS,
              "mem_len": 12, "clamp_len": 10, "same_length": True, "attn_type": 0, "sample_softmax": -1,
              "adaptive": True, "dropout": 0.0, "dropatt": 0.0, "untie_r": True, "init": "normal",
              "init_range": 0.01, "proj_init_std": 0.01, "init_std": 0.02, "layer_norm_epsilon": 1e-05,
              "tie_projs": [False, True, True], "eos_token_id": 0, "architectures": ["TransfoXLLMHeadModel"],
              "model_type": "transfo-xl", "transformers_version": "4.35.2"}
    config.update(changes)
    return config


def model_for(config: dict) -> TransformerXL:
    """The project model with the architecture of ``config`` (random weights)."""
    torch.manual_seed(0)
    return TransformerXL(config["vocab_size"], config["n_layer"], config["d_model"], config["n_head"],
                         config["d_inner"], config["d_head"], dropout=0.0, cutoffs=config["cutoffs"],
                         d_embed=config["d_embed"], div_val=config["div_val"], tie_projs=config["tie_projs"],
                         untie_r=config["untie_r"]).double().eval()


def official_state(config: dict, fmt: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the official names, shapes and ties (AdaptiveEmbedding, RelPartialLearnable layers,
    ProjectedAdaptiveLogSoftmax); HF prefixes the body with ``transformer.`` and repeats shared u/v per layer."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3

    body = "transformer." if fmt == "hf" else ""
    d, d_embed, div_val = config["d_model"], config["d_embed"], config["div_val"]
    bounds = [0] + config["cutoffs"] + [config["vocab_size"]]
    widths = [d_embed // div_val**i for i in range(len(bounds) - 1)]
    state: dict[str, torch.Tensor] = {}
    if div_val == 1:
        state[f"{body}word_emb.emb_layers.0.weight"] = rand(config["vocab_size"], d_embed)
        if d_embed != d:
            state[f"{body}word_emb.emb_projs.0"] = rand(d, d_embed)
    else:
        for i, width in enumerate(widths):
            state[f"{body}word_emb.emb_layers.{i}.weight"] = rand(bounds[i + 1] - bounds[i], width)
            state[f"{body}word_emb.emb_projs.{i}"] = rand(d, width)
    shared = None if config["untie_r"] else (rand(HEADS, D_HEAD), rand(HEADS, D_HEAD))
    if shared is not None:
        state[f"{body}r_w_bias"], state[f"{body}r_r_bias"] = shared
    for layer in range(config["n_layer"]):
        p = f"{body}layers.{layer}."
        if config["untie_r"]:
            state[p + "dec_attn.r_r_bias"], state[p + "dec_attn.r_w_bias"] = rand(HEADS, D_HEAD), rand(HEADS, D_HEAD)
        elif fmt == "hf":
            state[p + "dec_attn.r_w_bias"], state[p + "dec_attn.r_r_bias"] = shared
        state[p + "dec_attn.qkv_net.weight"] = rand(3 * HEADS * D_HEAD, d)
        state[p + "dec_attn.o_net.weight"] = rand(d, HEADS * D_HEAD)
        state[p + "dec_attn.layer_norm.weight"] = 1 + rand(d)
        state[p + "dec_attn.layer_norm.bias"] = rand(d)
        state[p + "dec_attn.r_net.weight"] = rand(HEADS * D_HEAD, d)
        state[p + "pos_ff.CoreNet.0.weight"], state[p + "pos_ff.CoreNet.0.bias"] = rand(D_INNER, d), rand(D_INNER)
        state[p + "pos_ff.CoreNet.3.weight"], state[p + "pos_ff.CoreNet.3.bias"] = rand(d, D_INNER), rand(d)
        state[p + "pos_ff.layer_norm.weight"], state[p + "pos_ff.layer_norm.bias"] = 1 + rand(d), rand(d)
    state[f"{body}pos_emb.inv_freq"] = 1 / (10000 ** (torch.arange(0.0, d, 2.0) / d))
    n_clusters = len(bounds) - 2
    if n_clusters:
        state["crit.cluster_weight"], state["crit.cluster_bias"] = rand(n_clusters, d_embed), rand(n_clusters)
    tie_projs = config["tie_projs"]
    if div_val == 1:
        state["crit.out_layers.0.weight"] = state[f"{body}word_emb.emb_layers.0.weight"]  # tie_weight
        state["crit.out_layers.0.bias"] = rand(config["vocab_size"])
        if d_embed != d:
            for i in range(n_clusters + 1):
                state[f"crit.out_projs.{i}"] = (state[f"{body}word_emb.emb_projs.0"] if tie_projs[i]
                                                else rand(d, d_embed))
    else:
        for i, width in enumerate(widths):
            state[f"crit.out_layers.{i}.weight"] = state[f"{body}word_emb.emb_layers.{i}.weight"]
            state[f"crit.out_layers.{i}.bias"] = rand(bounds[i + 1] - bounds[i])
            state[f"crit.out_projs.{i}"] = state[f"{body}word_emb.emb_projs.{i}"] if tie_projs[i] else rand(d, width)
    return state


def project_model_from(config: dict, state: dict, fmt: str) -> TransformerXL:
    """The project model built from the same tensors by hand (kimiyoung's reversed cluster rows flipped)."""
    model, body = model_for(config), "transformer." if fmt == "hf" else ""
    emb, out = model.token_embedding, model.output
    with torch.no_grad():
        if config["div_val"] == 1:
            emb.weight.copy_(state[f"{body}word_emb.emb_layers.0.weight"])
            out.bias.copy_(state["crit.out_layers.0.bias"])
        else:
            for i, table in enumerate(emb.tables):
                table.copy_(state[f"{body}word_emb.emb_layers.{i}.weight"])
            out.bias.copy_(torch.cat([state[f"crit.out_layers.{i}.bias"] for i in range(len(emb.tables))]))
        for i, projection in enumerate(emb.projections):
            projection.copy_(state[f"{body}word_emb.emb_projs.{i}"])
        for i, projection in enumerate(out.projections):
            projection.copy_(state[f"crit.out_projs.{i}"])
        if config["untie_r"]:
            for name, key in (("pos_bias_u", "r_w_bias"), ("pos_bias_v", "r_r_bias")):
                getattr(model, name).copy_(torch.stack([state[f"{body}layers.{i}.dec_attn.{key}"]
                                                        for i in range(config["n_layer"])]))
        else:
            model.pos_bias_u.copy_(state[f"{body}r_w_bias"])
            model.pos_bias_v.copy_(state[f"{body}r_r_bias"])
        for i, layer in enumerate(model.layers):
            p = f"{body}layers.{i}."
            layer.attn.qkv.weight.copy_(state[p + "dec_attn.qkv_net.weight"])
            layer.attn.out.weight.copy_(state[p + "dec_attn.o_net.weight"])
            layer.attn.pos_proj.weight.copy_(state[p + "dec_attn.r_net.weight"])
            layer.attn.norm.weight.copy_(state[p + "dec_attn.layer_norm.weight"])
            layer.attn.norm.bias.copy_(state[p + "dec_attn.layer_norm.bias"])
            layer.ff[0].weight.copy_(state[p + "pos_ff.CoreNet.0.weight"])
            layer.ff[0].bias.copy_(state[p + "pos_ff.CoreNet.0.bias"])
            layer.ff[3].weight.copy_(state[p + "pos_ff.CoreNet.3.weight"])
            layer.ff[3].bias.copy_(state[p + "pos_ff.CoreNet.3.bias"])
            layer.ff_norm.weight.copy_(state[p + "pos_ff.layer_norm.weight"])
            layer.ff_norm.bias.copy_(state[p + "pos_ff.layer_norm.bias"])
        if out.n_clusters:
            flip = (lambda t: t.flip(0)) if fmt == "kimiyoung" else (lambda t: t)
            out.cluster_weight.copy_(flip(state["crit.cluster_weight"]))
            out.cluster_bias.copy_(flip(state["crit.cluster_bias"]))
    return model


def official_log_probs(state: dict, config: dict, hidden: torch.Tensor, reversed_clusters: bool) -> torch.Tensor:
    """``(N, d) -> (N, V)`` straight from the official softmax tensors, as ProjectedAdaptiveLogSoftmax does:
    tail cluster i (1-based) reads head column ``shortlist + i - 1`` (HF forward) or ``-i`` (kimiyoung)."""
    bounds = [0] + config["cutoffs"] + [config["vocab_size"]]

    def part(i):
        if config["div_val"] == 1:
            w, b = state["crit.out_layers.0.weight"], state["crit.out_layers.0.bias"]
            w, b = w[bounds[i] : bounds[i + 1]], b[bounds[i] : bounds[i + 1]]
        else:
            w, b = state[f"crit.out_layers.{i}.weight"], state[f"crit.out_layers.{i}.bias"]
        proj = state.get(f"crit.out_projs.{i}")
        return w, b, (hidden if proj is None else hidden @ proj)

    w, b, h = part(0)
    n_clusters = len(bounds) - 2
    if n_clusters:
        w, b = torch.cat([w, state["crit.cluster_weight"]]), torch.cat([b, state["crit.cluster_bias"]])
    head = torch.log_softmax(h @ w.T + b, -1)
    parts = [head[:, : bounds[1]]]
    for i in range(1, n_clusters + 1):
        w, b, h = part(i)
        column = -i if reversed_clusters else bounds[1] + i - 1
        parts.append(head[:, column, None] + torch.log_softmax(h @ w.T + b, -1))
    return torch.cat(parts, -1)


def stream_log_probs(model: TransformerXL, tokens: torch.Tensor, spec: MemorySpec, seg: int = 5) -> torch.Tensor:
    """Log-probabilities ``(B, T, V)`` segment by segment with carried memory."""
    mems, out = None, []
    with torch.no_grad():
        for start in range(0, tokens.shape[1], seg):
            hidden, mems = model(tokens[:, start : start + seg], mems, spec)
            out.append(model.output.log_prob(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:2], -1))
    return torch.cat(out, 1)


def trip(tag: str) -> None:
    TRIPPED.append(tag)


class Tripwire:
    """Unpickling this object would call ``trip``: a stand-in for code in a vocabulary pickle."""

    def __reduce__(self):
        return trip, ("vocab.pkl ran code",)


def write_hf_dir(directory, config: dict, state: dict) -> None:
    """What ``save_pretrained(safe_serialization=False)`` + ``TransfoXLTokenizer.save_vocabulary`` write."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    torch.save({k: v.float() for k, v in state.items()}, directory / "pytorch_model.bin")
    tokenizer_dict = {"special": ["<eos>"], "min_freq": 0, "max_size": None, "lower_case": False, "delimiter": None,
                      "vocab_file": None, "never_split": [], "language": "en",
                      "punction_without_space_before_pattern": re.compile(r"[^\s][,.]"),
                      "moses_punct_normalizer": Tripwire(), "counter": Counter({s: 1 for s in SYMBOLS}),
                      "idx2sym": list(SYMBOLS), "sym2idx": OrderedDict((s, i) for i, s in enumerate(SYMBOLS)),
                      "unk_idx": len(SYMBOLS) - 1}
    with open(directory / "vocab.pkl", "wb") as f:
        pickle.dump(tokenizer_dict, f)


def write_kimiyoung_cache(path, symbols: list[str], monkeypatch) -> None:
    """``torch.save(corpus)`` of kimiyoung's ``data_utils.Corpus`` holding a ``utils.vocabulary.Vocab``."""
    data_utils, utils, vocabulary = (types.ModuleType(n) for n in ("data_utils", "utils", "utils.vocabulary"))
    data_utils.Corpus = type("Corpus", (), {"__module__": "data_utils"})
    vocabulary.Vocab = type("Vocab", (), {"__module__": "utils.vocabulary"})
    utils.vocabulary = vocabulary
    for name, module in (("data_utils", data_utils), ("utils", utils), ("utils.vocabulary", vocabulary)):
        monkeypatch.setitem(sys.modules, name, module)
    vocab = vocabulary.Vocab()
    vocab.__dict__.update(special=[], min_freq=0, max_size=None, lower_case=False, delimiter=None, vocab_file=None,
                          counter=Counter({s: len(symbols) - i for i, s in enumerate(symbols)}),
                          idx2sym=list(symbols), sym2idx=OrderedDict((s, i) for i, s in enumerate(symbols)))
    corpus = data_utils.Corpus()
    corpus.__dict__.update(dataset="enwik8", vocab=vocab, train=torch.arange(20), valid=torch.arange(5),
                           test=torch.arange(5))
    torch.save(corpus, path)


def kimiyoung_config(**changes) -> dict:
    """kimiyoung WT103-base style: div_val 1 with one projection (d_embed 12 != d_model), shared u/v."""
    return hf_config(div_val=1, d_embed=12, untie_r=False, tie_projs=[False, True, True], **changes)


# --------------------------------------------------------------------------------------------------- tests


def test_hf_checkpoint_imports_with_tokenizer_vocabulary_and_equals_the_model_from_the_same_tensors(tmp_path):
    config = hf_config()
    state = official_state(config, "hf")
    write_hf_dir(tmp_path / "hf", config, state)
    model = model_for(config)
    imported = import_checkpoint(f"hf:{tmp_path / 'hf'}", model)
    assert imported.vocabulary == SYMBOLS and imported.vocabulary_file.name == "vocab.pkl"
    assert TRIPPED == []  # the tokenizer pickle's objects were never built
    float_state = {k: v.float().double() for k, v in state.items()}  # the file stores fp32
    reference = project_model_from(config, float_state, "hf")
    tokens = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    spec = MemorySpec(12, "zeros", same_length=True, clamp_len=10)
    torch.testing.assert_close(stream_log_probs(model, tokens, spec), stream_log_probs(reference, tokens, spec),
                               rtol=0, atol=0)
    hidden = torch.randn(9, D_MODEL, dtype=torch.float64)
    torch.testing.assert_close(model.output.log_prob(hidden), official_log_probs(float_state, config, hidden, False),
                               rtol=0, atol=1e-12)
    # the per-layer u/v of untie_r really differ between layers
    assert not torch.equal(model.pos_bias_u[0], model.pos_bias_u[1])


def test_kimiyoung_state_dict_flips_the_cluster_rows_and_reads_the_corpus_cache(tmp_path, monkeypatch):
    config = kimiyoung_config()
    state = official_state(config, "kimiyoung", seed=3)
    torch.save(state, tmp_path / "model_state.pt")
    write_kimiyoung_cache(tmp_path / "cache.pt", SYMBOLS, monkeypatch)
    model = model_for(config)
    imported = import_checkpoint(f"kimiyoung:{tmp_path / 'model_state.pt'}", model)
    assert imported.vocabulary == SYMBOLS and imported.vocabulary_file.name == "cache.pt"
    hidden = torch.randn(9, D_MODEL, dtype=torch.float64)
    torch.testing.assert_close(model.output.log_prob(hidden), official_log_probs(state, config, hidden, True),
                               rtol=0, atol=1e-12)
    assert not torch.allclose(model.output.log_prob(hidden), official_log_probs(state, config, hidden, False))
    # ties the official code creates are ties here: one embedding projection shared by the tail clusters
    assert model.output.projections[1] is model.token_embedding.projections[0]
    assert model.output.projections[0] is not model.token_embedding.projections[0]
    reference = project_model_from(config, state, "kimiyoung")
    tokens = torch.randint(0, VOCAB, (2, 15), generator=torch.Generator().manual_seed(2))
    spec = MemorySpec(8, "empty", clamp_len=6, trams=TramsSpec(3, 2))
    torch.testing.assert_close(stream_log_probs(model, tokens, spec), stream_log_probs(reference, tokens, spec),
                               rtol=0, atol=0)


def test_pickled_module_is_refused_with_the_state_dict_recipe_and_the_model_is_untouched(tmp_path, monkeypatch):
    config = kimiyoung_config()
    write_kimiyoung_cache(tmp_path / "cache.pt", SYMBOLS, monkeypatch)
    whole = torch.nn.Module()  # torch.save(model) of official train.py: a pickled module, not a dict of tensors
    whole.word_emb = torch.nn.Embedding(VOCAB, 12)
    torch.save(whole, tmp_path / "model.pt")
    model = model_for(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DataError, match="cannot be read that way") as err:
        import_checkpoint(f"kimiyoung:{tmp_path / 'model.pt'}", model)
    message = str(err.value)
    assert "model.pt" in message and "weights_only=True" in message and "Save a state dict" in message
    assert "torch.save(m.state_dict(), 'model_state.pt')" in message
    assert "torch.nn.modules.module.Module" in str(err.value)  # the class it refused to build
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("fault, key", [
    ("missing", "transformer.layers.1.dec_attn.o_net.weight"),
    ("shuffled clusters", "crit.out_layers.1.weight"),
    ("unexpected", "transformer.layers.2.dec_attn.o_net.weight"),
    ("untied twin differs", "crit.out_projs.1"),
])
def test_a_broken_hf_checkpoint_fails_naming_the_key(tmp_path, fault, key):
    config = hf_config()
    state = official_state(config, "hf")
    if fault == "missing":
        del state[key]
    elif fault == "shuffled clusters":  # tail clusters stored in the other order
        for name in ("crit.out_layers.{}.weight", "crit.out_layers.{}.bias"):
            a, b = name.format(1), name.format(2)
            state[a], state[b] = state[b], state[a]
    elif fault == "unexpected":
        state[key] = torch.zeros(D_MODEL, HEADS * D_HEAD)
    else:  # tie_projs says shared, the file holds another matrix
        state[key] = state[key] + 1
    write_hf_dir(tmp_path / "hf", config, state)
    with pytest.raises(DataError, match=re.escape(repr(key))):
        import_checkpoint(f"hf:{tmp_path / 'hf'}", model_for(config))


def test_hf_config_that_disagrees_with_the_model_names_the_model_keys(tmp_path):
    directory = tmp_path / "hf"
    write_hf_dir(directory, hf_config(n_layer=3, untie_r=False), official_state(hf_config(), "hf"))
    with pytest.raises(ConfigError, match=r"model.n_layers=2 but n_layer=3.*model.untie_r=True but untie_r=False"):
        import_checkpoint(f"hf:{directory}", model_for(hf_config()))
    (directory / "config.json").write_text(json.dumps(hf_config()))
    (directory / "vocab.pkl").unlink()
    with pytest.raises(ConfigError, match=r"task.module.init_from: .*no vocabulary in .*vocab.pkl, vocab.bin, vocab.txt"):
        import_checkpoint(f"hf:{directory}", model_for(hf_config()))


def test_vocabulary_files_and_id_mapping(tmp_path):
    (tmp_path / "vocab.txt").write_text("<eos>\nthe 120\n\nof\n")
    with pytest.raises(DataError, match=r"vocab.txt:3: empty line"):
        read_vocabulary(tmp_path / "vocab.txt")
    (tmp_path / "vocab.txt").write_text("<eos>\nthe 120\nof 3\n")
    assert read_vocabulary(tmp_path / "vocab.txt") == ["<eos>", "the", "of"]
    # data ids -> checkpoint ids through the symbols; unknown -> <unk> when the checkpoint has one
    stream = np.array([0, 2, 1, 3], dtype=np.uint8)
    mapped = model_ids(stream, ["<eos>", "a", "the", "zzz"], ["the", "<eos>", "a", "<unk>"], "split 'test'")
    assert mapped.tolist() == [1, 0, 2, 3]
    with pytest.raises(DataError, match=r"split 'test'.*'zzz' \(id 3\)"):
        model_ids(stream, ["<eos>", "a", "the", "zzz"], ["the", "<eos>", "a"], "split 'test'")
    assert model_ids(stream[:3], ["<eos>", "a", "the", "zzz"], ["the", "<eos>", "a"], "x").tolist() == [1, 0, 2]


def test_trams_topk_beyond_the_older_slots_is_an_error_naming_the_keys(make_cfg):
    with pytest.raises(ValueError, match=r"memory.topk=7 exceeds memory.pool - memory.recent_keep = 16 - 10 = 6"):
        MemorySpec(16, trams=TramsSpec(10, 7))
    MemorySpec(16, trams=TramsSpec(10, 6))  # exactly every older slot is fine
    from longseq.runner import build_module

    with pytest.raises(ValueError, match=r"memory.topk=300 exceeds memory.pool - memory.recent_keep"):
        build_module(make_cfg(["task=enwik8", "model=transformer_xl", "memory.selection=trams", "memory.topk=300"]))


def test_pretrained_trams_experiment_imports_a_kimiyoung_checkpoint_and_prints_the_table(make_cfg, tmp_path,
                                                                                       capsys):
    import hydra

    from longseq.runner import build_module, train

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(("def f(x):\n    return x + 1\n" * 200).encode())
    counts = Counter(b for b in corpus.read_bytes() if b != 10)  # Transformer-XL's enwik8 vocabulary: decimal
    symbols = [str(b) for b, _ in counts.most_common()]  # byte values by frequency, newline dropped
    config = hf_config(vocab_size=len(symbols), cutoffs=[], div_val=1, d_embed=D_MODEL, untie_r=False,
                       tie_projs=[False], n_layer=1)
    torch.save(official_state(config, "kimiyoung"), tmp_path / "model_state.pt")
    (tmp_path / "vocab.txt").write_text("".join(f"{s}\n" for s in symbols))
    cfg = make_cfg(["experiment=enwik8/trams_pretrained", f"task.module.init_from=kimiyoung:{tmp_path}/model_state.pt",
                    f"task.data.path={corpus}", "trainer=cpu", f"model.vocab_size={len(symbols)}", "model.n_layers=1",
                    f"model.d_model={D_MODEL}", f"model.n_heads={HEADS}", f"model.d_head={D_HEAD}",
                    f"model.d_inner={D_INNER}", "memory.pool=16", "memory.recent_keep=4", "memory.topk=4",
                    "memory.eval_mem_len=8", "memory.eval_tgt_len=8", "task.data.eval_batch_size=2",
                    "trainer.limit_test_batches=3"])
    metrics = train(cfg)
    for key in ("test/bpc", "test/trams_bpc", "test/mem_mass", "test/trams_mem_mass"):
        assert math.isfinite(metrics[key]), key
    assert metrics["test/tokens"] == 3 * 2 * 7  # hf_in_segment_shift: 7 of 8 targets per segment
    printed = capsys.readouterr().out
    assert "memory settings side by side" in printed and "pool M=16, m=8 (4 newest + top-4" in printed
    # the byte stream reaches the model in the checkpoint's ids (its symbols are decimal byte values)
    module = build_module(cfg)
    assert module.vocabulary == symbols
    datamodule = hydra.utils.instantiate(cfg.task.data)
    datamodule.streams = {"test": np.frombuffer(b"def f", dtype=np.uint8)}
    assert module.model_stream(datamodule, "test").tolist() == [symbols.index(str(b)) for b in b"def f"]


def test_init_from_a_project_checkpoint_still_loads_and_a_mismatch_names_the_key(make_cfg, tmp_path):
    from longseq.runner import build_module, train

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(("def f(x):\n    return x + 1\n" * 200).encode())
    base = ["task=enwik8", "model=transformer_xl", f"task.data.path={corpus}", "trainer=cpu", "model.tgt_len=8",
            "memory.mem_len=8", "task.batch_size=4", "task.data.eval_batch_size=2"]
    ckpt = train(make_cfg(base))["ckpt_path"]
    module = build_module(make_cfg(base + [f"task.module.init_from={ckpt}"]))
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    assert torch.equal(module.net.layers[0].attn.qkv.weight, saved["net.layers.0.attn.qkv.weight"])
    assert module.vocabulary is None  # no symbol mapping for the project's own checkpoints
    with pytest.raises(ConfigError, match=r"task.module.init_from: .*does not match the composed model"):
        build_module(make_cfg(base + ["model.d_model=48", f"task.module.init_from={ckpt}"]))


def write_safetensors_dir(directory, config: dict, state: dict) -> None:
    """What ``save_pretrained()`` writes by default: ``model.safetensors`` holding each storage once (the tied
    ``crit.*`` aliases left out, as HF drops its tied keys), beside config.json and the tokenizer's vocab.pkl."""
    from safetensors.torch import save_file

    write_hf_dir(directory, config, state)
    (directory / "pytorch_model.bin").unlink()
    seen, tensors = set(), {}
    for key, value in state.items():
        if id(value) not in seen:
            seen.add(id(value))
            tensors[key] = value.float().contiguous()
    save_file(tensors, str(directory / "model.safetensors"))


def test_hf_safetensors_checkpoint_imports_like_the_pytorch_bin(tmp_path):
    config = hf_config()
    state = official_state(config, "hf")
    write_hf_dir(tmp_path / "bin", config, state)
    write_safetensors_dir(tmp_path / "st", config, state)
    from_bin, from_st = model_for(config), model_for(config)
    import_checkpoint(f"hf:{tmp_path / 'bin'}", from_bin)
    imported = import_checkpoint(f"hf:{tmp_path / 'st'}", from_st)
    assert imported.weights.name == "model.safetensors"
    for (name, a), b in zip(from_bin.state_dict().items(), from_st.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(from_st.layers[0].attn.qkv.weight, model_for(config).layers[0].attn.qkv.weight)


def check_untouched(model: TransformerXL, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert all(torch.equal(value, after[key]) for key, value in before.items())


@pytest.mark.parametrize("fault", ["last key missing", "vocabulary too short", "layer_norm_epsilon"])
def test_a_failed_import_leaves_the_model_untouched(tmp_path, fault):
    config = hf_config(layer_norm_epsilon=1e-6) if fault == "layer_norm_epsilon" else hf_config()
    state = official_state(hf_config(), "hf")
    if fault == "last key missing":  # every other tensor checks out first
        del state["crit.out_projs.0"]
    write_safetensors_dir(tmp_path / "hf", config, state)
    if fault == "vocabulary too short":
        (tmp_path / "hf" / "vocab.pkl").unlink()
        (tmp_path / "hf" / "vocab.txt").write_text("".join(f"{s}\n" for s in SYMBOLS[:-1]))
    model = model_for(hf_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected = {"last key missing": r"missing key 'crit.out_projs.0'",
                "vocabulary too short": r"vocab.txt: 29 symbols but the checkpoint's vocabulary is 30",
                "layer_norm_epsilon": r"config.json: layer_norm_epsilon=1e-06 but the model's LayerNorms use "
                                      r"eps=1e-05"}[fault]
    with pytest.raises(DataError, match=expected):
        import_checkpoint(f"hf:{tmp_path / 'hf'}", model)
    check_untouched(model, before)


def test_a_corrupt_safetensors_file_is_named(tmp_path):
    config = hf_config()
    write_safetensors_dir(tmp_path / "hf", config, official_state(config, "hf"))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(DataError, match=r"model.safetensors: is not a readable safetensors file"):
        import_checkpoint(f"hf:{tmp_path / 'hf'}", model_for(config))
