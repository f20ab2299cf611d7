"""``offload/accumulation.py``: gradient accumulation, optax.MultiSteps' math, no storage traffic on micro-steps, the
window used for I/O.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_close_to_optax, assert_same_bits, decay_mask, grads_at, make_params, train
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_mlp
from jax_mlp._src.errors import OffloadError
from jax_mlp._src.plan import partition
from jax_mlp._src.storage.record import HEADER_SIZE

K = 3
CALLS = 4 * K  # four accumulated updates
SUBGROUP = "16KiB"


def adamw():
    return optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask)


def run_calls(tx, params, calls, *, state=None):
    """Applies ``tx``'s updates for the gradients of ``calls`` (the shared ``train``), from ``tx.init`` unless
    given a state; returns the params, the state and each call's updates."""
    history = []
    params, state = train(tx, params, tx.init(params) if state is None else state, calls, history=history)
    return params, state, history


def offloaded(params, paths, *, inner=adamw, reopen_at=None, **options):
    """Accumulating mlp_offload training over ``CALLS`` calls; optionally closes and resumes at call ``reopen_at``."""
    options = dict(subgroup_size=SUBGROUP, accumulate_steps=K, **options)
    if reopen_at is not None:
        with jax_mlp.mlp_offload(inner(), paths=paths, **options) as tx:
            params, _, _ = run_calls(tx, params, range(reopen_at))
    with jax_mlp.mlp_offload(inner(), paths=paths, resume=reopen_at is not None, **options) as tx:
        params, _, _ = run_calls(tx, params, range(reopen_at or 0, CALLS))
        assert tx.step == CALLS // K
    return params


def test_same_math_as_multisteps_and_bits_independent_of_tiering(tmp_path):
    params = make_params()
    reference = offloaded(params, [tmp_path / "a"], prefetch_depth=1)
    state_bytes = partition.make_plan(params, adamw(), jax_mlp.parse_size(SUBGROUP)).state_nbytes
    variants = {
        "part_cache_two_paths": dict(
            paths=[tmp_path / "b1", tmp_path / "b2"], host_cache=state_bytes // 3, prefetch_depth=3
        ),
        "full_cache_three_paths": dict(paths=[tmp_path / f"c{i}" for i in range(3)], host_cache=2 * state_bytes),
        "reopened_at_a_window_boundary": dict(paths=[tmp_path / "d"], host_cache=state_bytes // 2, reopen_at=2 * K),
    }
    for name, options in variants.items():
        assert_same_bits(offloaded(params, options.pop("paths"), **options), reference, name)
    expected, _, _ = run_calls(optax.MultiSteps(adamw(), every_k_schedule=K), params, range(CALLS))
    assert_close_to_optax(reference, expected, params)


def test_averaging_is_multisteps_bit_for_bit(tmp_path):
    """With sgd the update is the mean itself, scaled: the running mean's arithmetic is exactly MultiSteps'."""
    params = make_params()
    for dtype in (jnp.float32, jnp.bfloat16):
        expected, _, _ = run_calls(
            optax.MultiSteps(optax.sgd(0.1), every_k_schedule=K, accumulator_dtype=dtype), params, range(CALLS)
        )
        sgd = lambda: optax.sgd(0.1)  # noqa: E731
        actual = offloaded(params, [tmp_path / np.dtype(dtype).name], inner=sgd, accumulator_dtype=dtype)
        assert_same_bits(actual, expected, np.dtype(dtype).name)


def test_micro_steps_return_zeros_and_touch_no_storage(tmp_path):
    params = make_params(dtype=jnp.bfloat16)
    with jax_mlp.mlp_offload(
        adamw(),
        paths=[tmp_path],
        subgroup_size=SUBGROUP,
        master_dtype=jnp.float32,
        accumulate_steps=K,
        flush="lazy",
        idle_prefetch=False,
    ) as tx:
        params, state, _ = run_calls(tx, params, range(K))
        stats = tx.stats
        params, state, history = run_calls(tx, params, range(K, 2 * K - 1), state=state)
        for updates in history:
            for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params), strict=True):
                assert u.dtype == jnp.float32 and u.shape == p.shape and not np.asarray(u).any()
        assert int(state.step) == 1 and int(state.mini_step) == K - 1 and tx.step == 1
        assert tx.stats is stats, "a micro-step produced stats"
        run_calls(tx, params, [2 * K - 1], state=state)
        assert tx.step == 2 and tx.stats.step == 2
        # The update's stats count the I/O since the last update: the micro-steps' would show beyond its own.
        # Its writes: all but its last write_depth=4, which run on past it, and the last update's that did.
        sizes = [HEADER_SIZE + sg.layout.nbytes for sg in tx.plan.subgroups]
        ran_on, own = tx.scheduler.order(0)[-4:], tx.scheduler.order(1)[-4:]
        assert sum(tx.stats.bytes_read.values()) == sum(sizes)
        assert sum(tx.stats.bytes_written.values()) == sum(sizes) - sum(sizes[k] for k in own) + sum(
            sizes[k] for k in ran_on
        )
        assert tx.stats.cache_hits == 0 and tx.stats.cache_misses == len(sizes)


def wait_for_idle_write_back(tx, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not tx.idle_io_done:
        assert time.monotonic() < deadline, "the idle-time write-back did not drain"
        time.sleep(0.01)


def per_update_traffic(tmp_path, name, steps):
    """Each update's bytes read and written, cache hits, and the records read ahead for it in idle time.

    Every record has the same size, so the bytes do not depend on which records the writer threads
    happened to leave in the cache. The reads ahead are counted as the library started them
    (``prefetched``), not by when a reader thread got to each: on two loaded cores the last one
    queued behind the first and began after the update did, once in a CI run.
    """
    params = {f"w{i}": jnp.full((64, 64), 0.1 * i, jnp.float32) for i in range(8)}
    with jax_mlp.mlp_offload(
        adamw(),
        paths=[tmp_path / name / "fast", tmp_path / name / "slow"],
        subgroup_size="32KiB",  # one leaf's adam state per record
        host_cache="80KiB",  # two records of eight
        prefetch_depth=2,
        write_depth=2,
        accumulate_steps=steps,
    ) as tx:
        state, rows = tx.init(params), []
        for call in range(4 * steps):
            wait_for_idle_write_back(tx)
            read_ahead = len(tx.prefetched)
            params, state = train(tx, params, state, [call])
            if call % steps == steps - 1:
                stats = tx.stats
                rows.append(
                    (sum(stats.bytes_read.values()), sum(stats.bytes_written.values()), stats.cache_hits, read_ahead)
                )
    return rows


def test_bytes_per_update_unchanged_and_the_window_reads_further_ahead(tmp_path):
    single, accumulated = per_update_traffic(tmp_path, "k1", 1), per_update_traffic(tmp_path, "k3", K)
    assert [row[:3] for row in accumulated] == [row[:3] for row in single]
    # Each update after the first takes four records from memory: two from the cache, two whose writes ran
    # on past the last update (write_depth=2).
    assert single[0][2] == 2 and all(row[0] > 0 and row[1] > 0 and row[2] == 4 for row in single[1:])
    # Between two updates the read-ahead takes those two from memory and reads prefetch_depth; once a
    # window's write-back has drained, its micro-steps read write_depth further.
    assert [row[3] for row in single[1:]] == [2 + 2] * 3
    assert [row[3] for row in accumulated[1:]] == [2 + 4] * 3


def test_accumulation_inside_jit_is_refused_and_leaves_the_run_intact(tmp_path):
    # A lax.cond around the in-jit route's host callback deadlocked XLA's CPU runtime now and then.
    params = make_params()
    with jax_mlp.mlp_offload(adamw(), paths=[tmp_path], subgroup_size=SUBGROUP, accumulate_steps=K) as tx:
        state = tx.init(params)
        with pytest.raises(
            OffloadError, match=r"accumulate_steps=3 was called inside jax.jit; accumulation runs eagerly"
        ):
            jax.jit(tx.update)(grads_at(params, 0), state, params)
        _, state = tx.update(grads_at(params, 0), state, params)
        assert int(state.mini_step) == 1 and tx.step == 0


def multisteps_around(offload, params):
    """What ``optax.MultiSteps(optax.chain(clip, offload), k)`` would hold, built around ``offload``'s own state."""
    tx = optax.MultiSteps(optax.chain(optax.clip(1.0), offload), every_k_schedule=2)
    inner_state = (optax.EmptyState(), offload.init(params))
    zeros = jax.tree.map(jnp.zeros_like, params)
    return tx, optax.MultiStepsState(jnp.int32(0), jnp.int32(0), inner_state, zeros)


@pytest.mark.parametrize("mesh", [False, True])
def test_multisteps_around_mlp_offload_is_refused_at_its_first_call(tmp_path, mesh):
    params = make_params()
    if mesh:
        fsdp = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
        params = jax.tree.map(lambda p: jax.device_put(p, NamedSharding(fsdp, P("fsdp") if p.ndim else P())), params)
    with jax_mlp.mlp_offload(adamw(), paths=[tmp_path / "init"]) as offload:
        with pytest.raises(OffloadError, match=r"optax.MultiSteps cannot wrap mlp_offload.*accumulate_steps=k"):
            optax.MultiSteps(optax.chain(optax.clip(1.0), offload), every_k_schedule=2).init(params)
        assert offload.plan is None and not (tmp_path / "init").exists(), "init wrote before refusing"

    with jax_mlp.mlp_offload(adamw(), paths=[tmp_path / "update"]) as offload:
        tx, state = multisteps_around(offload, params)
        for update in (tx.update, jax.jit(tx.update)):
            with pytest.raises(OffloadError, match=r"optax.MultiSteps cannot wrap mlp_offload.*accumulate_steps=k"):
                update(grads_at(params, 0), state, params)
        assert offload.step == 0 and offload.stats.step == 0


def test_accumulation_options_and_states_are_checked(tmp_path):
    for steps in (0, 1.5, True):
        with pytest.raises(OffloadError, match="accumulate_steps"):
            jax_mlp.mlp_offload(adamw(), paths=[tmp_path], accumulate_steps=steps)
    with pytest.raises(OffloadError, match="accumulator_dtype"):
        jax_mlp.mlp_offload(adamw(), paths=[tmp_path], accumulator_dtype=jnp.int32)
    params = make_params()
    for steps, other in ((K, 1), (1, K)):
        with (
            jax_mlp.mlp_offload(adamw(), paths=[tmp_path / f"k{steps}"], accumulate_steps=steps) as tx,
            jax_mlp.mlp_offload(adamw(), paths=[tmp_path / f"other{steps}"], accumulate_steps=other) as foreign,
        ):
            tx.init(params)
            with pytest.raises(OffloadError, match=rf"accumulate_steps={steps}.*accumulation window"):
                tx.update(grads_at(params, 0), foreign.init(params), params)


def test_sharded_accumulation_keeps_shardings(tmp_path):
    mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), devices=jax.devices()[:8])
    params = jax.tree.map(
        lambda p: jax.device_put(p, NamedSharding(mesh, P("fsdp") if p.ndim and p.shape[0] % 4 == 0 else P())),
        make_params(),
    )
    window = range(2 * K)
    expected, _, _ = run_calls(optax.MultiSteps(adamw(), every_k_schedule=K), params, window)
    with jax_mlp.mlp_offload(adamw(), paths=[tmp_path], subgroup_size=SUBGROUP, accumulate_steps=K) as tx:
        got, state, history = run_calls(tx, params, window)
        assert tx.step == 2
    for tree in (got, state.acc_grads, history[0], history[K - 1]):
        for x, p in zip(jax.tree.leaves(tree), jax.tree.leaves(params), strict=True):
            assert x.sharding.is_equivalent_to(p.sharding, p.ndim), (x.sharding, p.sharding)
    assert_close_to_optax(got, expected, params)
