"""Input checks: the trees a user hands in, against the plan made at ``init``.

One validator serves ``update`` (grads and params) and the checkpoint helpers (``params_like``),
so every mismatch is reported alike: which leaves are missing or unexpected, which leaf has the
wrong shape or dtype, and what to pass instead. The memory kinds are checked too: params at
``init`` in device memory or ``pinned_host``, and each call's grads and params where the params
were at ``init``.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_mlp._src.errors import OffloadError
from jax_mlp._src.plan.partition import Plan, treedef_paths
from jax_mlp._src.plan.sharding import HOST_MEMORY, MEMORY_KINDS, memory_kind


def bare_treedef(treedef: Any) -> Any:
    """``treedef`` without flax NNX ``Variable`` nodes: the structure ``nnx.Optimizer`` hands ``update``.

    ``nnx.Optimizer`` calls ``init`` on a state of ``Variable``s but ``update`` on their plain arrays
    (``nnx.as_pure``); a ``Variable`` has one child, so both trees have the same leaves in the same
    order, and either is accepted for the other. flax is only consulted if already imported.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or not hasattr(nnx, "as_pure"):
        return treedef
    skeleton = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
    return jax.tree_util.tree_structure(nnx.as_pure(skeleton))


def same_tree(treedef: Any, expected: Any) -> bool:
    """Whether ``treedef`` is ``expected``, or is once both are stripped of NNX ``Variable``s (see :func:`bare_treedef`)."""
    return treedef == expected or bare_treedef(treedef) == bare_treedef(expected)


def is_traced(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is a tracer (the call is inside jit or another transformation)."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


def check_has_leaves(params: Any) -> None:
    """Refuses a tree with no leaves: there would be nothing to offload."""
    if not jax.tree_util.tree_leaves(params):
        raise OffloadError(
            "params has no leaves, so there is no optimizer state to offload: pass init the tree of the arrays to "
            "train (with flax nnx, nnx.state(model, nnx.Param))"
        )


def _structure_mismatch(treedef: Any, plan: Plan) -> str:
    names = set(treedef_paths(bare_treedef(treedef)))
    expected = set(treedef_paths(bare_treedef(plan.treedef)))
    missing, extra = sorted(expected - names), sorted(names - expected)
    detail = f"missing leaves {missing[:5]}" if missing else ""
    detail += ("; " if detail and extra else "") + (f"unexpected leaves {extra[:5]}" if extra else "")
    return detail or "the containers differ"


def check_tree(plan: Plan, tree: Any, name: str, *, check_dtype: bool) -> list:
    """The leaves of ``tree``, checked against the params given to ``init``.

    Args:
      plan: the plan made at ``init``.
      tree: grads, params, or their ``jax.ShapeDtypeStruct``s: of the structure given to ``init``, or
        that structure with its NNX ``Variable``s given as plain arrays (see :func:`bare_treedef`).
      name: what ``tree`` is, for the error ("grads", "params", "params_like").
      check_dtype: whether each leaf must have the param's dtype (grads may have any float dtype).

    Returns:
      The leaves, as given.

    Raises:
      OffloadError: the structure, a shape or a dtype differs, or a leaf is not floating point.
    """
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not same_tree(treedef, plan.treedef):
        raise OffloadError(
            f"the {name} tree does not match the params tree given to init: {_structure_mismatch(treedef, plan)}. "
            f"Pass {name} with exactly the structure of the params"
        )
    leaves = []
    for (_, leaf), spec in zip(path_leaves, plan.leaves, strict=True):
        shape = tuple(np.shape(leaf))
        if shape != spec.shape:
            raise OffloadError(
                f"{name} leaf {spec.path} has shape {shape}, but the param had shape {spec.shape} at init; pass {name} "
                "of the params' shapes (another shape needs a new mlp_offload)"
            )
        dtype = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
        if check_dtype and dtype != spec.dtype:
            raise OffloadError(
                f"{name} leaf {spec.path} has dtype {dtype}, but the param had dtype {spec.dtype} at init ({spec.path} "
                f"is {dtype}{list(shape)}, expected {spec.dtype}{list(spec.shape)}); the offloaded state was laid out "
                "for that dtype: keep it, or start a new run"
            )
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise OffloadError(
                f"{name} leaf {spec.path} has dtype {dtype}, but only floating-point leaves can be optimized: cast it "
                "to the param's floating dtype, or keep integer arrays out of the tree given to the optimizer"
            )
        leaves.append(leaf)
    return leaves


def check_update_inputs(plan: Plan, updates: Any, params: Any) -> tuple[list, list | None]:
    """The grad and param leaves of an ``update`` call as jax arrays (or tracers), checked against the plan."""
    grads = [jnp.asarray(x) for x in check_tree(plan, updates, "grads", check_dtype=False)]
    if params is None and plan.master_dtype is not None:
        raise OffloadError("mlp_offload with master_dtype needs params: call tx.update(grads, opt_state, params)")
    if params is None:
        return grads, None
    return grads, [jnp.asarray(x) for x in check_tree(plan, params, "params", check_dtype=True)]


def check_param_memory(params: Any, accumulate_steps: int) -> None:
    """Refuses, at ``init``, param leaves in a memory kind the offload does not stream, and accumulation in host memory.

    ``unpinned_host`` is refused: a jitted step returns its outputs in device memory whatever it
    asks for there, so grads cannot be kept in it, and donating its buffers aborts the process.

    Raises:
      OffloadError: naming the first such leaf, its memory kind, and where to put it instead.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        kind, name = memory_kind(leaf), jax.tree_util.keystr(path)
        if kind not in MEMORY_KINDS:
            raise OffloadError(
                f"param leaf {name} is in {kind} memory, but mlp_offload streams params and grads kept in one of "
                f"{', '.join(MEMORY_KINDS)}: keep them in host memory with jax.device_put(params, "
                f"sharding.with_memory_kind({HOST_MEMORY!r})) (a jitted step returns {kind} outputs in device memory, "
                "so its grads could not stay there), or in device memory"
            )
        if kind == HOST_MEMORY and accumulate_steps > 1:
            raise OffloadError(
                f"param leaf {name} is in {kind} memory, and mlp_offload has accumulate_steps={accumulate_steps}: "
                "accumulation keeps its running mean beside params in device memory only. Accumulate the "
                "micro-batches' gradients in your jitted step (e.g. a lax.scan over them) and create the mlp_offload "
                "without accumulate_steps, or keep the params in device memory"
            )


def check_memory_kinds(plan: Plan, kinds: tuple[str, ...], grads: list, params: list | None) -> None:
    """Refuses a call's grads and params in other memory kinds than each other, or than the params at ``init``.

    Every leaf streams in the memory kind ``init`` saw, and its updates (or new params) come back in it.

    Raises:
      OffloadError: naming the leaf, its memory kinds, and how to put it where the params are.
    """
    for index, (spec, kind) in enumerate(zip(plan.leaves, kinds, strict=True)):
        grad = memory_kind(grads[index])
        param = grad if params is None else memory_kind(params[index])
        if grad != param:
            raise OffloadError(
                f"grads leaf {spec.path} is in {grad} memory, but params leaf {spec.path} is in {param}: params and "
                "grads must share one memory kind, the one the updates come back in. Have the jitted gradient step "
                "write the grads where the params are (jax.jit(..., out_shardings=<the params' shardings>)), or move "
                "them there with jax.device_put(grads, <the params' shardings>)"
            )
        if grad != kind:
            which = "grads" if params is None else "params and grads"
            scalar = (
                " (jax computes on 0-d arrays in device memory, so optax.apply_updates moves a scalar param there: "
                "use tx.apply, or jax.jit(optax.apply_updates, out_shardings=<the params' shardings>))"
                if not spec.shape
                else ""
            )
            raise OffloadError(
                f"{which} leaf {spec.path} is in {grad} memory, but the params were in {kind} at init, and each leaf "
                f"streams in the memory kind init saw: pass it in {kind} (jax.device_put(x, "
                f"x.sharding.with_memory_kind({kind!r}))){scalar}, or start a new mlp_offload for params in {grad} memory"
            )


def check_distinct(plan: Plan, grads: list, params: list) -> None:
    """Refuses an array given twice among the params and grads of an ``apply``, which consumes them all.

    Raises:
      OffloadError: naming the two leaves that are one array.
    """
    seen: dict[int, str] = {}
    for name, leaves in (("params", params), ("grads", grads)):
        for leaf, spec in zip(leaves, plan.leaves, strict=True):
            where = f"{name} leaf {spec.path}"
            if id(leaf) in seen:
                raise OffloadError(
                    f"{where} is the same array as {seen[id(leaf)]}; apply donates the params and frees the grads, so "
                    "each must be its own array: pass a copy (jnp.copy), or use update and optax.apply_updates"
                )
            seen[id(leaf)] = where


def check_shared(shapes: Any, shared: Any) -> list:
    """The leaves of an ``OffloadState.shared``, checked against ``shapes`` and cast to their dtypes.

    Raises:
      OffloadError: the user replaced the shared state by one of another structure or shapes.
    """
    expected = jax.tree_util.tree_leaves(shapes)
    leaves, treedef = jax.tree_util.tree_flatten(shared)
    if not same_tree(treedef, jax.tree_util.tree_structure(shapes)) or any(
        jnp.shape(x) != e.shape for x, e in zip(leaves, expected, strict=True)
    ):
        raise OffloadError(
            f"the shared state of the opt_state passed to update ({treedef}) is not the one init returned "
            f"({jax.tree_util.tree_structure(shapes)} of shapes {[e.shape for e in expected]}); change its values, "
            "keeping their structure and shapes, e.g. state.hyperparams['learning_rate'] = 1e-4"
        )
    return [jnp.asarray(x, e.dtype) for x, e in zip(leaves, expected, strict=True)]


def extra_arrays(extra_args: dict[str, Any]) -> dict[str, jax.Array]:
    """The extra arguments of an ``update`` call as arrays (or tracers).

    Raises:
      OffloadError: one is not an array or a number (a callable ``obj_fn``, say).
    """
    for name, value in extra_args.items():
        if not isinstance(value, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)):
            raise OffloadError(
                f"update got the extra argument {name}={type(value).__name__}; mlp_offload passes only arrays on to "
                "the inner optimizer, the same to every subgroup: pass it as an array, or use it outside mlp_offload"
            )
    return {name: jnp.asarray(value) for name, value in extra_args.items()}


def check_float_leaves(params: Any) -> None:
    """Refuses integer and boolean param leaves before anything is planned or written: no update can move them.

    Raises:
      OffloadError: naming the first such leaf and how to leave it out of the optimizer's tree.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise OffloadError(
                f"param leaf {jax.tree_util.keystr(path)} has dtype {dtype}; only floating-point leaves can be "
                "optimized. Hand mlp_offload only the trainable float leaves: with flax nnx, nnx.state(model, "
                "nnx.Param) (nnx.Optimizer(model, tx, wrt=nnx.Param)); otherwise split the tree, e.g. "
                "equinox.partition(params, equinox.is_inexact_array). optax.masked does not leave a leaf out here: "
                "mlp_offload plans every leaf of the tree it is given"
            )


def check_master_dtype(leaves: list[Any], master_dtype: np.dtype | None) -> None:
    """Refuses a ``master_dtype`` that every param leaf already has: the master would be the params again.

    Such a master costs a second copy of the params in every record, and buys nothing: the update
    ``master - p`` applied with ``optax.apply_updates`` lands up to one ulp off the master on some
    elements, so bit-for-bit resume from the master would not hold. (Leaves of that dtype in a tree
    of lower-precision params keep a master, with that caveat; see docs/usage.md.)

    Raises:
      OffloadError: saying to leave ``master_dtype`` unset.
    """
    if master_dtype is not None and all(jnp.result_type(x) == master_dtype for x in leaves):
        raise OffloadError(
            f"master_dtype={master_dtype}, but every param leaf is already {master_dtype}: the master would be a "
            "second copy of the params, and optax.apply_updates(params, updates) can land one ulp off it. Leave "
            "master_dtype unset: the inner optimizer then updates the params themselves, exactly as plain optax "
            "does (checkpoint the params beside it to restart)"
        )
