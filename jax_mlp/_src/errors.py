"""The errors jax_mlp raises: one root, so ``except jax_mlp.OffloadError`` catches every one of them.

That covers bad input (an option's value, a tree that does not match the params given to ``init``,
a leaf that is not floating point, a layout that cannot run inside ``jax.jit``), misuse, stored
state that fails its checks, failing paths and peers. Each message names the option, leaf, path,
record or peer at fault and says what to do. ``OffloadError`` is a ``ValueError`` (code that
catches ``ValueError`` for bad input keeps working) and a ``RuntimeError``.

Not covered: an argument of the wrong Python type (a ``bool`` as a size, an ``extra_args`` value
that is not an array, an unknown keyword of ``mlp_offload``) raises ``TypeError``; an error the
inner optimizer raises as it updates (optax's ``adamw`` called without params, say) passes through
as it is; and the ``jax-mlp report`` command's ``LogError``, a ``ValueError`` of its own, is about
a log file, not about training.
"""


class OffloadError(RuntimeError, ValueError):
    """Base class of jax_mlp's errors; raised itself for bad input (an option's value, a tree or leaf that
    does not match the params given to ``init``), for misuse (a stale opt_state, use after close, a directory
    of another run, an optimizer that cannot run exactly) and for I/O that exceeds ``io_timeout``."""


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
