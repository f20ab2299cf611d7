"""Which inputs each value of a jaxpr depends on, and along which row axis: an abstract interpreter.

Each value carries a :class:`Dep`: the set of tokens (param leaves, and in a first pass state
leaves too) it depends on and, where it has one, its *row axis*: the axis whose slice ``r`` depends
only on row ``r`` of its inputs. Rules for the primitives that keep leaves apart (element-wise
arithmetic, broadcasts, reshapes, reductions, slices, dots, ...) say how each moves the row axis;
nested jaxprs (``jit``, custom derivatives, ``cond``, ``while``, ``scan``) are followed; any other
primitive is taken to mix all its inputs. Nothing is computed: the interpreter reads shapes only.
:mod:`~jax_mlp._src.plan.optimizer_check` runs it on an optimizer's ``init`` and ``update``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from jax.extend import core


class Dep(NamedTuple):
    """What a value depends on: param leaves (or, in the first pass, state tokens too) and its row axis.

    ``axis`` is the axis whose slice ``r`` depends only on row ``r`` of the leaves' inputs, or None
    if there is none. A value that depends on no leaf is *uniform*: every subgroup sees it alike.
    """

    leaves: frozenset[int]
    axis: int | None


UNIFORM = Dep(frozenset(), None)


def _join(deps: Iterable[Dep]) -> Dep:
    """A value computed elementwise from ``deps``: their union, row-wise if all agree on the row axis."""
    leaves: frozenset[int] = frozenset()
    axes = set()
    for dep in deps:
        if dep.leaves:
            leaves |= dep.leaves
            axes.add(dep.axis)
    if not leaves:
        return UNIFORM
    return Dep(leaves, axes.pop() if len(axes) == 1 else None)


def _moved(dep: Dep, move: Callable[[int], int | None]) -> Dep:
    """``dep`` with its row axis mapped by ``move`` (which returns None where rows are mixed)."""
    if not dep.leaves or dep.axis is None:
        return dep
    return Dep(dep.leaves, move(dep.axis))


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


def _elementwise(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    return [_join(ins)] * len(eqn.outvars)


def _identity(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    return list(ins)


def _broadcast_in_dim(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    dims = eqn.params["broadcast_dimensions"]
    return [_join([_moved(ins[0], lambda a: dims[a]), *ins[1:]])]


def _reshape(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    before, after = _shape(eqn.invars[0]), _shape(eqn.outvars[0])

    def move(a: int) -> int | None:
        if eqn.params.get("dimensions") is not None:
            return None
        prefix = math.prod(before[:a])
        return next((b for b, size in enumerate(after) if size == before[a] and math.prod(after[:b]) == prefix), None)

    return [_join([_moved(ins[0], move), *ins[1:]])]


def _transpose(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    permutation = tuple(eqn.params["permutation"])
    return [_moved(ins[0], permutation.index)]


def _reduce(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    return [_moved(ins[0], _shifted(tuple(eqn.params["axes"])))] * len(eqn.outvars)


def _squeeze(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    return [_moved(ins[0], _shifted(tuple(eqn.params["dimensions"])))]


def _cumulative(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    return [_moved(ins[0], _kept_unless(eqn.params["axis"]))]


def _rev(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    dims = tuple(eqn.params["dimensions"])
    return [_moved(ins[0], lambda a: None if a in dims else a)]


def _concatenate(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    return [_join(_moved(dep, _kept_unless(eqn.params["dimension"])) for dep in ins)]


def _sort(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    return [_join(_moved(dep, _kept_unless(eqn.params["dimension"])) for dep in ins)] * len(eqn.outvars)


def _split(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    return [_moved(ins[0], _kept_unless(eqn.params["axis"]))] * len(eqn.outvars)


def _pad(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    config = eqn.params["padding_config"]
    return [_join([_moved(ins[0], lambda a: a if tuple(config[a]) == (0, 0, 0) else None), ins[1]])]


def _full_along(shape: tuple[int, ...], sizes: Sequence[int]) -> Callable[[int], int | None]:
    """The axis map of an operation that keeps rows only where it spans the whole axis."""
    return lambda a: a if sizes[a] == shape[a] else None


def _slice(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    shape, params = _shape(eqn.invars[0]), eqn.params
    strides = params["strides"] or (1,) * len(shape)

    def move(a: int) -> int | None:
        whole = params["start_indices"][a] == 0 and params["limit_indices"][a] == shape[a] and strides[a] == 1
        return a if whole else None

    return [_moved(ins[0], move)]


def _dynamic_slice(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    shape = _shape(eqn.invars[0])
    return [_join([_moved(ins[0], _full_along(shape, eqn.params["slice_sizes"])), *ins[1:]])]


def _dynamic_update_slice(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    move = _full_along(_shape(eqn.invars[0]), _shape(eqn.invars[1]))
    return [_join([_moved(ins[0], move), _moved(ins[1], move), *ins[2:]])]


def _bitcast_convert_type(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    before, after = len(_shape(eqn.invars[0])), len(_shape(eqn.outvars[0]))
    return [_moved(ins[0], lambda a: a if a < min(before, after) else None)]


def _gather(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    """A lookup in a table that depends on no leaf (``table[codes]``, as table-based codecs decode): rows follow the codes.

    Only the form whose output has the indices' batch axes, in order (no offset axes, the index vector
    last), keeps the row axis; any other gather, or one from a leaf-dependent operand, mixes rows.
    """
    numbers = eqn.params["dimension_numbers"]
    indices_rank = len(_shape(eqn.invars[1]))
    if ins[0].leaves or numbers.offset_dims or numbers.operand_batching_dims:
        return _conservative(eqn, ins)
    return [_moved(ins[1], lambda a: a if a < indices_rank - 1 else None)]


def _dot_general(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
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


def _conservative(eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
    """Any primitive not known here: every output may depend on every input, on all their rows."""
    leaves = _join(ins).leaves
    return [Dep(leaves, None) if leaves else UNIFORM] * len(eqn.outvars)


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

_RULES: dict[str, Callable[[Any, Sequence[Dep]], list[Dep]]] = {
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


class Propagation:
    """Walks jaxprs, giving each variable its :class:`Dep`.

    Args:
      num_params: param leaves are the tokens below this; in the first pass, state leaves are the
        tokens from it on.
    """

    def __init__(self, num_params: int):
        self.num_params = num_params
        self.first_mix: tuple[Any, list[int]] | None = None  # the first equation combining two param leaves

    def closed(self, jaxpr: Any, ins: Sequence[Dep]) -> list[Dep]:
        """The deps of the outputs of ``jaxpr`` (a Jaxpr or ClosedJaxpr) given those of its inputs."""
        return self.walk(jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr, ins)

    def walk(self, jaxpr: core.Jaxpr, ins: Sequence[Dep]) -> list[Dep]:
        env: dict[Any, Dep] = dict.fromkeys(jaxpr.constvars, UNIFORM)
        env.update(zip(jaxpr.invars, ins, strict=True))

        def read(var: Any) -> Dep:
            return UNIFORM if isinstance(var, core.Literal) else env[var]

        for eqn in jaxpr.eqns:
            outs = self.equation(eqn, [read(v) for v in eqn.invars])
            if self.first_mix is None:
                self._note_mix(eqn, outs)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    def _note_mix(self, eqn: Any, outs: Sequence[Dep]) -> None:
        for dep in outs:
            params = sorted(t for t in dep.leaves if t < self.num_params)
            if len(params) >= 2:
                self.first_mix = (eqn, params[:2])
                return

    def equation(self, eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
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

    def _cond(self, eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
        index, operands = ins[0], ins[1:]
        branches = [self.closed(branch, operands) for branch in eqn.params["branches"]]
        chosen_by = Dep(index.leaves, None)
        return [_join([*outs, chosen_by]) for outs in zip(*branches, strict=True)]

    def _loop(self, carry: list[Dep], body: Callable[[list[Dep]], tuple[list[Dep], Dep]]) -> list[Dep]:
        """The fixpoint of a loop's carry: each value joined with what any number of iterations makes of it."""
        while True:
            new, steered_by = body(carry)
            joined = [_join([old, value, steered_by]) for old, value in zip(carry, new, strict=True)]
            if joined == carry:
                return carry
            carry = joined

    def _while(self, eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
        params = eqn.params
        cond_consts = list(ins[: params["cond_nconsts"]])
        body_consts = list(ins[params["cond_nconsts"] : params["cond_nconsts"] + params["body_nconsts"]])

        def body(carry: list[Dep]) -> tuple[list[Dep], Dep]:
            predicate = self.closed(params["cond_jaxpr"], cond_consts + carry)[0]
            return self.closed(params["body_jaxpr"], body_consts + carry), Dep(predicate.leaves, None)

        return self._loop(list(ins[params["cond_nconsts"] + params["body_nconsts"] :]), body)

    def _scan(self, eqn: Any, ins: Sequence[Dep]) -> list[Dep]:
        params = eqn.params
        num_consts, num_carry = params["num_consts"], params["num_carry"]
        consts = list(ins[:num_consts])
        # A scan over the row axis sees one row per iteration: conservatively, rows are mixed.
        xs = [_moved(dep, lambda a: None if a == 0 else a - 1) for dep in ins[num_consts + num_carry :]]

        def body(carry: list[Dep]) -> tuple[list[Dep], Dep]:
            return self.closed(params["jaxpr"], consts + carry + xs)[:num_carry], UNIFORM

        carry = self._loop(list(ins[num_consts : num_consts + num_carry]), body)
        ys = self.closed(params["jaxpr"], consts + carry + xs)[num_carry:]
        return carry + [_moved(dep, lambda a: a + 1) for dep in ys]
