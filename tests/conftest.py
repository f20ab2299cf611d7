"""The environment every test process starts with, and the shared fixtures and hooks.

Only the setup, fixtures and hooks live here: the plain helpers (the test tree, the training loops,
the exactness contract) are in helpers.py, which the tests import by name.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Nine fake CPU devices: the sharding tests use the first eight as a 2x4 mesh, and the in-jit route
# runs the update on the ninth while the mesh's devices wait in their callbacks. That route also needs
# XLA's CPU thread pools to hold 2 x 8 + 1 threads (see jax_mlp/_src/offload/in_jit.py). A child process may ask for
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
import optax
import pytest
from helpers import SMALL_SUBGROUP, SMALL_TREE, STORE_OPTIONS

import jax_mlp
from jax_mlp._src.plan import partition
from jax_mlp._src.storage.cache import HostCache
from jax_mlp._src.storage.paths import open_paths, release_paths
from jax_mlp._src.storage.record import record_codec
from jax_mlp._src.storage.tier_stack import TierStack

jax.config.update("jax_enable_x64", False)


@pytest.fixture
def paths(tmp_path):
    """Three fresh, distinct directories to use as storage paths."""
    return [tmp_path / "nvme", tmp_path / "pfs", tmp_path / "third"]


@pytest.fixture
def make_tiers(tmp_path):
    """Makes real tier stacks: ``make_tiers(host_cache)`` is a ``TierStack`` over two fresh directories (held, as
    ``init`` holds them) and the plan of its records: adam on ``helpers.SMALL_TREE``, four subgroups of one leaf
    each. Every path is let go of after the test."""
    opened = []

    def make(host_cache: int, directories=("p0", "p1")):
        plan = partition.make_plan(SMALL_TREE, optax.adam(1e-3), SMALL_SUBGROUP)
        stores = open_paths([jax_mlp.Path(tmp_path / name) for name in directories], **STORE_OPTIONS)
        opened.append(stores)
        codec = record_codec([sg.layout for sg in plan.subgroups], plan.layout_hash)
        return TierStack(HostCache(host_cache), stores, plan.layout_hash, codec), plan

    yield make
    for stores in opened:
        release_paths(stores)
