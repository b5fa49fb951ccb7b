"""Global-batch arithmetic shared by every datamodule."""

from __future__ import annotations


def per_device_batch_size(global_batch: int, world_size: int, accumulate: int = 1, key: str = "task.data.batch_size") -> int:
    """Per-device micro-batch so that ``micro * world_size * accumulate == global_batch``.

    Raises a ``ValueError`` naming ``key`` when the global batch does not divide evenly.
    """
    denom = world_size * accumulate
    if global_batch < 1 or global_batch % denom:
        raise ValueError(
            f"{key}={global_batch} (global batch) must be a positive multiple of devices x "
            f"accumulate_grad_batches = {world_size} x {accumulate} = {denom}"
        )
    return global_batch // denom
