"""The test suite's plain helpers, in one place: the test tree, the training loops, the exactness contract.

- The mixed test tree (``make_params``), its deterministic gradients (``grads_at``), the optimizers
  the exactness tests run (``OPTIMIZERS``), and the training loops: ``train`` (plain optax or
  ``mlp_offload``, one shared loop), ``run_optax`` and ``run_offload``.
- The options a storage path is opened with by default (``STORE_OPTIONS``), from ``OffloadConfig``.
- The exactness contract (docs/architecture.md, "Exactness contract"): offloaded training does the
  same math as the optax optimizer held in memory. Every leaf is within ``EXACT_BOUND * max|p|`` of the
  reference (``LOW_PRECISION_STATE_BOUND`` with bf16 or compressed optimizer state); bf16 params with
  fp32 masters are at most ``BF16_MAX_ULPS`` apart on at most ``BF16_MAX_DIFFERING`` of the elements;
  bits are compared as unsigned integers, so that NaNs and signed zeros compare exactly. An
  optimizer's result is compared by its displacement ``p - p0`` as well as by ``p``: a small step
  hides under a bound on |p|.
- A loader of scripts (examples, benchmarks), a real tmpfs, and a planted cross-leaf transformation.

``conftest.py`` holds only the environment setup, fixtures and hooks. The tests import this module by
name (``from helpers import ...``): pytest puts ``tests/`` on ``sys.path`` for its test modules, in
xdist workers too, and the child processes that the tests start insert it themselves.
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import subprocess
import sys
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_mlp
from jax_mlp._src.storage.record import HEADER_SIZE

# ----------------------------------------------------------------------------- the test tree and its training

SHAPES = {
    "embed": (40, 16),
    "blocks": [
        {"w1": (16, 32), "b1": (32,), "w2": (32, 16), "b2": (16,), "norm": {"scale": (16,), "bias": (16,)}}
        for _ in range(3)
    ],
    "head": {"w": (16, 10), "b": (10,)},
    "temperature": (),
    "big": (256, 160),
}


SMALL_TREE = {name: jax.ShapeDtypeStruct((8, 8), jnp.float32) for name in "abcd"}
"""Four leaves whose adam states make four records of one leaf each at ``SMALL_SUBGROUP``."""
SMALL_SUBGROUP = 512

STORE_OPTIONS = {
    name: getattr(jax_mlp.OffloadConfig("."), name) for name in ("max_inflight", "node_lock", "store_timeout")
}
"""``open_path``'s options as a default ``OffloadConfig`` sets them, for tests that open a path as ``mlp_offload`` does."""


def store(tiers, subgroup, fields, record_nbytes, step, placement, cached=None) -> list:
    """``TierStack.stage`` then ``land`` of what it staged, as an update's writer does: the writes it took."""
    return [tiers.land(u) for u in tiers.stage(subgroup, fields, record_nbytes, step, placement, cached)]


def written_by_last_update(tx) -> int:
    """The bytes the last update's stats count as written, with no host cache (and more than two updates, or
    the first after init): every record but the last ``write_depth`` of its order, whose writes run on past
    it, and the last ``write_depth`` of the update before, which ran on into it."""
    sizes = [HEADER_SIZE + sg.layout.nbytes for sg in tx.plan.subgroups]
    depth, step = tx.config.write_depth, tx.step
    ran_on = tx.scheduler.order(step - 2)[-depth:] if step > 1 else []
    own = tx.scheduler.order(step - 1)[-depth:]
    return sum(sizes) - sum(sizes[k] for k in own) + sum(sizes[k] for k in ran_on)


def fields_of(layout, value: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Fields of a record of ``layout`` (its state leaves, then its master leaves), every element ``value``."""
    state = [np.full(f.shape, value, f.dtype) for f in layout.state_fields]
    return state, [np.full(f.shape, value, f.dtype) for f in layout.master_fields]


def make_params(shapes=SHAPES, seed: int = 0, dtype=jnp.float32):
    """A nested tree of normal-distributed leaves with the given shapes."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    values = [(0.5 * jax.random.normal(k, s)).astype(dtype) for k, s in zip(keys, leaves, strict=True)]
    return jax.tree.unflatten(treedef, values)


def grads_at(params, step: int, dtype=None):
    """Deterministic gradients that depend on the params and the step."""
    return jax.tree.map(
        lambda p: (jnp.sin(p.astype(jnp.float32) * (step + 1.3)) + 0.1 * step).astype(dtype or p.dtype), params
    )


def decay_mask(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


OPTIMIZERS = {
    "adamw_mask": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask),
    "adam": lambda: optax.adam(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "adafactor": lambda: optax.adafactor(1e-2),
    "adam_schedule_chain": lambda: optax.chain(
        optax.scale_by_adam(), optax.scale_by_learning_rate(optax.linear_schedule(1e-2, 1e-3, 10))
    ),
}


def run_optax(inner, params, steps: int, *, jit: bool):
    """Plain in-memory optax: the reference."""
    update = jax.jit(inner.update) if jit else inner.update
    state = inner.init(params)
    for step in range(steps):
        updates, state = update(grads_at(params, step), state, params)
        params = optax.apply_updates(params, updates)
    return params


def train(optimizer, params, state, steps, *, update=None, apply=False, history=None, grads_of=None):
    """Applies ``optimizer``'s updates (plain optax or mlp_offload) for the gradients of ``steps``.

    Each step's gradients are ``grads_at(params, step)`` of the params it starts from.

    Args:
      optimizer: plain optax, or an ``mlp_offload``.
      params: the params to start from.
      state: the optimizer's state at the first of ``steps``.
      steps: the steps to train, in order.
      update: called instead of ``optimizer.update`` (a jitted one, say).
      apply: take the fused ``optimizer.apply`` (an ``mlp_offload``'s) instead of update plus
        ``optax.apply_updates``.
      history: a list to append each step's updates (or, with ``apply``, new params) to.
      grads_of: makes a step's gradients from the params and the step, instead of ``grads_at``
        (the same values placed elsewhere, say).

    Returns:
      The params and the state after the last step.
    """
    update = update or optimizer.update
    for step in steps:
        grads = (grads_of or grads_at)(params, step)
        if apply:
            params, state = optimizer.apply(grads, state, params)
            updates = params
        else:
            updates, state = update(grads, state, params)
            params = optax.apply_updates(params, updates)
        if history is not None:
            history.append(updates)
    return params, state


def abstract(tree):
    """Each leaf's ``jax.ShapeDtypeStruct``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def run_offload(inner, params, steps: int, paths, *, reopen_at: int | None = None, **options):
    """The same training with mlp_offload; optionally closes and resumes the tiers at ``reopen_at``.

    Returns the params and the stats of the last update.
    """
    first = range(steps if reopen_at is None else min(reopen_at, steps))
    with jax_mlp.mlp_offload(inner, paths=paths, **options) as tx:
        params, _ = train(tx, params, tx.init(params), first)
        stats = tx.stats
    if len(first) == steps:
        return params, stats
    with jax_mlp.mlp_offload(inner, paths=paths, resume=True, **options) as tx:
        state = tx.init(params)
        assert int(state.step) == reopen_at
        params, _ = train(tx, params, state, range(reopen_at, steps))
        stats = tx.stats
    return params, stats


@contextlib.contextmanager
def tmpfs(directory, size):
    """A real tmpfs of ``size`` at ``directory``; skips the test where mounting is not allowed."""
    directory.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()})")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def scale_by_global_norm() -> optax.GradientTransformation:
    """A planted cross-leaf transformation: every update is divided by the norm of all of them."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        norm = optax.tree.norm(updates)
        return jax.tree.map(lambda u: u / (norm + 1e-6), updates), state

    return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------- the exactness contract

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


def bf16_distance(actual: Any, expected: Any) -> tuple[int, int, int]:
    """The worst distance in bf16 ulps between two trees of bf16 leaves, the elements that differ, and all elements.

    The distance is that of the bits as unsigned integers: a sign flip is never one ulp.
    """
    worst = differing = total = 0
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert np.asarray(a).dtype == np.asarray(e).dtype == jnp.bfloat16, np.asarray(a).dtype
        distance = np.abs(_bits(a).astype(np.int64) - _bits(e).astype(np.int64))
        worst = max(worst, int(distance.max(initial=0)))
        differing, total = differing + int(np.count_nonzero(distance)), total + distance.size
    return worst, differing, total


def assert_bf16_within_ulp(actual: Any, expected: Any, what: str = "") -> None:
    """Asserts the bf16 bound between two trees of bf16 leaves: see :func:`assert_bf16_bound`."""
    assert_bf16_bound(bf16_distance(actual, expected), what)


def assert_bf16_bound(distance: tuple[int, int, int], what: str = "") -> None:
    """Asserts the bf16 bound on a :func:`bf16_distance`: at most ``BF16_MAX_ULPS`` apart, on at most
    ``BF16_MAX_DIFFERING`` of the elements. Prints the measured worst distance and fraction, for the docs' figures.
    """
    worst, differing, total = distance
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
