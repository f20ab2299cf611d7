"""The exactness contract in one place: its bounds, the assertions that check them, and a script loader.

The contract (docs/architecture.md, "Exactness contract"): offloaded training does the same math as
the optax optimizer held in memory. Every leaf is within ``EXACT_BOUND * max|p|`` of the reference
(``LOW_PRECISION_STATE_BOUND`` with bf16 or compressed optimizer state); bf16 params with fp32 masters
are at most ``BF16_MAX_ULPS`` apart on at most ``BF16_MAX_DIFFERING`` of the elements; bits are
compared as unsigned integers, so that NaNs and signed zeros compare exactly. An optimizer's result is
compared by its displacement ``p - p0`` as well as by ``p``: a small step hides under a bound on |p|.

The tests import this module by name (``from helpers import ...``): pytest puts ``tests/`` on
``sys.path`` for its test modules, in xdist workers too, and the child processes that the tests start
insert it themselves.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

EXACT_BOUND = 1e-5
"""Each leaf within this times max|p| of in-memory optax, and each displacement within this times max|p - p0|."""
LOW_PRECISION_STATE_BOUND = 1e-3
"""The bound instead of ``EXACT_BOUND`` with bf16 or compressed optimizer state."""
BF16_MAX_ULPS = 1
"""bf16 params with fp32 masters: at most this many bf16 ulps from the reference..."""
BF16_MAX_DIFFERING = 1e-3
"""... on at most this fraction of all the elements."""


def max_relative_deviation(actual: Any, expected: Any) -> dict[str, float]:
    """Per leaf, named by its tree path: max|actual - expected| / max|expected|, computed in float64."""
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree.leaves(expected)
    out = {}
    for (path, a), e in zip(flat_a, flat_e, strict=True):
        a64, e64 = np.asarray(a, np.float64), np.asarray(e, np.float64)
        out[jax.tree_util.keystr(path)] = float(np.max(np.abs(a64 - e64)) / max(np.max(np.abs(e64)), 1e-30))
    return out


def assert_close_to_optax(
    actual: Any,
    expected: Any,
    start: Any = None,
    *,
    bound: float = EXACT_BOUND,
    rounding_steps: int = 0,
    what: str = "",
) -> dict[str, float]:
    """Asserts the contract's bound on each leaf, and with ``start`` on each leaf's displacement from it.

    Each leaf of ``actual`` has the dtype of ``expected``'s and is within ``bound * max|expected|`` of
    it. Given the params ``start`` that both runs began from, each displacement ``actual - start`` is
    also within ``bound * max|expected - start|`` of ``expected - start``, so that a step much smaller
    than the params is held to the same relative bound. A step so small that one ulp of the params is
    more than ``bound`` of it cannot meet that: ``rounding_steps`` then allows one ulp of max|expected|
    per step on top, as each step rounds ``p + u`` to the params' dtype, an add XLA may fuse otherwise.
    Returns the worst relative deviation of the values and, with ``start``, of the displacements.
    """
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype, (what, a.dtype, e.dtype)
    values = max_relative_deviation(actual, expected)
    worst = {"value": max(values.values())}
    assert worst["value"] <= bound, (what, values)
    if start is None:
        return worst
    worst["displacement"] = 0.0
    flat = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, e), a, p0 in zip(flat, jax.tree.leaves(actual), jax.tree.leaves(start), strict=True):
        a64, e64, p64 = (np.asarray(x, np.float64) for x in (a, e, p0))  # float32 differences are exact here
        off, step = float(np.max(np.abs((a64 - p64) - (e64 - p64)))), float(np.max(np.abs(e64 - p64)))
        allowed = bound * step + rounding_steps * float(jnp.finfo(e.dtype).eps) * float(np.max(np.abs(e64)))
        assert off <= allowed, (
            f"{what}{jax.tree_util.keystr(path)}: the step is {off:.3g} off optax's, above {allowed:.3g}"
        )
        worst["displacement"] = max(worst["displacement"], off / max(step, 1e-30))
    return worst


def _bits(x: Any) -> np.ndarray:
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def as_bits(tree: Any) -> list[np.ndarray]:
    """Each leaf's raw bits as unsigned integers, so NaNs and signed zeros compare exactly."""
    return [_bits(x) for x in jax.tree.leaves(tree)]


def assert_same_bits(actual: Any, expected: Any, what: str = "") -> None:
    """Asserts that the trees' leaves have the same dtypes and are bit for bit equal."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert np.asarray(a).dtype == np.asarray(e).dtype, (what, np.asarray(a).dtype, np.asarray(e).dtype)
        np.testing.assert_array_equal(_bits(a), _bits(e), err_msg=what)


def assert_bf16_within_ulp(actual: Any, expected: Any, what: str = "") -> None:
    """Asserts the bf16 bound: at most ``BF16_MAX_ULPS`` apart, on at most ``BF16_MAX_DIFFERING`` of the elements.

    The distance is that of the bits as unsigned integers: a sign flip is never one ulp. Prints the
    measured worst distance and fraction, for the docs' figures.
    """
    worst = differing = total = 0
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert np.asarray(a).dtype == np.asarray(e).dtype == jnp.bfloat16, (what, np.asarray(a).dtype)
        distance = np.abs(_bits(a).astype(np.int64) - _bits(e).astype(np.int64))
        worst = max(worst, int(distance.max(initial=0)))
        differing, total = differing + int(np.count_nonzero(distance)), total + distance.size
    print(f"{what}: at most {worst} ulp apart, on {differing / total:.3%} of the elements")
    assert worst <= BF16_MAX_ULPS, f"{what}: a param is {worst} bf16 ulps from the reference"
    assert differing <= BF16_MAX_DIFFERING * total, f"{what}: {differing} of {total} params differ from the reference"


def load_module(path: pathlib.Path) -> ModuleType:
    """Imports the script at ``path`` (an example or a benchmark) as the module named by its stem.

    It is registered in ``sys.modules`` first, as an import would: dataclasses (flax linen modules)
    look their module up there. Its directory goes on ``sys.path``, as for a script run directly, so
    it imports the modules beside it (the benchmarks' ``common``, the GPT of ``train_gpt``).
    """
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
