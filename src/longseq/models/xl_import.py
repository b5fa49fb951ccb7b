"""Import the released Transformer-XL checkpoints into ``TransformerXL``, with their vocabularies.

Two official layouts (``task.module.init_from=<format>:<path>``):

- ``hf:<dir>`` -- a Hugging Face ``transfo-xl`` directory (e.g. ``transfo-xl-wt103``): ``config.json``,
  ``model.safetensors`` (what ``save_pretrained`` writes by default; tied aliases left out) or
  ``pytorch_model.bin`` (``model.safetensors`` first when both are there, as HF does) and the tokenizer's vocabulary, ``vocab.pkl`` (what ``TransfoXLTokenizer.save_vocabulary`` writes), ``vocab.bin``
  (torch-saved) or ``vocab.txt`` (one symbol per line). Keys ``transformer.*`` / ``crit.*``; adaptive-softmax
  cluster logits in forward order.
- ``kimiyoung:<file>`` -- a state dict of kimiyoung/transformer-xl's ``MemTransformerLM`` (keys without
  prefix, ``r_w_bias`` / ``r_r_bias`` shared by all layers, cluster logits read in *reverse* order, so their
  rows are flipped here). The official ``train.py`` pickles the whole module (``torch.save(model)``): that
  file cannot be read without running its code, so it is refused with the one-line conversion to run where
  the code is trusted. The vocabulary comes from ``vocab.txt`` or the corpus cache ``cache.pt`` that the
  official ``data_utils.get_lm_corpus`` writes, placed next to the state dict.

Every file is read with ``torch.load(weights_only=True)`` or ``safetensors`` (``cache.pt`` with data-only
stand-ins for the corpus and vocabulary classes; ``vocab.pkl`` with an unpickler that builds nothing but plain
containers). Every tensor is mapped to exactly one model parameter and shape-checked; the first missing,
unexpected or mismatched key is named in the error. The import is staged: the model is written only after the
config, every key and the vocabulary checked out, so a failed import leaves it exactly as it was.
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from longseq.data.text import stream_dtype
from longseq.models.transformer_xl import TransformerXL
from longseq.utils.errors import ConfigError, DataError

log = logging.getLogger(__name__)

FORMATS = ("hf", "kimiyoung")
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # HF loads safetensors first
HF_VOCABULARIES = ("vocab.pkl", "vocab.bin", "vocab.txt")  # TransfoXLTokenizer's priority order
KIMIYOUNG_VOCABULARIES = ("vocab.txt", "cache.pt")
CONVERT_HINT = ("python -c \"import torch; m = torch.load('model.pt', weights_only=False); "
                "torch.save(m.state_dict(), 'model_state.pt')\"")


@dataclass(frozen=True)
class Entry:
    """One official tensor: ``key`` in the file -> model parameter ``target`` (``index``: a row or slice of
    it); ``flip`` reverses the rows (kimiyoung's reversed cluster order)."""

    key: str
    target: str
    index: int | slice | None = None
    flip: bool = False


@dataclass
class ImportedCheckpoint:
    """What ``import_checkpoint`` read: the vocabulary (id -> symbol), the files, and the HF config."""

    vocabulary: list[str]
    weights: Path
    vocabulary_file: Path
    config: dict[str, Any]


def parse_init_from(init_from: str) -> tuple[str, Path] | None:
    """``"hf:<dir>"`` / ``"kimiyoung:<file>"`` -> (format, path); anything else (a Lightning .ckpt) -> None."""
    prefix, sep, rest = init_from.partition(":")
    if not sep or prefix not in FORMATS:
        return None
    if not rest:
        raise ConfigError("task.module.init_from", f"{init_from!r} names no path after '{prefix}:'")
    return prefix, Path(rest).expanduser()


# ---------------------------------------------------------------------------------------------- names


def architecture(model: TransformerXL) -> dict[str, Any]:
    """The hyper-parameters of ``model`` that a checkpoint fixes, in the names of the HF config."""
    emb, out = model.token_embedding, model.output
    shared = [len(out.projections) > i and any(out.projections[i] is p for p in emb.projections)
              for i in range(out.n_clusters + 1)]
    return {"vocab_size": model.vocab_size, "n_layer": model.n_layers, "d_model": model.d_model,
            "n_head": model.n_heads, "d_head": model.d_head, "d_inner": model.layers[0].ff[0].out_features,
            "d_embed": emb.d_embed, "div_val": emb.div_val, "cutoffs": emb.bounds[1:-1],
            "untie_r": model.untie_r, "pre_lnorm": model.pre_lnorm,
            "tie_word_embeddings": (out.weight is emb.weight) if emb.div_val == 1 else
            all(a is b for a, b in zip(out.tables, emb.tables)), "tie_projs": shared}


# HF config name -> the model= key that sets it (for error messages).
MODEL_KEYS = {"vocab_size": "model.vocab_size", "n_layer": "model.n_layers", "d_model": "model.d_model",
              "n_head": "model.n_heads", "d_head": "model.d_head", "d_inner": "model.d_inner",
              "d_embed": "model.d_embed", "div_val": "model.div_val", "cutoffs": "model.cutoffs",
              "untie_r": "model.untie_r", "pre_lnorm": "model.pre_lnorm",
              "tie_word_embeddings": "model.tie_weight", "tie_projs": "model.tie_projs"}


def normalized_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` with the older spellings of early ports (``n_token``, ``tie_weight``) renamed and
    TransfoXLConfig's defaults filled in."""
    config = dict(config)
    for old, new in (("n_token", "vocab_size"), ("tie_weight", "tie_word_embeddings")):
        if old in config:
            config.setdefault(new, config.pop(old))
    config.setdefault("tie_word_embeddings", True)
    config.setdefault("untie_r", True)
    config.setdefault("div_val", 4)  # TransfoXLConfig's default
    config.setdefault("d_embed", config.get("d_model"))
    return config


def hf_model_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """``TransformerXL`` arguments of an HF ``config.json`` (e.g. to build the model a checkpoint needs)."""
    config = normalized_hf_config(config)
    return {"vocab_size": config["vocab_size"], "n_layers": config["n_layer"], "d_model": config["d_model"],
            "n_heads": config["n_head"], "d_head": config["d_head"], "d_inner": config["d_inner"],
            "d_embed": config["d_embed"], "div_val": config["div_val"],
            "cutoffs": list(config.get("cutoffs", [])), "tie_weight": config["tie_word_embeddings"],
            "tie_projs": list(config.get("tie_projs") or []), "untie_r": config["untie_r"],
            "pre_lnorm": config.get("pre_lnorm", False), "dropout": 0.0, "dropatt": 0.0}


def check_hf_config(model: TransformerXL, config: dict[str, Any], where: Path) -> None:
    """Raise naming every ``model.*`` key that disagrees with the checkpoint's ``config.json``."""
    if config.get("attn_type", 0) != 0:
        raise DataError(where, f"attn_type={config['attn_type']}; only attn_type 0 (relative attention, "
                         "the released models) is supported")
    if config.get("sample_softmax", -1) > 0:
        raise DataError(where, f"sample_softmax={config['sample_softmax']} is not supported")
    eps = model.layers[0].attn.norm.eps
    if "layer_norm_epsilon" in config and not math.isclose(float(config["layer_norm_epsilon"]), eps, rel_tol=1e-6):
        # TransformerXL has no key for it (every released model uses 1e-5); a different eps changes every output.
        raise DataError(where, f"layer_norm_epsilon={config['layer_norm_epsilon']} but the model's LayerNorms use "
                               f"eps={eps:g} (the released Transformer-XL value); this checkpoint was trained "
                               "with another epsilon and would not reproduce its numbers")
    ours = architecture(model)
    expected = normalized_hf_config(config)
    n_parts = len(ours["cutoffs"]) + 1
    has_projections = expected["div_val"] > 1 or expected["d_embed"] != expected["d_model"]
    tie_projs = list(expected.get("tie_projs") or [])[:n_parts]
    expected["tie_projs"] = [bool(t) and has_projections for t in tie_projs + [False] * (n_parts - len(tie_projs))]
    wrong = [k for k in MODEL_KEYS if k in expected and list_or_value(expected[k]) != list_or_value(ours[k])]
    if wrong:
        listed = "; ".join(f"{MODEL_KEYS[k]}={ours[k]} but {k}={expected[k]}" for k in wrong)
        raise ConfigError(MODEL_KEYS[wrong[0]], f"{where} does not describe the configured model: {listed} (pick "
                                                "the matching model=transformer_xl_* config or override those keys)")


def list_or_value(x: Any) -> Any:
    return [list_or_value(v) for v in x] if isinstance(x, (list, tuple)) else x


def official_entries(model: TransformerXL, fmt: str) -> list[Entry]:
    """Every official key of ``fmt`` for ``model``, in the order the file's tensors are assigned. A
    parameter named by several keys (tied embeddings / projections, HF's shared u/v repeated in every layer)
    is loaded from the first; later keys are its aliases and must agree when present."""
    body = "transformer." if fmt == "hf" else ""
    emb, out = model.token_embedding, model.output
    entries: list[Entry] = []
    if emb.div_val == 1:
        entries.append(Entry(f"{body}word_emb.emb_layers.0.weight", "token_embedding.weight"))
    else:
        entries += [Entry(f"{body}word_emb.emb_layers.{i}.weight", f"token_embedding.tables.{i}")
                    for i in range(len(emb.tables))]
    entries += [Entry(f"{body}word_emb.emb_projs.{i}", f"token_embedding.projections.{i}")
                for i in range(len(emb.projections))]
    if model.untie_r:
        for layer in range(model.n_layers):
            entries.append(Entry(f"{body}layers.{layer}.dec_attn.r_w_bias", "pos_bias_u", layer))
            entries.append(Entry(f"{body}layers.{layer}.dec_attn.r_r_bias", "pos_bias_v", layer))
    else:
        entries += [Entry(f"{body}r_w_bias", "pos_bias_u"), Entry(f"{body}r_r_bias", "pos_bias_v")]
        if fmt == "hf":  # HF registers the shared pair in every attention module too
            for layer in range(model.n_layers):
                entries.append(Entry(f"{body}layers.{layer}.dec_attn.r_w_bias", "pos_bias_u"))
                entries.append(Entry(f"{body}layers.{layer}.dec_attn.r_r_bias", "pos_bias_v"))
    for layer in range(model.n_layers):
        src, dst = f"{body}layers.{layer}.", f"layers.{layer}."
        pairs = [("dec_attn.qkv_net.weight", "attn.qkv.weight"), ("dec_attn.r_net.weight", "attn.pos_proj.weight"),
                 ("dec_attn.o_net.weight", "attn.out.weight"), ("dec_attn.layer_norm.weight", "attn.norm.weight"),
                 ("dec_attn.layer_norm.bias", "attn.norm.bias"), ("pos_ff.CoreNet.0.weight", "ff.0.weight"),
                 ("pos_ff.CoreNet.0.bias", "ff.0.bias"), ("pos_ff.CoreNet.3.weight", "ff.3.weight"),
                 ("pos_ff.CoreNet.3.bias", "ff.3.bias"), ("pos_ff.layer_norm.weight", "ff_norm.weight"),
                 ("pos_ff.layer_norm.bias", "ff_norm.bias")]
        entries += [Entry(src + a, dst + b) for a, b in pairs]
    if out.n_clusters:
        entries += [Entry("crit.cluster_weight", "output.cluster_weight", flip=fmt == "kimiyoung"),
                    Entry("crit.cluster_bias", "output.cluster_bias", flip=fmt == "kimiyoung")]
    if out.div_val == 1:
        entries += [Entry("crit.out_layers.0.weight", "output.weight"), Entry("crit.out_layers.0.bias", "output.bias")]
    else:
        for i in range(len(out.tables)):
            entries.append(Entry(f"crit.out_layers.{i}.weight", f"output.tables.{i}"))
            entries.append(Entry(f"crit.out_layers.{i}.bias", "output.bias", slice(out.bounds[i], out.bounds[i + 1])))
    entries += [Entry(f"crit.out_projs.{i}", f"output.projections.{i}") for i in range(len(out.projections))]
    return entries


# -------------------------------------------------------------------------------------------- weights


def unpickling_reason(err: Exception) -> str:
    """The informative part of a ``weights_only`` failure (``unsupported global mem_transformer.MemTransformerLM``)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if found:
        return f"unsupported global {found.group(1)}"
    return next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)


def load_tensors(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    """A flat ``{key: tensor}`` state dict from ``path``, without running code from the file."""
    if not path.is_file():
        raise ConfigError("task.module.init_from", f"{fmt}:{path}: no such file")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except SafetensorError as err:
            raise DataError(path, f"is not a readable safetensors file ({err})") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = unpickling_reason(err)
        raise DataError(
            path, f"cannot be read that way (torch.load(weights_only=True): {reason}). It is probably a whole "
            "pickled model, what the official train.py saves with torch.save(model); loading it would run code "
            "from the file. Save a state dict once, where that code is trusted (inside kimiyoung/transformer-xl/"
            f"pytorch): {CONVERT_HINT}, then pass {fmt}:model_state.pt") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DataError(path, f"holds a {type(state).__name__}, not a state dict of tensors; save a state "
                         f"dict: {CONVERT_HINT}")
    return state


def staged_weights(model: TransformerXL, state: dict[str, torch.Tensor], fmt: str,
                   source: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Check an official state dict against ``model`` (see ``official_entries``) without writing anything;
    returns the ``(parameter view, tensor)`` copies to make. Raises naming the first missing, unexpected or
    mismatched key, or a model parameter that no key fills."""
    params = dict(model.named_parameters(remove_duplicate=False))
    entries = official_entries(model, fmt)
    known = {e.key for e in entries}
    inv_freq = ("transformer." if fmt == "hf" else "") + "pos_emb.inv_freq"  # a buffer the model recomputes
    for key in state:
        if key not in known and key != inv_freq:
            raise DataError(source, f"unexpected key {key!r} (no parameter of the configured model takes it; "
                             "check model.n_layers, model.untie_r, model.div_val, model.cutoffs)")
    if inv_freq in state:
        expected = 1.0 / 10000 ** (torch.arange(0, model.d_model, 2, dtype=torch.float64) / model.d_model)
        if state[inv_freq].shape != expected.shape or not torch.allclose(state[inv_freq].double(), expected,
                                                                         rtol=1e-5):
            raise DataError(source, f"{inv_freq} is not the sinusoid frequency table of d_model="
                             f"{model.d_model} (shape {tuple(state[inv_freq].shape)})")
    staged: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, str]] = {}  # slot -> (view, tensor, key)
    for entry in entries:
        param = params[entry.target]
        view = param.data if entry.index is None else param.data[entry.index]
        slot = (id(param), str(entry.index))
        tensor = state.get(entry.key)
        if tensor is None:
            if slot in staged:
                continue  # an alias the file leaves out (tied weights; safetensors files always drop them)
            raise DataError(source, f"missing key {entry.key!r} (model parameter {entry.target}, shape "
                             f"{tuple(view.shape)})")
        if tuple(tensor.shape) != tuple(view.shape):
            raise DataError(source, f"key {entry.key!r} has shape {tuple(tensor.shape)} but model parameter "
                             f"{entry.target}{'' if entry.index is None else f'[{entry.index}]'} has "
                             f"{tuple(view.shape)} (check the cluster order and model.* sizes)")
        tensor = (tensor.flip(0) if entry.flip else tensor).to(view.dtype)
        if slot in staged:
            if not torch.equal(tensor, staged[slot][1]):
                raise DataError(source, f"key {entry.key!r} differs from {staged[slot][2]!r}, which the "
                                 "configured model ties it to (model.tie_weight / model.tie_projs / untie_r)")
            continue
        staged[slot] = (view, tensor, entry.key)
    filled = {pid for pid, _ in staged}
    for name, param in params.items():
        if id(param) not in filled:
            raise DataError(source, f"model parameter {name} has no counterpart in {fmt} checkpoints "
                             "(model.pre_lnorm=true adds a final LayerNorm the released models lack)")
    return [(view, tensor) for view, tensor, _ in staged.values()]


# ------------------------------------------------------------------------------------------ vocabulary


class Opaque:
    """Stands in for any non-container object of a vocabulary pickle (regexes, normalizers): built from
    nothing, so no code of the file runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:
        return Opaque()


class ContainerUnpickler(pickle.Unpickler):
    """Unpickles plain data only: builtins containers, ``Counter`` and ``OrderedDict``; every other class
    becomes an inert ``Opaque``."""

    SAFE = {("collections", "OrderedDict"): OrderedDict, ("collections", "Counter"): Counter,
            ("builtins", "set"): set, ("builtins", "frozenset"): frozenset}

    def find_class(self, module: str, name: str) -> Any:
        return self.SAFE.get((module, name), Opaque)


class CorpusRecord:
    """Data-only stand-in for kimiyoung's ``data_utils.Corpus`` while reading ``cache.pt``."""


class VocabRecord:
    """Data-only stand-in for kimiyoung's ``utils.vocabulary.Vocab`` while reading ``cache.pt``."""


def symbols_of(obj: Any, path: Path) -> list[str]:
    """``idx2sym`` of a vocabulary dict / object (or of a corpus' ``vocab``)."""
    if isinstance(obj, CorpusRecord):
        obj = getattr(obj, "vocab", None)
    table = obj.get("idx2sym") if isinstance(obj, dict) else getattr(obj, "idx2sym", None)
    if not isinstance(table, list) or not all(isinstance(s, str) for s in table):
        raise DataError(path, "no vocabulary list (idx2sym of a TransfoXL tokenizer / kimiyoung Vocab)")
    return table


def read_vocabulary(path: Path) -> list[str]:
    """Symbols by id from an official vocabulary file: ``vocab.txt`` (first field of each line),
    ``vocab.pkl`` (pickled tokenizer dict), ``vocab.bin`` (torch-saved tokenizer dict) or ``cache.pt``
    (kimiyoung's torch-saved corpus)."""
    if path.suffix == ".txt":
        symbols = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            fields = line.split()
            if not fields:
                raise DataError(path, "empty line (one symbol per line, id = line number - 1)", number)
            symbols.append(fields[0])
        return symbols
    if path.suffix == ".pkl":
        with open(path, "rb") as f:
            return symbols_of(ContainerUnpickler(f).load(), path)
    stand_ins = [(CorpusRecord, "data_utils.Corpus"), (VocabRecord, "utils.vocabulary.Vocab"), Counter]
    try:
        with torch.serialization.safe_globals(stand_ins):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise DataError(path, f"cannot be read with torch.load(weights_only=True) ({unpickling_reason(err)}); "
                         "write the vocabulary as vocab.txt (one symbol per line) instead") from None
    return symbols_of(obj, path)


def find_file(folder: Path, names: tuple[str, ...], what: str, init_from: str) -> Path:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise ConfigError("task.module.init_from", f"{init_from}: no {what} in {folder} (expected one of "
                            f"{', '.join(names)})")


def import_checkpoint(init_from: str, model: TransformerXL) -> ImportedCheckpoint:
    """Load ``hf:<dir>`` / ``kimiyoung:<file>`` into ``model`` (in place) and read its vocabulary; on any
    error the model is left untouched."""
    parsed = parse_init_from(init_from)
    if parsed is None:
        raise ConfigError("task.module.init_from", f"{init_from!r}: expected one of "
                         f"{', '.join(f + ':<path>' for f in FORMATS)}")
    fmt, path = parsed
    config: dict[str, Any] = {}
    if fmt == "hf":
        if not path.is_dir():
            raise ConfigError("task.module.init_from", f"{init_from}: {path} is not a directory (expected "
                                    "config.json, model.safetensors|pytorch_model.bin and "
                                    "vocab.pkl|vocab.bin|vocab.txt)")
        config_file = find_file(path, ("config.json",), "config.json", init_from)
        config = json.loads(config_file.read_text())
        check_hf_config(model, config, config_file)
        weights = find_file(path, HF_WEIGHTS, "weights", init_from)
        vocab_file = find_file(path, HF_VOCABULARIES, "vocabulary", init_from)
    else:
        weights = path
        vocab_file = find_file(path.parent, KIMIYOUNG_VOCABULARIES, "vocabulary", init_from)
    state = load_tensors(weights, fmt)
    writes = staged_weights(model, state, fmt, str(weights))
    vocabulary = read_vocabulary(vocab_file)
    if len(vocabulary) != model.vocab_size:
        raise DataError(vocab_file, f"{len(vocabulary)} symbols but the checkpoint's vocabulary is "
                         f"{model.vocab_size} (model.vocab_size)")
    with torch.no_grad():  # every check passed: only now is the model written
        for view, tensor in writes:
            view.copy_(tensor)
    log.info(f"imported {fmt} checkpoint {weights} with {len(vocabulary)} symbols from {vocab_file}")
    return ImportedCheckpoint(vocabulary, weights, vocab_file, config)


def model_ids(stream: np.ndarray, data_symbols: list[str], model_symbols: list[str], where: str) -> np.ndarray:
    """Token ids of a datamodule (symbols ``data_symbols``) -> the checkpoint's ids (``model_symbols``),
    ``(T,) -> (T,)`` in the smallest dtype that holds them. A symbol the checkpoint lacks becomes its
    ``<unk>`` / ``<UNK>``; without one, a stream that contains it is an error naming the symbol."""
    model_index = {symbol: i for i, symbol in enumerate(model_symbols)}
    unk = model_index.get("<unk>", model_index.get("<UNK>", -1))
    table = np.asarray([model_index.get(symbol, unk) for symbol in data_symbols], dtype=np.int64)
    stream = np.asarray(stream)
    unmapped = np.flatnonzero(table < 0)
    if unmapped.size:
        hits = np.isin(stream, unmapped)
        if hits.any():
            first = int(stream[int(np.argmax(hits))])
            raise DataError(where, f"token {data_symbols[first]!r} (id {first}) is not in the checkpoint's "
                                   "vocabulary, which has no <unk>")
    return table.clip(min=0).astype(stream_dtype(len(model_symbols)))[stream]
