"""Agreement among ``jax.distributed`` processes: barriers and shared values, each with a timeout.

Each process offloads only its own shards, so an update never waits on a peer's data. The
processes still agree on two things: that a step is complete everywhere (a barrier at the end of
each update and of ``init``), and which step to resume at. Both go through the distributed
runtime's coordination service, and both give up after a timeout with a :class:`PeerError`, so a
dead peer makes the survivors fail instead of hang.
"""

from __future__ import annotations

import jax
from jax._src import distributed

from jax_mlp._src.errors import PeerError


def _client():
    client = distributed.global_state.client
    if client is None:
        raise PeerError("several jax processes but no jax.distributed client: call jax.distributed.initialize first")
    return client


def _failure(what: str, timeout: float, error: Exception) -> PeerError:
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    return PeerError(
        f"process {jax.process_index()} of {jax.process_count()} reached {what}, but its peers did not within "
        f"peer_timeout={timeout:g}s: a peer process died or hangs ({reason}). Each process's paths keep its last "
        "complete steps: restart every process with resume=True, and they resume at the last step all completed"
    )


def barrier(name: str, timeout: float, what: str) -> None:
    """Waits until every process has called ``barrier(name, ...)``; a single process goes straight on.

    Args:
      name: the barrier's id, the same in every process and never reused.
      timeout: seconds to wait for the slowest process.
      what: the point reached, for the error (e.g. ``"the end of update step 7"``).

    Raises:
      PeerError: a process did not arrive within ``timeout``.
    """
    if jax.process_count() == 1:
        return
    try:
        _client().wait_at_barrier(name, int(timeout * 1000))
    except PeerError:
        raise
    except Exception as error:  # the runtime raises JaxRuntimeError (DEADLINE_EXCEEDED, UNAVAILABLE, ...)
        raise _failure(what, timeout, error) from error


def all_values(name: str, value: str, timeout: float, what: str) -> list[str]:
    """Publishes ``value`` under ``name`` and returns every process's value, in process order.

    Raises:
      PeerError: a process did not publish within ``timeout``.
    """
    client = _client()
    client.key_value_set(f"{name}/{jax.process_index()}", value)
    try:
        return [
            client.blocking_key_value_get(f"{name}/{index}", int(timeout * 1000))
            for index in range(jax.process_count())
        ]
    except Exception as error:
        raise _failure(what, timeout, error) from error
