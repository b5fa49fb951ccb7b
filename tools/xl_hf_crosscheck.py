"""Cross-check the Transformer-XL import against the official Hugging Face forward (``TransfoXLLMHeadModel``).

Builds tiny random HF models (adaptive input/softmax with div_val > 1, d_embed != d_model with tied
projections, shared or per-layer u/v), saves each with ``save_pretrained`` (config.json + pytorch_model.bin)
plus a ``vocab.txt``, imports the directory through ``task.module.init_from=hf:<dir>``'s loader and prints the
max |difference| of the log-probabilities over three segments with carried XL memory (HF semantics: ``mem_len``
zero states, ``same_length``, ``clamp_len`` from the config). HF runs in fp32 (its attention mask fill
overflows in fp64); ours runs in fp32 and in fp64.

``transformers`` is not a project dependency (TransfoXL exists only in transformers <= 4.35 and pins other
versions); install it outside the project and reuse the project's torch::

    .venv/bin/pip install --target /tmp/hfxl "transformers==4.35.2" "tokenizers<0.15,>=0.14" \\
        "huggingface_hub<1.0,>=0.16.4" safetensors regex packaging pyyaml requests tqdm filelock fsspec \\
        typing_extensions --no-deps
    PYTHONPATH=/tmp/hfxl .venv/bin/python tools/xl_hf_crosscheck.py

Exits 1 when a difference exceeds 1e-4.
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import torch

from longseq.models.transformer_xl import MemorySpec, TransformerXL
from longseq.models.xl_import import hf_model_kwargs, import_checkpoint

TOLERANCE = 1e-4
VARIANTS = {
    "div_val=2, per-layer u/v, same_length": dict(div_val=2, d_embed=32, untie_r=True, same_length=True),
    "div_val=1, d_embed 24 != d_model 32, tied projections, shared u/v": dict(
        div_val=1, d_embed=24, untie_r=False, same_length=False),
    "plain softmax (enwik8-like), shared u/v": dict(div_val=1, d_embed=32, untie_r=False, same_length=True,
                                                     cutoffs=[]),
}


def hf_model(directory: Path, seed: int, div_val: int, d_embed: int, untie_r: bool, same_length: bool,
             cutoffs=(10, 20, 30)):
    """A tiny random ``TransfoXLLMHeadModel`` saved into ``directory`` (with a ``vocab.txt``)."""
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    config = TransfoXLConfig(vocab_size=40, cutoffs=list(cutoffs), d_model=32, d_embed=d_embed, n_head=4,
                             d_head=8, d_inner=64, div_val=div_val, n_layer=2, mem_len=12, clamp_len=10,
                             same_length=same_length, untie_r=untie_r, dropout=0.0, dropatt=0.0)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = TransfoXLLMHeadModel(config).eval()
    with torch.no_grad():  # large random weights so that every term matters (in place: ties survive)
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(directory, safe_serialization=False)
    (directory / "vocab.txt").write_text("".join(f"w{i}\n" for i in range(config.vocab_size)))
    return model, config


def compare(directory: Path, hf, config, dtype: torch.dtype, segments: int = 3, seg_len: int = 7) -> float:
    """Max |log p_ours - log p_HF| over ``segments`` segments of a (3, seg_len) batch with carried memory."""
    ours = TransformerXL(**hf_model_kwargs(config.to_dict()))
    import_checkpoint(f"hf:{directory}", ours)
    ours = ours.to(dtype).eval()
    spec = MemorySpec(config.mem_len, "zeros", config.same_length, config.clamp_len)
    torch.manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (3, segments * seg_len))
    mems_ours, mems_hf, worst = None, None, 0.0
    with torch.no_grad():
        for s in range(segments):
            chunk = tokens[:, s * seg_len : (s + 1) * seg_len]
            out = hf(input_ids=chunk, mems=mems_hf)
            mems_hf = out.mems
            hidden, mems_ours = ours(chunk, mems_ours, spec)
            logp = ours.output.log_prob(hidden.reshape(-1, hidden.shape[-1])).view(*chunk.shape, -1)
            worst = max(worst, (logp.double() - out.prediction_scores.double()).abs().max().item())
    return worst


def main() -> int:
    failed = False
    for seed, (name, variant) in enumerate(VARIANTS.items()):
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            hf, config = hf_model(directory, seed, **variant)
            files = sorted(p.name for p in directory.iterdir())
            for dtype in (torch.float64, torch.float32):
                diff = compare(directory, hf, config, dtype)
                ok = diff <= TOLERANCE
                failed |= not ok
                print(f"{name} [ours {str(dtype).removeprefix('torch.')}, HF float32]: max |log p diff| over 3 "
                      f"segments with memory = {diff:.3e} {'ok' if ok else 'FAIL'}  (files: {', '.join(files)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
