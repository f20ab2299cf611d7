"""The face of the layer-streamed step: ``stream_layers``, ``LayerStack`` and the flax NNX adapter.

``stream_layers(stack, inner, paths=...)`` trains a model whose params, grads and optimizer state
all live in the tiers, streamed a layer at a time (see ``offload/layers.py``); it takes the options
of ``mlp_offload`` and returns a :class:`~jax_mlp._src.offload.layers.LayerStream`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal, Unpack

import jax
import optax

from jax_mlp._src.config import OffloadConfig, OffloadOptions
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.offload.layers import LayerStream
from jax_mlp._src.plan.layer_programs import LayerStack
from jax_mlp._src.stats import UpdateStats, stats_callback

__all__ = ["LayerStack", "LayerStream", "nnx_layer_stack", "stream_layers"]


def stream_layers(
    stack: LayerStack,
    inner: optax.GradientTransformation,
    *,
    max_grad_norm: float | None = None,
    clipping: Literal["speculate", "defer"] = "speculate",
    microbatches: int = 1,
    activations: Literal["device", "pinned_host"] | os.PathLike = "device",
    resume: bool = False,
    on_stats: Callable[[UpdateStats], None] | None = None,
    log_to: str | os.PathLike | None = None,
    **options: Unpack[OffloadOptions],
) -> LayerStream:
    """Trains a stack of identical layers with its params, grads and optimizer state in the tiers.

    Each step is a loop of jitted per-layer programs driven from the host: the forward reads each
    layer's params from the tiers (host cache first, the next layers read ahead), the backward reads
    them again in reverse and recomputes inside each layer, and each layer's grads go to the update
    as soon as its backward returns. The update writes the new state and params to the tiers (its last
    writes running on into the next step's forward, which commits it), so a model larger than host RAM
    trains with about two layers of params on the device. The math is
    ``optax.chain(optax.clip_by_global_norm(max_grad_norm), inner)`` on the whole model (without the
    clipping when ``max_grad_norm`` is None), the grads being the micro-batches' mean.

    Args:
      stack: the model: ``embed``, ``layer`` and ``head`` (see :class:`LayerStack`).
      inner: an element-wise optax optimizer, as for :func:`~jax_mlp.mlp_offload`. It sees the tree
        ``{"layers": [layer_0, ..., layer_{L-1}], "outer": outer}``.
      max_grad_norm: clip the grads to this global norm, as ``optax.clip_by_global_norm`` does.
      clipping: when a step's update runs, the global norm being known only once its backward ends:
        ``"speculate"`` (the default) updates during the backward on the unclipped grads, and when the
        clipping fires undoes the update and runs the backward again with the grads scaled;
        ``"defer"`` writes each layer's grads to the tiers and updates each layer just before the next
        step's forward computes with it (GreedySnake's order: never redone, but the grads are written and
        read every step). Both give the same bits; docs/layers.md says when each wins.
      microbatches: split each batch into this many micro-batches along axis 0; each layer runs them
        all before the next (layer-major), and their grads are averaged in order.
      activations: where each layer's input waits between the forward and the backward: ``"device"``
        (the default), or ``"pinned_host"`` for long sequences, whose inputs would crowd the device:
        each is copied out as the forward makes it and back one layer ahead of its backward; or a
        directory (a ``pathlib.Path``), whose files hold them (written as the forward makes them, read one
        layer ahead of the backward), for inputs that would crowd host RAM too.
      resume: reopen the tiers at their last complete step.
      on_stats: called with each step's :class:`~jax_mlp.UpdateStats`.
      log_to: a file for one JSON line per ``init`` and step, as for ``mlp_offload``.
      **options: the options of :class:`~jax_mlp.OffloadConfig` (``paths`` is required).

    Returns:
      A :class:`LayerStream`: ``init(outer, layers)`` or ``init(outer, layer_init=..., num_layers=L)``,
      then ``loss, state = stream.step(state, batch)``.

    Example:
      >>> import tempfile
      >>> import jax, jax.numpy as jnp, optax, jax_mlp
      >>> stack = jax_mlp.LayerStack(
      ...     embed=lambda outer, batch: batch["x"] @ outer["w_in"],
      ...     layer=lambda p, x: x + jnp.tanh(x @ p["w"]),
      ...     head=lambda outer, x, batch: jnp.mean((x @ outer["w_out"] - batch["y"]) ** 2))
      >>> outer = {"w_in": jnp.full((3, 4), 0.5), "w_out": jnp.full((4, 1), 0.25)}
      >>> layers = {"w": jnp.full((6, 4, 4), 0.1)}  # 6 layers, stacked on axis 0
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 1))}
      >>> with jax_mlp.stream_layers(stack, optax.adam(0.1), paths=[tempfile.mkdtemp()]) as stream:
      ...   state = stream.init(outer, layers)
      ...   for _ in range(3):
      ...     loss, state = stream.step(state, batch)
      ...     print(f"loss {loss:.3f}")
      loss 39.739
      loss 0.518
      loss 0.001
    """
    config = OffloadConfig.of(options, "stream_layers")
    on_stats = stats_callback(on_stats, log_to, resume=resume)
    return LayerStream(
        stack,
        inner,
        config,
        max_grad_norm=max_grad_norm,
        clipping=clipping,
        microbatches=microbatches,
        activations=activations,
        resume=resume,
        on_stats=on_stats,
    )


def nnx_layer_stack(
    outer: Any,
    blocks: Any,
    *,
    embed: Callable[[Any, Any], Any],
    head: Callable[[Any, Any, Any], Any],
) -> tuple[LayerStack, Any, Any]:
    """A :class:`LayerStack` of flax NNX modules, and its outer params and stacked layers' params.

    Args:
      outer: an ``nnx.Module`` holding every param outside the layers (embedding, final norm, head).
      blocks: the layers as one ``nnx.Module`` whose params are stacked on axis 0, as ``nnx.vmap`` (or
        ``nnx.scan`` over a layer constructor) makes them; each layer is that module's graph with one
        layer's params, called as ``block(x)``.
      embed: ``embed(outer_module, batch) -> x``.
      head: ``head(outer_module, x, batch) -> loss``, a scalar.

    Returns:
      ``(stack, outer_params, layers_params)``: give the stack to :func:`stream_layers` and the params to
      its ``init``. The params are ``nnx.State`` trees; :meth:`LayerStream.params` gives them back in kind.

    Raises:
      OffloadError: a module holds state other than ``nnx.Param`` (batch statistics, RNG counters), which
        a layer-streamed step would neither update nor offload.
    """
    from flax import nnx  # flax is an optional dependency

    def split(module: Any, name: str) -> tuple[Any, Any]:
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        if jax.tree_util.tree_leaves(rest):
            raise OffloadError(
                f"the {name} module holds state other than nnx.Param ({sorted(type(v).__name__ for v in rest.flat_state().values())[:3]}): "
                "a layer-streamed step offloads and updates params only; drop that state or make it a Param"
            )
        return graphdef, params

    outer_def, outer_params = split(outer, "outer")
    block_def, layer_params = split(blocks, "blocks")
    stack = LayerStack(
        embed=lambda o, batch: embed(nnx.merge(outer_def, o), batch),
        layer=lambda p, x: nnx.merge(block_def, p)(x),
        head=lambda o, x, batch: head(nnx.merge(outer_def, o), x, batch),
    )
    return stack, outer_params, layer_params
