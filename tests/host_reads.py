"""A check that fails on any read of a tensor's values by the host: on a GPU each one is a device-to-host sync that
stalls the launch queue, so a training step must have none. CPU tests run the step under ``NoHostReads``, which
raises on the ops that read values (``.item()``, ``bool(t)``, ``int(t)``), on ops whose output shape depends on the
values (``nonzero``, ``masked_select``, ``unique``, ``bincount``, boolean indexing) and on ``Tensor.cpu``,
``.numpy``, ``.tolist`` (the copies to the host)."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

VALUE_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
DATA_DEPENDENT_SHAPES = {aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default,
                         aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
                         aten.bincount.default, aten.repeat_interleave.Tensor, aten.histc.default}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class HostRead(AssertionError):
    """A tensor's values were read on the host (a device-to-host sync on a GPU)."""


class NoHostReads(TorchDispatchMode):
    """Raise ``HostRead`` naming the op on any host read of tensor values inside the context."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in VALUE_READS or func in DATA_DEPENDENT_SHAPES:
            raise HostRead(f"{func} reads tensor values on the host")
        if func in INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                raise HostRead(f"{func} with a boolean index: a data-dependent shape, read on the host")
        return func(*args, **kwargs)

    def __enter__(self):
        self._patched = {name: getattr(torch.Tensor, name) for name in ("cpu", "numpy", "tolist")}
        for name in self._patched:
            setattr(torch.Tensor, name, _refuse(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._patched.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)


def _refuse(name: str):
    def refused(self, *args, **kwargs):
        raise HostRead(f"Tensor.{name}() copies values to the host")

    return refused


class NoDeviceReads(NoHostReads):
    """``NoHostReads`` for tensors on a device only: a table a layer builds on the host (CPU tensors) and moves is no
    device read; what an XLA or CUDA step must not do is read a tensor on its device, which the meta device stands
    for in CPU tests (its ops follow the non-CPU branches, and it has no values to read)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [x for x in pytree.tree_leaves((args, kwargs or {})) if isinstance(x, torch.Tensor)]
        if tensors and all(x.device.type == "cpu" for x in tensors):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def __enter__(self):
        self._patched = {name: getattr(torch.Tensor, name) for name in ("cpu", "numpy", "tolist")}
        for name, method in self._patched.items():
            setattr(torch.Tensor, name, _refuse_on_device(name, method))
        return TorchDispatchMode.__enter__(self)


def _refuse_on_device(name: str, method):
    def refused(self, *args, **kwargs):
        if self.device.type != "cpu":
            raise HostRead(f"Tensor.{name}() copies values from {self.device} to the host")
        return method(self, *args, **kwargs)

    return refused
