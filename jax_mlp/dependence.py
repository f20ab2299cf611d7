"""Whether an optax optimizer gives the same math one subgroup at a time, read from its jaxpr.

``mlp_offload`` runs the inner optimizer on one subgroup of param leaves at a time, and on row
chunks (along axis 0) of a leaf larger than the subgroup size. That is the math of the same
optimizer in memory only if each leaf's update and new state depend on that leaf alone
(*leaf-wise*), and, for a row-split leaf, if row ``r`` of them depends on row ``r`` alone
(*row-wise*). :func:`check_optimizer` reads both from ``jax.make_jaxpr`` of ``inner.init`` and
``inner.update`` on the abstract full tree: nothing is computed.

Each value of the jaxpr carries the set of param leaves it depends on and, where it has one, its
*row axis*: the axis whose slice ``r`` depends only on row ``r`` of its leaf. Nested jaxprs
(``jit``, custom derivatives, ``cond``, ``while``, ``scan``) are followed; any other primitive is
taken to mix all its inputs. Two passes: the first gives every state leaf its own token and
finds which state leaves belong to which param leaf (connected components of the dependence
graph); the second, with that ownership, follows the row axes. Extra arguments of ``update`` are
inputs that depend on no leaf: every subgroup is given them alike.

Randomness is refused outright: optax draws from one key split over the whole tree, which no key
split per subgroup reproduces.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.extend import core

from jax_mlp import partition
from jax_mlp.errors import CoupledOptimizerError, OffloadError

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


class _Dep(NamedTuple):
    """What a value depends on: param leaves (or, in the first pass, state tokens too) and its row axis.

    ``axis`` is the axis whose slice ``r`` depends only on row ``r`` of the leaves' inputs, or None
    if there is none. A value that depends on no leaf is *uniform*: every subgroup sees it alike.
    """

    leaves: frozenset[int]
    axis: int | None


_UNIFORM = _Dep(frozenset(), None)


def _join(deps: Iterable[_Dep]) -> _Dep:
    """A value computed elementwise from ``deps``: their union, row-wise if all agree on the row axis."""
    leaves: frozenset[int] = frozenset()
    axes = set()
    for dep in deps:
        if dep.leaves:
            leaves |= dep.leaves
            axes.add(dep.axis)
    if not leaves:
        return _UNIFORM
    return _Dep(leaves, axes.pop() if len(axes) == 1 else None)


def _moved(dep: _Dep, move: Callable[[int], int | None]) -> _Dep:
    """``dep`` with its row axis mapped by ``move`` (which returns None where rows are mixed)."""
    if not dep.leaves or dep.axis is None:
        return dep
    return _Dep(dep.leaves, move(dep.axis))


def _shifted(removed: Sequence[int]) -> Callable[[int], int | None]:
    """The axis map of an operation that removes (reduces over) the axes ``removed``."""
    return lambda a: None if a in removed else a - sum(r < a for r in removed)


def _kept_unless(axis: int) -> Callable[[int], int | None]:
    """The axis map of an operation that mixes along ``axis`` only (a cumulative sum, a sort)."""
    return lambda a: None if a == axis else a


def _shape(var: Any) -> tuple[int, ...]:
    return tuple(var.aval.shape)


# ----------------------------------------------------------------------------- primitive rules
# Each maps an equation and its inputs' deps to its outputs' deps.


def _elementwise(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    return [_join(ins)] * len(eqn.outvars)


def _identity(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    return list(ins)


def _broadcast_in_dim(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    dims = eqn.params["broadcast_dimensions"]
    return [_join([_moved(ins[0], lambda a: dims[a]), *ins[1:]])]


def _reshape(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    before, after = _shape(eqn.invars[0]), _shape(eqn.outvars[0])

    def move(a: int) -> int | None:
        if eqn.params.get("dimensions") is not None:
            return None
        prefix = math.prod(before[:a])
        return next((b for b, size in enumerate(after) if size == before[a] and math.prod(after[:b]) == prefix), None)

    return [_join([_moved(ins[0], move), *ins[1:]])]


def _transpose(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    permutation = tuple(eqn.params["permutation"])
    return [_moved(ins[0], permutation.index)]


def _reduce(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    return [_moved(ins[0], _shifted(tuple(eqn.params["axes"])))] * len(eqn.outvars)


def _squeeze(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    return [_moved(ins[0], _shifted(tuple(eqn.params["dimensions"])))]


def _cumulative(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    return [_moved(ins[0], _kept_unless(eqn.params["axis"]))]


def _rev(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    dims = tuple(eqn.params["dimensions"])
    return [_moved(ins[0], lambda a: None if a in dims else a)]


def _concatenate(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    return [_join(_moved(dep, _kept_unless(eqn.params["dimension"])) for dep in ins)]


def _sort(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    return [_join(_moved(dep, _kept_unless(eqn.params["dimension"])) for dep in ins)] * len(eqn.outvars)


def _split(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    return [_moved(ins[0], _kept_unless(eqn.params["axis"]))] * len(eqn.outvars)


def _pad(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    config = eqn.params["padding_config"]
    return [_join([_moved(ins[0], lambda a: a if tuple(config[a]) == (0, 0, 0) else None), ins[1]])]


def _full_along(shape: tuple[int, ...], sizes: Sequence[int]) -> Callable[[int], int | None]:
    """The axis map of an operation that keeps rows only where it spans the whole axis."""
    return lambda a: a if sizes[a] == shape[a] else None


def _slice(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    shape, params = _shape(eqn.invars[0]), eqn.params
    strides = params["strides"] or (1,) * len(shape)

    def move(a: int) -> int | None:
        whole = params["start_indices"][a] == 0 and params["limit_indices"][a] == shape[a] and strides[a] == 1
        return a if whole else None

    return [_moved(ins[0], move)]


def _dynamic_slice(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    shape = _shape(eqn.invars[0])
    return [_join([_moved(ins[0], _full_along(shape, eqn.params["slice_sizes"])), *ins[1:]])]


def _dynamic_update_slice(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    move = _full_along(_shape(eqn.invars[0]), _shape(eqn.invars[1]))
    return [_join([_moved(ins[0], move), _moved(ins[1], move), *ins[2:]])]


def _bitcast_convert_type(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    before, after = len(_shape(eqn.invars[0])), len(_shape(eqn.outvars[0]))
    return [_moved(ins[0], lambda a: a if a < min(before, after) else None)]


def _gather(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    """A lookup in a table that depends on no leaf (``table[codes]``, as table-based codecs decode): rows follow the codes.

    Only the form whose output has the indices' batch axes, in order (no offset axes, the index vector
    last), keeps the row axis; any other gather, or one from a leaf-dependent operand, mixes rows.
    """
    numbers = eqn.params["dimension_numbers"]
    indices_rank = len(_shape(eqn.invars[1]))
    if ins[0].leaves or numbers.offset_dims or numbers.operand_batching_dims:
        return _conservative(eqn, ins)
    return [_moved(ins[1], lambda a: a if a < indices_rank - 1 else None)]


def _dot_general(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    (contracting, batch) = eqn.params["dimension_numbers"]
    num_batch = len(batch[0])
    ndims = [len(_shape(v)) for v in eqn.invars[:2]]
    free = [[d for d in range(ndims[side]) if d not in contracting[side] and d not in batch[side]] for side in (0, 1)]
    offsets = (num_batch, num_batch + len(free[0]))

    def move(side: int) -> Callable[[int], int | None]:
        def to_output(a: int) -> int | None:
            if a in batch[side]:
                return tuple(batch[side]).index(a)
            if a in free[side]:
                return offsets[side] + free[side].index(a)
            return None

        return to_output

    return [_join([_moved(ins[0], move(0)), _moved(ins[1], move(1))])]


def _conservative(eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
    """Any primitive not known here: every output may depend on every input, on all their rows."""
    leaves = _join(ins).leaves
    return [_Dep(leaves, None) if leaves else _UNIFORM] * len(eqn.outvars)


_ELEMENTWISE = (
    *("add", "sub", "mul", "div", "rem", "pow", "integer_pow", "max", "min", "nextafter", "atan2", "complex"),
    *("abs", "neg", "sign", "floor", "ceil", "round", "real", "imag", "conj", "is_finite", "square", "sqrt", "rsqrt"),
    *("cbrt", "exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "sin", "cos", "tan", "asin", "acos"),
    *("atan", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc", "erf_inv", "lgamma", "digamma", "polygamma"),
    *("igamma", "igammac", "igamma_grad_a", "regularized_incomplete_beta", "zeta", "bessel_i0e", "bessel_i1e"),
    *("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "population_count", "clz"),
    *("shift_left", "shift_right_arithmetic", "shift_right_logical", "select_n", "clamp"),
    *("convert_element_type", "reduce_precision", "copy", "copy_p", "iota"),
)

_RULES: dict[str, Callable[[Any, Sequence[_Dep]], list[_Dep]]] = {
    **dict.fromkeys(_ELEMENTWISE, _elementwise),
    **dict.fromkeys(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or"), _reduce),
    **dict.fromkeys(("reduce_xor", "argmax", "argmin"), _reduce),
    **dict.fromkeys(("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"), _cumulative),
    "optimization_barrier": _identity,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "transpose": _transpose,
    "squeeze": _squeeze,
    "rev": _rev,
    "concatenate": _concatenate,
    "sort": _sort,
    "split": _split,
    "pad": _pad,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "bitcast_convert_type": _bitcast_convert_type,
    "dot_general": _dot_general,
    "gather": _gather,
}

# Primitives that call one jaxpr on their own inputs, one to one.
_CALLS = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat", "remat2", "checkpoint"}
)


class _Propagation:
    """Walks jaxprs, giving each variable its :class:`_Dep`.

    Args:
      num_params: param leaves are the tokens below this; in the first pass, state leaves are the
        tokens from it on.
    """

    def __init__(self, num_params: int):
        self.num_params = num_params
        self.first_mix: tuple[Any, list[int]] | None = None  # the first equation combining two param leaves

    def closed(self, jaxpr: Any, ins: Sequence[_Dep]) -> list[_Dep]:
        """The deps of the outputs of ``jaxpr`` (a Jaxpr or ClosedJaxpr) given those of its inputs."""
        return self.run(jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr, ins)

    def run(self, jaxpr: core.Jaxpr, ins: Sequence[_Dep]) -> list[_Dep]:
        env: dict[Any, _Dep] = dict.fromkeys(jaxpr.constvars, _UNIFORM)
        env.update(zip(jaxpr.invars, ins, strict=True))

        def read(var: Any) -> _Dep:
            return _UNIFORM if isinstance(var, core.Literal) else env[var]

        for eqn in jaxpr.eqns:
            outs = self.equation(eqn, [read(v) for v in eqn.invars])
            if self.first_mix is None:
                self._note_mix(eqn, outs)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    def _note_mix(self, eqn: Any, outs: Sequence[_Dep]) -> None:
        for dep in outs:
            params = sorted(t for t in dep.leaves if t < self.num_params)
            if len(params) >= 2:
                self.first_mix = (eqn, params[:2])
                return

    def equation(self, eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
        name = eqn.primitive.name
        if name in _RULES:
            return _RULES[name](eqn, ins)
        if name == "cond":
            return self._cond(eqn, ins)
        if name == "while":
            return self._while(eqn, ins)
        if name == "scan":
            return self._scan(eqn, ins)
        if name in _CALLS:
            inner = [v for v in eqn.params.values() if isinstance(v, (core.Jaxpr, core.ClosedJaxpr))]
            if len(inner) == 1:
                return self.closed(inner[0], ins)
        return _conservative(eqn, ins)

    def _cond(self, eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
        index, operands = ins[0], ins[1:]
        branches = [self.closed(branch, operands) for branch in eqn.params["branches"]]
        chosen_by = _Dep(index.leaves, None)
        return [_join([*outs, chosen_by]) for outs in zip(*branches, strict=True)]

    def _loop(self, carry: list[_Dep], body: Callable[[list[_Dep]], tuple[list[_Dep], _Dep]]) -> list[_Dep]:
        """The fixpoint of a loop's carry: each value joined with what any number of iterations makes of it."""
        while True:
            new, steered_by = body(carry)
            joined = [_join([old, value, steered_by]) for old, value in zip(carry, new, strict=True)]
            if joined == carry:
                return carry
            carry = joined

    def _while(self, eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
        params = eqn.params
        cond_consts = list(ins[: params["cond_nconsts"]])
        body_consts = list(ins[params["cond_nconsts"] : params["cond_nconsts"] + params["body_nconsts"]])

        def body(carry: list[_Dep]) -> tuple[list[_Dep], _Dep]:
            predicate = self.closed(params["cond_jaxpr"], cond_consts + carry)[0]
            return self.closed(params["body_jaxpr"], body_consts + carry), _Dep(predicate.leaves, None)

        return self._loop(list(ins[params["cond_nconsts"] + params["body_nconsts"] :]), body)

    def _scan(self, eqn: Any, ins: Sequence[_Dep]) -> list[_Dep]:
        params = eqn.params
        num_consts, num_carry = params["num_consts"], params["num_carry"]
        consts = list(ins[:num_consts])
        # A scan over the row axis sees one row per iteration: conservatively, rows are mixed.
        xs = [_moved(dep, lambda a: None if a == 0 else a - 1) for dep in ins[num_consts + num_carry :]]

        def body(carry: list[_Dep]) -> tuple[list[_Dep], _Dep]:
            return self.closed(params["jaxpr"], consts + carry + xs)[:num_carry], _UNIFORM

        carry = self._loop(list(ins[num_consts : num_consts + num_carry]), body)
        ys = self.closed(params["jaxpr"], consts + carry + xs)[num_carry:]
        return carry + [_moved(dep, lambda a: a + 1) for dep in ys]


# ----------------------------------------------------------------------------- the check


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
      The leaves that must be kept whole (their updates mix rows) and the seconds the check took.

    Raises:
      CoupledOptimizerError: an update or new state leaf of one param leaf depends on another leaf,
        or state shared by all subgroups is computed from the leaves.
      OffloadError: the optimizer draws random numbers or keeps a PRNG key, or it cannot be traced.
    """
    start = time.perf_counter()
    traced = _trace(optax.with_extra_args_support(inner), params, master_dtype, dict(extra_args or {}))
    owner = _state_owners(inner, traced)
    return OptimizerCheck(_row_coupled(traced, owner), time.perf_counter() - start)


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


def _update_outputs(propagation: _Propagation, traced: _Traced, params: list[_Dep], state: list[_Dep]) -> list[_Dep]:
    """The deps of ``inner.update``'s outputs (updates, then new state); extra arguments are uniform."""
    return propagation.closed(traced.update, [*params, *state, *params, *[_UNIFORM] * traced.num_extra])


def _state_owners(inner: optax.GradientTransformation, traced: _Traced) -> list[int | None]:
    """Per state leaf, the param leaf it belongs to, or None for state every subgroup holds alike.

    A state leaf belongs to a param leaf if its value follows from that leaf's gradients, params or
    state: they form one connected component of the dependence graph. Other state leaves (counts,
    hyperparameters) depend on no leaf. Raises if a component holds two param leaves, or if state
    that ``inner.init`` gives even a view with no leaves depends on one.
    """
    n, s = len(traced.names), len(traced.state_leaves)
    first = _Propagation(n)
    tokens = [_Dep(frozenset({i}), None) for i in range(n)]
    init_deps = first.closed(traced.init, tokens)
    outs = _update_outputs(first, traced, tokens, [_Dep(frozenset({n + k}), None) for k in range(s)])
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

    param_deps = [_Dep(frozenset({i}), 0 if x.shape else None) for i, x in enumerate(leaves)]
    state_deps = [
        _UNIFORM if i is None else _Dep(frozenset({i}), 0 if rows(x.shape) == rows(leaves[i].shape) else None)
        for (_, x), i in zip(traced.state_leaves, owner, strict=True)
    ]
    second = _Propagation(n)
    init_deps = second.closed(traced.init, param_deps)
    outs = _update_outputs(second, traced, param_deps, state_deps)
    outputs: list[list[_Dep]] = [[outs[i]] for i in range(n)]
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
