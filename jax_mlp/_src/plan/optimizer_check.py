"""Whether an optax optimizer gives the same math one subgroup at a time, read from its jaxpr.

``mlp_offload`` runs the inner optimizer on one subgroup of param leaves at a time, and on row
chunks (along axis 0) of a leaf larger than the subgroup size. That is the math of the same
optimizer in memory only if each leaf's update and new state depend on that leaf alone
(*leaf-wise*), and, for a row-split leaf, if row ``r`` of them depends on row ``r`` alone
(*row-wise*). :func:`check_optimizer` reads both from ``jax.make_jaxpr`` of ``inner.init`` and
``inner.update`` on the abstract full tree: nothing is computed.

The dependences come from :mod:`~jax_mlp._src.plan.dependencies`, an abstract interpreter of
jaxprs; this module is the policy on top of it. Two passes: the first gives every state leaf its own token and
finds which state leaves belong to which param leaf (connected components of the dependence
graph); the second, with that ownership, follows the row axes. Extra arguments of ``update`` are
inputs that depend on no leaf: every subgroup is given them alike.

Randomness is refused outright: optax draws from one key split over the whole tree, which no key
split per subgroup reproduces.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.extend import core

from jax_mlp._src.errors import CoupledOptimizerError, OffloadError
from jax_mlp._src.plan import partition
from jax_mlp._src.plan.dependencies import UNIFORM, Dep, Propagation

REMEDY = "put global transformations such as clip_by_global_norm before mlp_offload, or use a leaf-wise optimizer"

_RANDOM_PRIMITIVES = frozenset(
    {
        "random_bits",
        "random_fold_in",
        "random_seed",
        "random_split",
        "random_wrap",
        "rng_bit_generator",
        "rng_uniform",
        "threefry2x32",
    }
)


class OptimizerCheck(NamedTuple):
    """What :func:`check_optimizer` found about an optimizer that may be offloaded."""

    whole_leaves: frozenset[int]  # leaves (in tree_leaves order) that must not be row-split
    seconds: float  # time the check took
    # whether inner.update reads the params: its outputs depend on them (adamw's decay), or it asks for them
    reads_params: bool


class _Traced(NamedTuple):
    """The optimizer's jaxprs on the abstract full tree, and what they are about."""

    names: list[str]  # each param leaf's tree path
    leaves: list[jax.ShapeDtypeStruct]  # each param leaf as the inner optimizer sees it
    treedef: Any
    state: Any  # the shapes of inner.init on the full tree
    state_leaves: list[tuple[Any, jax.ShapeDtypeStruct]]  # (path, shape) of each state leaf
    init: core.ClosedJaxpr  # params -> state
    update: core.ClosedJaxpr  # (grads, state, params, extra args) -> (updates, new state)
    num_extra: int  # leaves of the extra arguments


def check_optimizer(
    inner: optax.GradientTransformation,
    params: Any,
    master_dtype: np.dtype | None,
    extra_args: Mapping[str, Any] | None = None,
) -> OptimizerCheck:
    """Checks that ``inner`` gives the same math one subgroup (and one row chunk) at a time; nothing is computed.

    Args:
      inner: the optimizer that ``mlp_offload`` would run on each subgroup's view of the tree.
      params: the param pytree: arrays or ``jax.ShapeDtypeStruct``s; only shapes and dtypes are used.
      master_dtype: the dtype of the master params the inner optimizer is given (gradients come in
        it too), or None for the params' own dtypes.
      extra_args: the extra keyword arguments ``inner.update`` is given (arrays or their shapes),
        the same for every subgroup.

    Returns:
      The leaves that must be kept whole (their updates mix rows), the seconds the check took, and
      whether the update reads the params.

    Raises:
      CoupledOptimizerError: an update or new state leaf of one param leaf depends on another leaf,
        or state shared by all subgroups is computed from the leaves.
      OffloadError: the optimizer draws random numbers or keeps a PRNG key, or it cannot be traced.
    """
    start = time.perf_counter()
    extended = optax.with_extra_args_support(inner)
    traced = _trace(extended, params, master_dtype, dict(extra_args or {}))
    owner = _state_owners(inner, traced)
    whole = _row_coupled(traced, owner)
    reads = _reads_params(traced) or _demands_params(extended, traced, extra_args)
    return OptimizerCheck(whole, time.perf_counter() - start, reads)


def check_extra_args(inner: optax.GradientTransformation, plan: partition.Plan, extra_args: Mapping[str, Any]) -> None:
    """Checks ``inner`` given extra arguments that ``init`` did not check it with, against the plan it made.

    Raises:
      CoupledOptimizerError: given them, the optimizer reads across leaves.
      OffloadError: given them, it mixes the rows of a leaf that the plan cut into row chunks.
    """
    leaves = [jax.ShapeDtypeStruct(spec.shape, spec.dtype) for spec in plan.leaves]
    check = check_optimizer(inner, jax.tree_util.tree_unflatten(plan.treedef, leaves), plan.master_dtype, extra_args)
    split = {p.leaf for sg in plan.subgroups for p in sg.pieces if p.rows is not None}
    mixed = sorted(split & check.whole_leaves)
    if mixed:
        raise OffloadError(
            f"given the extra arguments {sorted(extra_args)}, the inner optimizer mixes the rows of param "
            f"{plan.leaves[mixed[0]].path}, which this plan cuts into row chunks; declare them when creating it, "
            f"mlp_offload(..., extra_args=...), so that init keeps that leaf whole. Otherwise {REMEDY}"
        )


def _trace(inner: optax.GradientTransformationExtraArgs, params: Any, master_dtype, extra_args: dict) -> _Traced:
    """Traces ``inner.init`` and ``inner.update`` on the abstract tree; refuses randomness on the way."""
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [jax.tree_util.keystr(path) for path, _ in path_leaves]
    leaves = [jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(master_dtype or x.dtype)) for _, x in path_leaves]
    abstract = jax.tree_util.tree_unflatten(treedef, leaves)
    init, state = _traced("inner.init", lambda: jax.make_jaxpr(inner.init, return_shape=True)(abstract))
    state_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    _refuse_keys(state, state_leaves)
    extra = {k: jax.ShapeDtypeStruct(np.shape(v), jax.numpy.result_type(v)) for k, v in extra_args.items()}
    update, (updates, new_state) = _traced(
        "inner.update",
        lambda: jax.make_jaxpr(lambda g, s, p, e: inner.update(g, s, p, **e), return_shape=True)(
            abstract, state, abstract, extra
        ),
    )
    if jax.tree_util.tree_structure(updates) != treedef:
        raise OffloadError(f"inner.update returns updates of another tree structure than the params; {REMEDY}")
    if jax.tree_util.tree_structure(new_state) != jax.tree_util.tree_structure(state):
        raise OffloadError(f"inner.update returns a state of another tree structure than inner.init; {REMEDY}")
    for jaxpr in (init.jaxpr, update.jaxpr):
        _refuse_randomness(jaxpr)
    return _Traced(names, leaves, treedef, state, state_leaves, init, update, len(jax.tree.leaves(extra)))


def _traced(what: str, trace: Callable[[], Any]) -> Any:
    """``trace()``, with a failure reported as a refusal, and the remedy that fits what failed."""
    try:
        return trace()
    except Exception as error:
        detail = " ".join(str(error).split())
        detail = detail if len(detail) <= 300 else detail[:297] + "..."
        if what == "inner.init":  # it takes nothing but the params: no extra argument, no global transformation
            remedy = (
                "Most often a tree the optimizer holds (a mask=, multi_transform's labels) does not have the "
                "structure of the params given to init, and plain optax's init would fail alike: build it from "
                "those params, e.g. jax.tree.map(lambda p: p.ndim > 1, params)"
            )
        else:
            remedy = (
                "If it needs extra arguments, declare them: mlp_offload(..., extra_args={'value': "
                "jax.ShapeDtypeStruct((), jnp.float32)}); only arrays can be passed on. Otherwise " + REMEDY
            )
        raise OffloadError(
            f"{what} could not be traced on the abstract param tree ({type(error).__name__}: {detail}), so "
            f"mlp_offload cannot check that it gives the same math one subgroup of leaves at a time. {remedy}"
        ) from error


_RANDOMNESS_REMEDY = (
    "put transformations that draw random numbers, such as optax.add_noise, before mlp_offload, or use a "
    "leaf-wise optimizer without randomness"
)


def _refuse_keys(state: Any, state_leaves: Sequence[tuple[Any, Any]]) -> None:
    """Raises for a typed PRNG key among the state leaves (``noisy_sgd``'s, ``add_noise``'s)."""
    for path, leaf in state_leaves:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise OffloadError(
                f"optimizer state leaf {_describe(state, path)} holds a PRNG key ({leaf.dtype}): the optimizer draws "
                "random numbers, and one subgroup at a time it would split its key over fewer leaves and draw "
                f"other numbers than in memory; {_RANDOMNESS_REMEDY}"
            )


def _refuse_randomness(jaxpr: core.Jaxpr) -> None:
    """Raises for a random-number primitive anywhere in ``jaxpr``, nested jaxprs included."""
    eqn = _random_equation(jaxpr)
    if eqn is not None:
        raise OffloadError(
            f"the optimizer draws random numbers ({eqn.primitive.name} in {_site(eqn) or 'inner.update'}): one "
            f"subgroup at a time it would draw other numbers than in memory; {_RANDOMNESS_REMEDY}"
        )


def _random_equation(jaxpr: core.Jaxpr) -> Any | None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _RANDOM_PRIMITIVES:
            return eqn
        for sub in core.jaxprs_in_params(eqn.params):
            found = _random_equation(sub)
            if found is not None:
                return found
    return None


def _update_outputs(propagation: Propagation, traced: _Traced, params: list[Dep], state: list[Dep]) -> list[Dep]:
    """The deps of ``inner.update``'s outputs (updates, then new state); extra arguments are uniform."""
    return propagation.closed(traced.update, [*params, *state, *params, *[UNIFORM] * traced.num_extra])


def _reads_params(traced: _Traced) -> bool:
    """Whether an output of ``inner.update`` (an update or a new state leaf) depends on the params it is given."""
    n, s = len(traced.names), len(traced.state_leaves)
    tokens = [Dep(frozenset({i}), None) for i in range(n)]
    inputs = [*[UNIFORM] * n, *[UNIFORM] * s, *tokens, *[UNIFORM] * traced.num_extra]
    return any(dep.leaves for dep in Propagation(n).closed(traced.update, inputs))


def _demands_params(inner: optax.GradientTransformation, traced: _Traced, extra_args: Mapping[str, Any] | None) -> bool:
    """Whether ``inner.update`` refuses to run without params, though its outputs may not depend on them
    (optax's weight decay asks for them even at a rate of 0)."""
    grads = jax.tree_util.tree_unflatten(traced.treedef, traced.leaves)
    try:
        jax.eval_shape(lambda g, s, e: inner.update(g, s, None, **e), grads, traced.state, dict(extra_args or {}))
    except Exception:  # any refusal: the params must be given
        return True
    return False


def _state_owners(inner: optax.GradientTransformation, traced: _Traced) -> list[int | None]:
    """Per state leaf, the param leaf it belongs to, or None for state every subgroup holds alike.

    A state leaf belongs to a param leaf if its value follows from that leaf's gradients, params or
    state: they form one connected component of the dependence graph. Other state leaves (counts,
    hyperparameters) depend on no leaf. Raises if a component holds two param leaves, or if state
    that ``inner.init`` gives even a view with no leaves depends on one.
    """
    n, s = len(traced.names), len(traced.state_leaves)
    first = Propagation(n)
    tokens = [Dep(frozenset({i}), None) for i in range(n)]
    init_deps = first.closed(traced.init, tokens)
    outs = _update_outputs(first, traced, tokens, [Dep(frozenset({n + k}), None) for k in range(s)])
    reads = [init_deps[k].leaves | outs[n + k].leaves for k in range(s)]
    dependent = _leaf_dependent(n, reads)
    edges = [(i, t) for i in range(n) for t in outs[i].leaves]
    edges += [(n + k, t) for k in range(s) if dependent[k] for t in reads[k]]
    component = _components(n + s, [(a, b) for a, b in edges if b < n or dependent[b - n]])
    params_of: dict[int, list[int]] = {}
    for i in range(n):
        params_of.setdefault(component[i], []).append(i)
    coupled = next((leaves for leaves in params_of.values() if len(leaves) >= 2), None)
    if coupled is not None:
        raise _coupling_error(traced.names, coupled, first.first_mix)
    owner = [params_of[component[n + k]][0] if dependent[k] else None for k in range(s)]
    _refuse_dependent_shared(inner, traced, owner)
    return owner


def _leaf_dependent(n: int, reads: Sequence[frozenset[int]]) -> list[bool]:
    """Which state leaves depend on a param leaf, directly or through other state leaves (tokens from ``n``)."""
    dependent = [any(t < n for t in r) for r in reads]
    changed = True
    while changed:
        changed = False
        for k, r in enumerate(reads):
            if not dependent[k] and any(t >= n and dependent[t - n] for t in r):
                dependent[k] = changed = True
    return dependent


def _components(size: int, edges: Iterable[tuple[int, int]]) -> list[int]:
    """The connected component (a representative node) of each of ``size`` nodes, by union-find."""
    parent = list(range(size))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        parent[find(b)] = find(a)
    return [find(x) for x in range(size)]


def _coupling_error(names: Sequence[str], coupled: Sequence[int], first_mix: tuple | None) -> CoupledOptimizerError:
    pair, where = list(coupled[:2]), ""
    if first_mix is not None and set(first_mix[1]) <= set(coupled):
        pair = first_mix[1]
        site = _site(first_mix[0])
        where = f" (they meet in {site})" if site else ""
    return CoupledOptimizerError(
        f"the inner optimizer couples param leaves {names[pair[0]]} and {names[pair[1]]}{where}: the update or new "
        "state of one depends on the other, so mlp_offload, which shows it one subgroup of leaves at a time, would "
        f"compute other values than the same optimizer in memory. {REMEDY}"
    )


def _refuse_dependent_shared(inner: optax.GradientTransformation, traced: _Traced, owner: Sequence[int | None]) -> None:
    """Raises if state that even a view with no leaves holds (every subgroup's copy, the handle's) depends on a leaf."""
    if all(o is None for o in owner):
        return
    empty = jax.tree_util.tree_unflatten(traced.treedef, [None] * len(traced.names))
    shared = {path for path, _ in jax.tree_util.tree_flatten_with_path(partition.init_shapes(inner, empty))[0]}
    for (path, _), leaf in zip(traced.state_leaves, owner, strict=True):
        if leaf is not None and path in shared:
            raise CoupledOptimizerError(
                f"the inner optimizer's state {_describe(traced.state, path)} is one value for the whole tree, but its "
                f"new value is computed from param leaf {traced.names[leaf]}: every subgroup holds a copy and is given "
                "the same value, so a subgroup without that leaf (or with a part of it) would compute another value "
                f"than in memory. {REMEDY}"
            )


def _row_coupled(traced: _Traced, owner: Sequence[int | None]) -> frozenset[int]:
    """The leaves of more than one row whose state, update or new state mixes their rows.

    A leaf can be row-split only if each of its state leaves has its rows along axis 0 and each
    output row depends on that row of its inputs alone.
    """
    leaves, n = traced.leaves, len(traced.leaves)

    def rows(shape: tuple[int, ...]) -> int | None:
        return shape[0] if shape else None

    param_deps = [Dep(frozenset({i}), 0 if x.shape else None) for i, x in enumerate(leaves)]
    state_deps = [
        UNIFORM if i is None else Dep(frozenset({i}), 0 if rows(x.shape) == rows(leaves[i].shape) else None)
        for (_, x), i in zip(traced.state_leaves, owner, strict=True)
    ]
    second = Propagation(n)
    init_deps = second.closed(traced.init, param_deps)
    outs = _update_outputs(second, traced, param_deps, state_deps)
    outputs: list[list[Dep]] = [[outs[i]] for i in range(n)]
    for k, i in enumerate(owner):
        if i is not None:
            outputs[i] += [state_deps[k], init_deps[k], outs[n + k]]
    return frozenset(
        i
        for i, x in enumerate(leaves)
        if (rows(x.shape) or 1) > 1 and any(dep.leaves and dep.axis != 0 for dep in outputs[i])
    )


# ----------------------------------------------------------------------------- naming things in messages

_PLUMBING = frozenset(
    {"with_extra_args_support", "chain", "named_chain", "masked", "multi_transform", "partition", "inject_hyperparams"}
)
_INTERNAL = (os.path.dirname(jax.__file__), os.path.abspath(__file__))


def _site(eqn: Any) -> str | None:
    """The transformation an equation was traced in, as ``factory (file:line)``, or None if not known."""
    traceback = eqn.source_info.traceback
    frames = [] if traceback is None else [f for f in traceback.frames if not f.file_name.startswith(_INTERNAL)]
    for frame in frames:
        factory, _, local = frame.function_name.partition(".<locals>.")
        if local and factory not in _PLUMBING:
            return f"{factory} ({_short(frame.file_name)}:{frame.line_num})"
    return f"{frames[0].function_name} ({_short(frames[0].file_name)}:{frames[0].line_num})" if frames else None


def _short(file_name: str) -> str:
    return file_name.rpartition("site-packages/")[2]


def _describe(state: Any, path: Sequence[Any]) -> str:
    """A state leaf's path with the type that holds it, e.g. ``[1].estim_lr (DoGState)``."""
    node, holder = state, None
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            holder, node = type(node).__name__, getattr(node, key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            node = node[key.idx]
        elif isinstance(key, jax.tree_util.DictKey):
            node = node[key.key]
        else:
            break
    name = jax.tree_util.keystr(tuple(path))
    return f"{name} ({holder})" if holder else name
