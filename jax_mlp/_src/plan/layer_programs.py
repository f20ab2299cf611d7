"""The per-layer programs of a layer-streamed model, and what they are given.

:class:`LayerStack` is the model as three pure functions; :class:`LayerPrograms` jits them per layer:
the forward, the backward with recompute (``jax.vjp`` of the layer on its kept input), the embedding
and its backward, the head with its grads. The micro-batches' grads are averaged in their order
(:func:`micro_mean`), each leaf's sum of squares taken as ``optax.global_norm`` takes it
(:func:`squares`) and the clipping applied as ``optax.clip_by_global_norm`` applies it (:func:`clipped`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_mlp._src.errors import OffloadError


class LayerStack(NamedTuple):
    """A model as a stack of identical layers between outer params: three pure functions.

    Attributes:
      embed: ``embed(outer, batch) -> x``, the activations entering layer 0.
      layer: ``layer(layer_params, x) -> x``, one layer; every layer has params of the same tree and shapes.
      head: ``head(outer, x, batch) -> loss``, a scalar, from the last layer's output.
    """

    embed: Callable[[Any, Any], Any]
    layer: Callable[[Any, Any], Any]
    head: Callable[[Any, Any, Any], jax.Array]

    def loss(self, tree: Any, batch: Any) -> jax.Array:
        """The whole model's loss on the model tree ``{"layers": [layer_0, ...], "outer": outer}``, as one function:
        what a layer-streamed step computes, for a reference held in memory (``jax.grad`` of it)."""
        x = self.embed(tree["outer"], batch)
        for params in tree["layers"]:
            x = self.layer(params, x)
        return self.head(tree["outer"], x, batch)


class LayerPrograms:
    """The per-layer programs of one stack: forward, backward with recompute, the embedding and the head."""

    def __init__(self, stack: LayerStack):
        self.layer = jax.jit(stack.layer)
        self.embed = jax.jit(stack.embed)

        @jax.jit
        def layer_backward(params: Any, x: Any, gy: Any) -> tuple[Any, Any]:
            _, vjp = jax.vjp(stack.layer, params, x)
            gp, gx = vjp(gy)
            return gx, gp

        @jax.jit
        def embed_backward(outer: Any, batch: Any, gx: Any) -> Any:
            _, vjp = jax.vjp(lambda o: stack.embed(o, batch), outer)
            return vjp(gx)[0]

        self.layer_backward = layer_backward
        self.embed_backward = embed_backward
        self.head = jax.jit(jax.value_and_grad(stack.head, argnums=(0, 1)))


@jax.jit
def micro_mean(grads: Sequence[Any]) -> Any:
    """The mean of the micro-batches' grads, summed in their order, in float32 (then each leaf's dtype)."""
    total = grads[0]
    total = jax.tree.map(lambda g: g.astype(jnp.float32), total)
    for g in grads[1:]:
        total = jax.tree.map(lambda t, x: t + x.astype(jnp.float32), total, g)
    return jax.tree.map(lambda t, g: (t / len(grads)).astype(g.dtype), total, grads[0])


@jax.jit
def squares(leaves: Sequence[jax.Array]) -> list[jax.Array]:
    """Each leaf's sum of squares, as ``optax.global_norm`` sums it (``optax``'s ``abs_sq``)."""
    return [jnp.sum((x.conj() * x).real) for x in leaves]


@jax.jit
def clipped(leaves: Sequence[jax.Array], norm: jax.Array, max_norm: float) -> list[jax.Array]:
    """The leaves as ``optax.clip_by_global_norm(max_norm)`` gives them for a global norm ``norm``."""
    trigger = jnp.squeeze(norm < max_norm)
    return [jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm) for t in leaves]


def split_batch(batch: Any, microbatches: int) -> list[Any]:
    """``batch`` cut into ``microbatches`` equal parts along axis 0."""
    if microbatches == 1:
        return [batch]
    sizes = {x.shape[0] for x in jax.tree_util.tree_leaves(batch)}
    if len(sizes) != 1 or sizes.pop() % microbatches:
        raise OffloadError(f"the batch's leading axis must be one size divisible by microbatches={microbatches}")
    parts = jax.tree.map(lambda x: jnp.asarray(x).reshape(microbatches, -1, *x.shape[1:]), batch)
    return [jax.tree.map(lambda x, m=m: x[m], parts) for m in range(microbatches)]


def check_closure(layer: Callable[[Any, Any], Any]) -> None:
    """Refuses a layer function that closes over arrays (in its closure, or bound by ``functools.partial``):
    every layer's program would carry them as constants, neither trained nor offloaded."""
    held = [_cell(cell) for cell in getattr(layer, "__closure__", None) or ()]
    if isinstance(layer, functools.partial):
        held += [*layer.args, *layer.keywords.values()]
    arrays = [x for x in jax.tree_util.tree_leaves(held) if isinstance(x, jax.Array | np.ndarray) and x.size > 1]
    if arrays:
        shapes = ", ".join(str(tuple(x.shape)) for x in arrays)
        raise OffloadError(
            f"the layer function closes over arrays (shapes {shapes}): every layer's program would carry them as "
            "constants, and they would not be trained or offloaded. Pass them in the layer's params (or the "
            "outer params), or make them Python numbers"
        )


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return None
