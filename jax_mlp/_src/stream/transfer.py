"""How a subgroup's fields move between host memory and a device: through pinned host memory, or plainly.

On a GPU, a plain ``device_put`` of a host array and ``np.asarray`` of a device array stage through a
bounce buffer: JAX users report a few GB/s against some 25 GB/s for raw CUDA copies (jax-ml/jax#21438,
openxla/xla#12452). The **pinned** path moves a device array to its device's ``pinned_host`` memory
kind and hands the writer a zero-copy numpy view of it, as JAX's own array serializer does
(``jax/experimental/array_serialization/tensorstore_impl.py``); host fields go to the device through a
pinned buffer the same way. The **plain** path is ``device_put`` and ``np.asarray``: on a CPU device
it aliases the arrays, where the pinned path would add a copy each way.

``transfer="auto"`` takes the pinned path on GPUs whose devices have a ``pinned_host`` memory and the
plain one elsewhere; ``"pinned"`` forces it wherever the memory kind exists (CPU devices have one too,
which is how the CPU test suite runs this path). Either moves the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jax_mlp._src.errors import OffloadError

_PINNED = "pinned_host"
_GPU_PLATFORMS = ("cuda", "rocm", "gpu")


def has_pinned_host(device: jax.Device) -> bool:
    """Whether ``device`` has a ``pinned_host`` memory kind to stage transfers through."""
    try:
        return any(memory.kind == _PINNED for memory in device.addressable_memories())
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return False


def _default(device: jax.Device | None) -> jax.Device:
    return jax.devices()[0] if device is None else device


def _pinned(device: jax.Device) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device, memory_kind=_PINNED)


class Transfer(NamedTuple):
    """How fields cross between host and device: ``name`` (``"pinned"`` or ``"plain"``) is what the stats report."""

    name: str

    def to_device(self, fields: Any, device: jax.Device | None) -> Any:
        """The host arrays of ``fields`` (any pytree) as arrays in ``device``'s default memory."""
        if self.name == "plain":
            return jax.device_put(fields, device)
        device = _default(device)
        staged = jax.device_put(fields, _pinned(device))
        return jax.device_put(staged, jax.sharding.SingleDeviceSharding(device))

    def to_host(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """``arrays`` (device arrays, or host arrays already) as numpy arrays, waiting for them."""
        if self.name == "pinned":
            on_device = [i for i, x in enumerate(arrays) if isinstance(x, jax.Array)]
            staged = jax.device_put(
                [arrays[i] for i in on_device], [_pinned(next(iter(arrays[i].devices()))) for i in on_device]
            )
            arrays = list(arrays)
            for i, x in zip(on_device, staged, strict=True):
                arrays[i] = x
        return [np.asarray(x) for x in arrays]  # a zero-copy view of host memory, pinned or a CPU device's


def choose(option: str, devices: Sequence[jax.Device]) -> Transfer:
    """The transfer ``option`` (``"auto"``, ``"pinned"`` or ``"plain"``, as ``OffloadConfig.transfer``) takes on ``devices``.

    Raises:
      OffloadError: ``"pinned"`` where a device has no ``pinned_host`` memory.
    """
    pinned = all(has_pinned_host(d) for d in devices)
    if option == "auto":
        return Transfer("pinned" if pinned and all(d.platform in _GPU_PLATFORMS for d in devices) else "plain")
    if option == "pinned" and not pinned:
        missing = next(d for d in devices if not has_pinned_host(d))
        raise OffloadError(
            f"transfer='pinned' needs a pinned_host memory on every device, but {missing} has none: "
            "pass transfer='auto' or 'plain'"
        )
    return Transfer(option)
