"""jax_mlp: train with optimizer state streamed from host RAM, NVMe and parallel file systems.

``mlp_offload(inner, paths=...)`` wraps an element-wise optax optimizer; see the README.
"""

from jax_mlp.checkpoint import OffloadCheckpointHandler, OffloadRestore, OffloadSave, restore_params, standard_layout
from jax_mlp.config import OffloadConfig, Path, parse_rate, parse_size
from jax_mlp.errors import CoupledOptimizerError, OffloadError, PathError, PathInUseError, PeerError, RecordError
from jax_mlp.offloader import Offloader, OffloadState
from jax_mlp.quantized import QuantizedState, quantized_state
from jax_mlp.stats import UpdateStats
from jax_mlp.transform import OffloadTransformation, mlp_offload

__all__ = [
    "CoupledOptimizerError",
    "OffloadCheckpointHandler",
    "OffloadConfig",
    "OffloadError",
    "OffloadRestore",
    "OffloadSave",
    "OffloadState",
    "OffloadTransformation",
    "Offloader",
    "Path",
    "PathError",
    "PathInUseError",
    "PeerError",
    "QuantizedState",
    "RecordError",
    "UpdateStats",
    "mlp_offload",
    "parse_rate",
    "parse_size",
    "quantized_state",
    "restore_params",
    "standard_layout",
]

__version__ = "0.1.0"
