"""Shared fixtures and data: the mixed test tree, reference optax runs, a real tmpfs (the contract: helpers.py)."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile

# Nine fake CPU devices: the sharding tests use the first eight as a 2x4 mesh, and the in-jit route
# runs the update on the ninth while the mesh's devices wait in their callbacks. That route also needs
# XLA's CPU thread pools to hold 2 x 8 + 1 threads (see jax_mlp.in_jit). A child process may ask for
# another count. Set before jax starts its backend; other tests use device 0 as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=9".strip()
os.environ.setdefault("NPROC", "24")
# One persistent XLA compilation cache for this test session and the processes it starts: the many
# offloaders, example runs and child processes compile the same small programs again and again, and
# the cache turns that repeated compile time (most of a child process's life) into a file read. It is
# new per session, so a test that expects a first compile of a shape of its own still sees one. A
# process that reads an entry another one is still writing gets JAX's "Error reading persistent
# compilation cache entry" warning and compiles the program itself.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-mlp-tests-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax
import jax.numpy as jnp
import optax
import pytest

import jax_mlp

jax.config.update("jax_enable_x64", False)

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


def train(optimizer, params, state, steps):
    """Applies ``optimizer``'s updates (plain optax or mlp_offload) for the gradients of ``steps``."""
    for step in steps:
        updates, state = optimizer.update(grads_at(params, step), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def abstract(tree):
    """Each leaf's ``jax.ShapeDtypeStruct``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def run_offload(inner, params, steps: int, paths, *, reopen_at: int | None = None, **options):
    """The same training with mlp_offload; optionally closes and resumes the tiers at ``reopen_at``."""
    tx = jax_mlp.mlp_offload(inner, paths=paths, **options)
    state = tx.init(params)
    for step in range(steps):
        if step == reopen_at:
            tx.close()
            tx = jax_mlp.mlp_offload(inner, paths=paths, resume=True, **options)
            state = tx.init(params)
            assert int(state.step) == step
        updates, state = tx.update(grads_at(params, step), state, params)
        params = optax.apply_updates(params, updates)
    stats = tx.stats
    tx.close()
    return params, stats


@pytest.fixture
def paths(tmp_path):
    """Three fresh, distinct directories to use as storage paths."""
    return [tmp_path / "nvme", tmp_path / "pfs", tmp_path / "third"]


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
