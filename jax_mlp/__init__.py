"""jax_mlp: train with optimizer state streamed from host RAM, NVMe and parallel file systems.

``mlp_offload(inner, paths=...)`` wraps an element-wise optax optimizer; see the README.
"""

from jax_mlp.config import OffloadConfig, parse_size
from jax_mlp.stats import UpdateStats
from jax_mlp.tiers import OffloadError, PathError, RecordError
from jax_mlp.transform import Offloader, OffloadState, OffloadTransformation, mlp_offload

__all__ = [
    "OffloadConfig",
    "OffloadError",
    "OffloadState",
    "OffloadTransformation",
    "Offloader",
    "PathError",
    "RecordError",
    "UpdateStats",
    "mlp_offload",
    "parse_size",
]

__version__ = "0.1.0"
