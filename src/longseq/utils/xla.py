"""``trainer=tpu`` (Lightning's XLA accelerator) where it can run: a TPU, or XLA's CPU device (``PJRT_DEVICE=CPU``).

Lightning's ``XLAAccelerator`` counts TPU chips only, so on a machine without one it is unavailable even with
``PJRT_DEVICE=CPU``, where torch_xla runs the same traced graphs on the host. ``XLACPUAccelerator`` is that
accelerator with the runtime's own device count: the rest of Lightning's XLA path (``SingleDeviceXLAStrategy`` /
``XLAStrategy``, ``XLAPrecision``, the mark steps of its loops, ``XLACheckpointIO``) runs unchanged, which is how
``make xla-check`` runs ``python train.py trainer=tpu`` on a CPU machine. torch_xla is not a dependency of the
project (its newest release needs torch 2.9.0): ``INSTALL`` says how to get it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from lightning.pytorch.accelerators import XLAAccelerator

INSTALL = ("install it with the torch it was built for: make xla-check builds .venv-xla (torch 2.9.0 + torch_xla "
           "2.9.0, tools/constraints/xla.txt), or on a TPU VM: pip install -c tools/constraints/xla.txt "
           "'torch_xla[tpu]' -e .")


def torch_xla_installed() -> bool:
    """Whether torch_xla can be imported here (without importing it: that starts its runtime)."""
    return importlib.util.find_spec("torch_xla") is not None


def xla_cpu_requested() -> bool:
    """Whether torch_xla's runtime is asked to run on the host (``PJRT_DEVICE=CPU``)."""
    return os.environ.get("PJRT_DEVICE", "").upper() == "CPU"


def tpu_chips() -> int:
    """TPU chips attached through PCI (torch_xla's own count, private API): read from /sys, where Lightning's
    ``XLAAccelerator.is_available`` also asks the cloud metadata server for the TPU version, a network request on a
    machine without a TPU."""
    from torch_xla._internal import tpu

    return tpu.num_available_chips()


def tpu_missing() -> str | None:
    """Why ``trainer.accelerator=tpu`` cannot run here, None when it can: on XLA's CPU device, or on a TPU."""
    if not torch_xla_installed():
        return f"'tpu' needs torch_xla, which is not installed in this environment; {INSTALL}"
    if xla_cpu_requested() or tpu_chips() > 0:
        return None
    return ("'tpu' asks for a device this machine does not have (no TPU chip attached); set PJRT_DEVICE=CPU to run "
            "the XLA path on XLA's CPU device, or use trainer=cpu")


# torch_xla's TPU discovery from environment variables instead of the cloud metadata server; a type that names no TPU
# version makes its version query raise OSError, which Lightning's availability check catches (False)
NO_TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "none"}


def tpu_accelerator() -> str | XLAAccelerator:
    """What ``trainer.accelerator=tpu`` becomes: ``XLACPUAccelerator()`` with ``PJRT_DEVICE=CPU``, else ``"tpu"``.

    On XLA's CPU device Lightning still asks ``XLAAccelerator.is_available`` (to log whether a TPU is there), whose
    TPU version query is a request to the cloud metadata server; ``NO_TPU_ENV`` answers it from the environment."""
    if not xla_cpu_requested():
        return "tpu"
    for key, value in NO_TPU_ENV.items():
        os.environ.setdefault(key, value)
    return XLACPUAccelerator()


def trainer_accelerator(trainer_cfg: Any) -> dict[str, Any]:
    """The ``accelerator`` argument that replaces ``trainer.accelerator`` when a Trainer is built (the run's, and the
    pre-flight's that runs Lightning's checks): ``tpu_accelerator()`` for ``tpu``; nothing to replace otherwise."""
    return {"accelerator": tpu_accelerator()} if trainer_cfg.get("accelerator") == "tpu" else {}


class XLACPUAccelerator(XLAAccelerator):
    """Lightning's XLA accelerator on XLA's CPU device (``PJRT_DEVICE=CPU``): the devices are the runtime's, and the
    device check counts them instead of TPU chips."""

    @staticmethod
    def auto_device_count() -> int:
        from torch_xla import runtime

        return runtime.global_runtime_device_count()

    @staticmethod
    def is_available() -> bool:
        return torch_xla_installed() and xla_cpu_requested()

    @staticmethod
    def parse_devices(devices: int | str | list[int]) -> int | list[int]:
        count = XLACPUAccelerator.auto_device_count()
        if devices in ("auto", -1, "-1"):
            return count
        parsed = int(devices) if isinstance(devices, (int, str)) else list(devices)
        if isinstance(parsed, int) and 1 <= parsed <= count or isinstance(parsed, list) and len(parsed) == 1:
            return parsed
        raise ValueError(f"trainer.devices={devices!r}: XLA's CPU device has {count} device(s) here (set "
                         "CPU_NUM_DEVICES=<n> for more; one device or all of them)")

    @staticmethod
    def get_parallel_devices(devices: int | list[int]) -> list:
        import torch

        devices = XLACPUAccelerator.parse_devices(devices)
        if isinstance(devices, int):
            return [torch.device("xla", i) for i in range(devices)]
        return [torch.device("xla", devices[0])]
