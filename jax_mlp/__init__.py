"""jax_mlp: train with optimizer state streamed from host RAM, NVMe and parallel file systems.

``mlp_offload(inner, paths=...)`` wraps an element-wise optax optimizer; see the README. Every public
name is here, in ``__all__``, and in two namespaces: ``jax_mlp.quantized`` (the state codecs) and
``jax_mlp.report`` (plots of a ``log_to`` file). The implementation in ``jax_mlp._src`` is private and
may change at any time.
"""

import importlib as _importlib
import warnings as _warnings

from jax_mlp._src.checkpoint.handler import OffloadCheckpointHandler, OffloadRestore, OffloadSave
from jax_mlp._src.checkpoint.layout import standard_layout
from jax_mlp._src.config import OffloadConfig, OffloadOptions, Path
from jax_mlp._src.errors import CoupledOptimizerError, OffloadError, PathError, PathInUseError, PeerError, RecordError
from jax_mlp._src.layered import LayerStack, LayerStream, nnx_layer_stack, stream_layers
from jax_mlp._src.parsing import format_bytes, parse_rate, parse_size
from jax_mlp._src.plan.partition import Plan
from jax_mlp._src.state import OffloadState
from jax_mlp._src.state_codecs import QuantizedState, quantized_state
from jax_mlp._src.stats import IOEvent, UpdateStats
from jax_mlp._src.storage.tier_stack import Pin
from jax_mlp._src.transform import OffloadTransformation, mlp_offload, restore_params

__all__ = [
    "CoupledOptimizerError",
    "IOEvent",
    "LayerStack",
    "LayerStream",
    "OffloadCheckpointHandler",
    "OffloadConfig",
    "OffloadError",
    "OffloadOptions",
    "OffloadRestore",
    "OffloadSave",
    "OffloadState",
    "OffloadTransformation",
    "Path",
    "PathError",
    "PathInUseError",
    "PeerError",
    "Pin",
    "Plan",
    "QuantizedState",
    "RecordError",
    "UpdateStats",
    "format_bytes",
    "mlp_offload",
    "nnx_layer_stack",
    "parse_rate",
    "parse_size",
    "quantized_state",
    "restore_params",
    "standard_layout",
    "stream_layers",
]

__version__ = "0.3.0"

for _name in __all__:  # tracebacks, reprs and help() name the public path: jax_mlp.OffloadError, not jax_mlp._src...
    globals()[_name].__module__ = __name__


# Names removed from the face, each with its replacement and the release that drops it (CHANGELOG.md).
_DEPRECATED = {
    "Offloader": (
        "jax_mlp.Offloader is deprecated and goes in 0.4 (after 2027-06-01): the object mlp_offload returns is the "
        "one handle (update, apply, overlap, flush, close, stats, pin, plan, scheduler, ...)",
        "jax_mlp._src.offload.offloader",
    ),
}


def __getattr__(name: str):
    """The public namespaces ``quantized`` and ``report``, imported on first use (``report`` needs matplotlib), and
    the deprecated names, with a ``DeprecationWarning``."""
    if name in ("quantized", "report"):
        return _importlib.import_module(f"jax_mlp.{name}")
    if name in _DEPRECATED:
        message, module = _DEPRECATED[name]
        _warnings.warn(message, DeprecationWarning, stacklevel=2)
        return getattr(_importlib.import_module(module), name)
    raise AttributeError(f"module 'jax_mlp' has no attribute {name!r}")
