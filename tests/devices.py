"""Device-gated test markers (``RunIf``-style, as lightning-hydra-template's): a CPU machine skips these tests, it never
fakes them; on a CUDA machine they run as written."""

from __future__ import annotations

import importlib.util

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_multi_gpu = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA devices")
without_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks how a machine without a GPU refuses one")
without_torch_xla = pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None,
                                       reason="checks how an environment without torch_xla refuses trainer=tpu")
