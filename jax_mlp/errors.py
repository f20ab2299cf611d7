"""The errors jax_mlp raises: one root, so ``except jax_mlp.OffloadError`` catches every one of them.

Each message names the leaf, path, record or peer at fault and says what to do.
"""


class OffloadError(RuntimeError):
    """Base class of jax_mlp's errors; raised itself for misuse (a stale opt_state, use after close, a
    directory of another run, an optimizer that cannot run exactly) and for I/O that exceeds ``io_timeout``."""


class CoupledOptimizerError(OffloadError):
    """The inner optimizer reads across param leaves (a global norm, a global step size), so running it
    one subgroup of leaves at a time would compute other values than the same optimizer in memory."""


class PathError(OffloadError):
    """A storage path is missing, unwritable, full, too small for its share, or gone."""


class PathInUseError(PathError):
    """A path's run directory is held by another live writer (``mlp_offload``), in this process or another."""


class RecordError(OffloadError):
    """Stored state failed its checks: a record torn, corrupt, or from another step, run or layout;
    a run of another layout on resume; or no step complete on every subgroup."""


class PeerError(OffloadError):
    """Another ``jax.distributed`` process did not reach the same point in time: it died or hangs."""
