"""``offload.overlap``: the update started inside the backward pass (``offload/overlap.py``, ``stream/arrivals.py``).

Each test trains the same MLP twice, with the update overlapped (``offload.overlap`` on the params
inside the loss) and split (plain ``tx.update`` after the grads), and compares the params' bits.
What shows the overlap is real is counted by the library: the subgroups whose program ran before
``update`` was called (``stats.overlapped``), rollbacks (``stats.rolled_back``) and the host bytes
of handed-over grads (``stats.overlap_bytes``).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_same_bits, load_module
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_mlp
from jax_mlp._src.cli import main as cli
from jax_mlp._src.cli import speeds
from jax_mlp._src.schedule.performance import PathSpeed, predict_step
from jax_mlp._src.stream.arrivals import fingerprint

WIDTH, LAYERS, BATCH = 192, 6, 128
SUBGROUP = "96KiB"  # adam's state of one 192x192 layer is 288 KiB: 3 row chunks a layer, 24 subgroups or so


def make_params(dtype=jnp.float32) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), LAYERS)
    params = {
        f"w{i}": (jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(dtype) for i, k in enumerate(keys)
    }
    params.update({f"b{i}": jnp.zeros((WIDTH,), dtype) for i in range(LAYERS)})
    return params


def loss(params: dict, x: jax.Array) -> jax.Array:
    for i in range(LAYERS):
        x = jnp.tanh(x @ params[f"w{i}"].astype(jnp.float32) + params[f"b{i}"].astype(jnp.float32))
    return jnp.mean(x**2)


def batch(step: int) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(100 + step), (BATCH, WIDTH)) * (1 + 3 * (step % 3 == 2))


def train(inner, params, directory, steps: int, *, overlapped: bool, clip: float | None = None, **options):
    """Trains ``steps`` steps, every one overlapped (unless ``overlap_mode`` says otherwise); returns the params and
    each update's stats."""
    options = {"overlap_mode": "always", **options}
    offload = jax_mlp.mlp_offload(inner, paths=[directory], subgroup_size=SUBGROUP, **options)
    tx = offload if clip is None else optax.chain(optax.clip_by_global_norm(clip), offload)

    @jax.jit
    def grads_of(p, x):
        return jax.grad(lambda q: loss(offload.overlap(q) if overlapped else q, x))(p)

    stats = []
    with offload:
        state = tx.init(params)
        for step in range(steps):
            grads = grads_of(params, batch(step))
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            stats.append(offload.stats)
    return params, stats


@pytest.fixture(scope="module")
def clip() -> float:
    """A global-norm clipping that fires in some of 6 steps and not in others: the median grad norm of plain adam."""
    norms, params, tx = [], make_params(), optax.adam(1e-2)
    state = tx.init(params)
    for step in range(6):
        grads = jax.grad(loss)(params, batch(step))
        norms.append(float(optax.tree.norm(grads)))
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return float(np.median(norms))


def fired_in_some(stats: list) -> bool:
    """Whether the clipping rolled back some steps and let others commit; a rolled-back step ran nothing early."""
    fired = [s.rolled_back for s in stats]
    return any(fired) and not all(fired) and all(s.overlapped == 0 for s in stats if s.rolled_back)


@pytest.mark.parametrize("inner", [optax.adam(1e-2), optax.adamw(1e-2, weight_decay=0.1)], ids=["adam", "adamw"])
def test_overlapped_update_is_bitwise_the_split_route_and_starts_during_the_backward(inner, tmp_path):
    params = make_params()
    split, _ = train(inner, params, tmp_path / "split", 6, overlapped=False, host_cache="256KiB")
    overlapped, stats = train(inner, params, tmp_path / "overlap", 6, overlapped=True, host_cache="256KiB")
    assert_same_bits(overlapped, split, "overlapped vs split")
    assert not any(s.rolled_back for s in stats)
    # Counted by the library: in most steps the backward's update kept handed-over grads (a callback can come
    # after its program's outputs are ready, so one step may find its grads given before it kept any). How many
    # subgroups ran before update was called is a race with the main thread, which a loaded machine can lose in
    # any one step, so only the run as a whole must show some.
    assert all(0 <= s.overlap_s <= s.seconds for s in stats)
    assert sum(s.overlap_bytes > 0 for s in stats) > len(stats) // 2, [s.overlap_bytes for s in stats]
    assert any(s.overlapped > 0 for s in stats), [s.overlapped for s in stats]


def test_a_clipping_that_fires_rolls_the_step_back_and_one_that_does_not_commits_it(tmp_path, clip):
    params = make_params()
    split, _ = train(optax.adam(1e-2), params, tmp_path / "split", 6, overlapped=False, clip=clip)
    overlapped, stats = train(optax.adam(1e-2), params, tmp_path / "overlap", 6, overlapped=True, clip=clip)
    assert_same_bits(overlapped, split, "overlapped vs split, with clipping")
    assert fired_in_some(stats), [s.rolled_back for s in stats]


@pytest.mark.parametrize("clipped", [False, True], ids=["plain", "clipped"])
def test_bf16_params_with_fp32_masters(tmp_path, clip, clipped):
    params = make_params(jnp.bfloat16)
    options = {"master_dtype": jnp.float32, "clip": clip if clipped else None}
    split, _ = train(optax.adamw(1e-2), params, tmp_path / "split", 6, overlapped=False, **options)
    overlapped, stats = train(optax.adamw(1e-2), params, tmp_path / "overlap", 6, overlapped=True, **options)
    assert_same_bits(overlapped, split, "bf16 with fp32 masters")
    assert sum(s.overlapped for s in stats) > 0
    assert fired_in_some(stats) if clipped else not any(s.rolled_back for s in stats), [s.rolled_back for s in stats]


def test_with_accumulation_only_the_windows_last_backward_overlaps(tmp_path):
    params = make_params()
    split, split_stats = train(optax.adam(1e-2), params, tmp_path / "split", 9, overlapped=False, accumulate_steps=3)
    overlapped, stats = train(optax.adam(1e-2), params, tmp_path / "overlap", 9, overlapped=True, accumulate_steps=3)
    assert_same_bits(overlapped, split, "accumulate_steps=3")
    assert [stats[i].step for i in (2, 5, 8)] == [split_stats[i].step for i in (2, 5, 8)] == [1, 2, 3]
    windows_last = [stats[i] for i in (2, 5, 8)]
    assert not any(s.rolled_back for s in windows_last)
    # as in the first test, one window's grads may have been given before its callbacks kept any
    assert sum(s.overlap_bytes > 0 for s in windows_last) >= 2, [s.overlap_bytes for s in windows_last]
    assert sum(s.overlapped for s in windows_last) > 0


def test_with_accumulation_and_a_clipping_that_fires_in_some_windows(tmp_path, clip):
    params = make_params()
    options = {"accumulate_steps": 2, "clip": clip}
    # 8 steps: the windows end at steps 1, 3, 5 and 7, and the clipping fires surely at 5 (a large batch), not the last
    split, _ = train(optax.adam(1e-2), params, tmp_path / "split", 8, overlapped=False, **options)
    overlapped, stats = train(optax.adam(1e-2), params, tmp_path / "overlap", 8, overlapped=True, **options)
    assert_same_bits(overlapped, split, "accumulate_steps=2, clipped")
    windows_last = stats[1::2]
    assert fired_in_some(windows_last), [s.rolled_back for s in windows_last]


def test_the_grads_kept_in_host_memory_stay_within_the_window(tmp_path):
    """Only the subgroups about to run keep their handed-over grads (and params): prefetch_depth + 1 of them."""
    params = make_params()
    _, stats = train(optax.adamw(1e-2), params, tmp_path / "a", 4, overlapped=True, prefetch_depth=2)
    leaf = WIDTH * WIDTH * 4  # the largest block: a whole weight, grads and params
    bound = (2 + 1 + 1) * 2 * leaf  # a leaf of several subgroups is held from its first to its last
    assert all(s.overlap_bytes <= bound for s in stats), ([s.overlap_bytes for s in stats], bound)
    assert sum(s.overlap_bytes > 0 for s in stats) > len(stats) // 2, [s.overlap_bytes for s in stats]
    grads_bytes = 2 * sum(x.nbytes for x in jax.tree.leaves(params))
    assert max(s.overlap_bytes for s in stats) < grads_bytes / 2


def test_apply_after_an_overlapped_backward_undoes_it_and_is_the_split_apply(tmp_path, caplog):
    params = make_params(jnp.bfloat16)
    results = {}
    for overlapped in (False, True):
        offload = jax_mlp.mlp_offload(
            optax.adam(1e-2), paths=[tmp_path / str(overlapped)], subgroup_size=SUBGROUP, master_dtype=jnp.float32
        )
        grads_of = jax.jit(jax.grad(lambda q, x, o=overlapped, f=offload: loss(f.overlap(q) if o else q, x)))
        p = jax.tree.map(jnp.copy, params)
        with offload, caplog.at_level(logging.WARNING, logger="jax_mlp"):
            state = offload.init(p)
            for step in range(3):
                p, state = offload.apply(grads_of(p, batch(step)), state, p)
                assert offload.stats.rolled_back == (overlapped and step == 0), (overlapped, step)
        results[overlapped] = p
    assert_same_bits(results[True], results[False], "apply")
    assert "use update with overlap" in caplog.text


def test_a_second_backward_in_one_step_and_a_flush_before_update_fall_back_exactly(tmp_path):
    params = make_params()
    split, _ = train(optax.adam(1e-2), params, tmp_path / "split", 3, overlapped=False)
    offload = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "o"], subgroup_size=SUBGROUP)
    grads_of = jax.jit(jax.grad(lambda q, x: loss(offload.overlap(q), x)))
    with offload:
        state = offload.init(params)
        p = params
        for step in range(3):
            grads = grads_of(p, batch(step))
            if step == 0:
                grads = grads_of(p, batch(step))  # the same leaves handed over twice: the step is not trusted
            if step == 1:
                jax.block_until_ready(grads)  # the backward has handed its grads over: an update has started
                offload.flush()  # the offloader used before update: the started update is undone
            updates, state = offload.update(grads, state, p)
            p = optax.apply_updates(p, updates)
            assert offload.stats.rolled_back == (step < 2), step
    assert_same_bits(p, split, "after a duplicate backward and a flush")


def train_on_a_virtual_clock(directory, steps: int, overlapped_s: float, split_s: float, flush_at: int = -1):
    """Trains with ``overlap_mode="timed"`` on a clock that says each overlapped step took ``overlapped_s``, each
    split one ``split_s``; flushes between steps ``flush_at - 1`` and ``flush_at``, for a day. Returns the params,
    the stats and whether the updates at the end took the order the backward's grads came in."""
    params = make_params()
    offload = jax_mlp.mlp_offload(optax.adam(1e-2), paths=[directory], subgroup_size=SUBGROUP)
    grads_of = jax.jit(jax.grad(lambda q, x: loss(offload.overlap(q), x)))
    now, stats = [0.0], []
    with offload:
        state = offload.init(params)
        overlap = offload._offloader.live.overlap
        overlap._clock = lambda: now[0]
        for step in range(steps):
            if step == flush_at:
                offload.flush()
                now[0] += 86400.0
            now[0] += overlapped_s if overlap._basis is not None else split_s  # what the step now starting costs
            updates, state = offload.update(grads_of(params, batch(step)), state, params)
            params = optax.apply_updates(params, updates)
            stats.append(offload.stats)
        following = offload._offloader.live.stream.scheduler.following
    return params, stats, following


def test_a_slower_overlap_falls_back_to_the_split_step_and_says_so(tmp_path, caplog):
    # The trial: step 0 (compiles) and 1 untimed, 2-4 overlapped, 5 untimed, 6-8 split; from 9 the faster mode.
    # The flush before step 3 leaves that step untimed (a day on this clock would win the trial for the split step).
    split, _ = train(optax.adam(1e-2), make_params(), tmp_path / "split", 12, overlapped=False)
    with caplog.at_level(logging.INFO, logger="jax_mlp"):
        slower, stats, following = train_on_a_virtual_clock(
            tmp_path / "slower", 12, overlapped_s=2.0, split_s=1.5, flush_at=3
        )
    assert not following  # the split steps take the split route's order (alternating), not the backward's
    assert_same_bits(slower, split, "fallen back")
    assert sum(s.overlap_bytes > 0 for s in stats[1:5]) >= 3, [s.overlap_bytes for s in stats]  # ran overlapped
    assert [s.overlap_fallback for s in stats] == [False] * 9 + [True] * 3
    assert (stats[-1].overlapped_step_s, stats[-1].split_step_s) == (2.0, 1.5)
    assert all(s.overlapped == 0 and s.overlap_bytes == 0 for s in stats[5:]), stats
    assert "overlapped steps took 2.000 s, split ones 1.500 s (medians of 3): the next 100 steps run split" in (
        caplog.text
    )
    faster, stats, following = train_on_a_virtual_clock(tmp_path / "faster", 12, overlapped_s=1.0, split_s=1.5)
    assert following
    assert_same_bits(faster, split, "kept on")
    assert not any(s.overlap_fallback for s in stats) and stats[-1].overlapped_step_s == 1.0
    assert sum(s.overlap_bytes > 0 for s in stats[9:]) >= 2, [s.overlap_bytes for s in stats]


def test_sharded_over_eight_devices_with_a_clipping(tmp_path, clip):
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = {k: jax.device_put(v, shard if v.ndim == 2 else replicated) for k, v in make_params().items()}
    split, _ = train(optax.adamw(1e-2), params, tmp_path / "split", 6, overlapped=False, clip=clip)
    overlapped, stats = train(optax.adamw(1e-2), params, tmp_path / "overlap", 6, overlapped=True, clip=clip)
    assert_same_bits(overlapped, split, "sharded")
    assert sum(s.overlapped for s in stats) > 0 and fired_in_some(stats), [s.rolled_back for s in stats]
    assert all(overlapped[k].sharding.is_equivalent_to(params[k].sharding, 2 - (k[0] == "b")) for k in params)


def test_overlap_refuses_what_it_cannot_run_exactly(tmp_path):
    params = make_params()
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "lazy"], flush="lazy") as offload:
        offload.init(params)
        with pytest.raises(jax_mlp.OffloadError, match="flush='idle'"):
            jax.grad(lambda q: loss(offload.overlap(q), batch(0)))(params)
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "tree"]) as offload:
        offload.init(params)
        with pytest.raises(jax_mlp.OffloadError, match="another tree"):
            offload.overlap({"w0": params["w0"]})
    with pytest.raises(jax_mlp.OffloadError, match="before init"):
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "new"]).overlap(params)


def test_the_fingerprint_tells_apart_arrays_that_differ_in_one_bit_or_one_place():
    x = jax.random.normal(jax.random.PRNGKey(3), (64, 48))
    marks = {
        "same": fingerprint(jnp.array(x)),
        "one bit": fingerprint(jax.lax.bitcast_convert_type(x.view(jnp.uint32).at[5, 7].add(1), jnp.float32)),
        "swapped": fingerprint(x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])),
        "-0.0": fingerprint(jnp.zeros(8)),
        "+0.0": fingerprint(-jnp.zeros(8)),
        "bf16": fingerprint(x.astype(jnp.bfloat16)),
    }
    assert np.array_equal(marks["same"], fingerprint(x))
    words = [tuple(np.asarray(m)) for m in marks.values()]
    assert len(set(words)) == len(words), marks


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "bfloat16", "int8"]),
    seed=st.integers(0, 2**31 - 1),
    place=st.integers(0, 24 * 40 - 1),
    change=st.integers(1, 255),
)
def test_a_change_to_any_one_element_changes_the_fingerprint_s_first_word_and_devices_agree(dtype, seed, place, change):
    size = jnp.dtype(dtype).itemsize
    bits = np.random.default_rng(seed).integers(0, 256, 24 * 40 * size, np.uint8)
    x = bits.view(jnp.dtype(dtype)).reshape(24, 40)
    changed = bits.copy()
    changed[place * size] ^= change  # one byte of element ``place``
    words = np.asarray(fingerprint(jnp.asarray(x)))
    assert np.asarray(fingerprint(jnp.asarray(changed.view(x.dtype).reshape(x.shape))))[0] != words[0]
    elsewhere = jax.device_put(x, jax.devices()[-1])  # a block fingerprints alike wherever it is computed
    assert np.array_equal(np.asarray(fingerprint(elsewhere)), words)


def test_the_model_puts_the_overlapped_step_at_the_larger_of_compute_and_io():
    one_pipe = PathSpeed("disk", 200e6, 200e6, serial=1.0)
    duplex = one_pipe._replace(serial=0.0)
    run = {"num_records": 64, "record_bytes": 4e6, "cache_bytes": 64e6, "prefetch_records": 4}
    state, cached = 64 * 4e6, 64e6
    io = {"one pipe": (state - cached) / 200e6 + state / 200e6, "duplex": state / 200e6}  # read S - C, write S
    for name, path in (("one pipe", one_pipe), ("duplex", duplex)):
        for compute in (0.5 * io[name], io[name], 2 * io[name]):
            split = predict_step([path], forward_backward_seconds=compute, overlapped=False, **run)
            overlapped = predict_step([path], forward_backward_seconds=compute, overlapped=True, **run)
            assert max(compute, io[name]) <= overlapped <= 1.05 * max(compute, io[name]) + compute / 3, name
            assert split > overlapped
    assert predict_step([duplex], forward_backward_seconds=0.1, overlapped=True, **run) < predict_step(
        [one_pipe], forward_backward_seconds=0.1, overlapped=True, **run
    )


def test_with_no_backward_to_hide_behind_the_model_puts_the_overlapped_step_at_the_split_one():
    # A batch of 8 on two devices 2x apart (benchmarks/two_paths.py): the backward takes milliseconds, so every
    # write of the step spills past it and the last record's drains among them in both formulas (it was added on
    # top in the overlapped one: 1.24 s against the split's 1.01 s, where the runs measured both alike).
    paths = [PathSpeed("fast", 300e6, 300e6, serial=0.0), PathSpeed("slow", 150e6, 150e6, serial=0.0)]
    run = {"num_records": 8, "record_bytes": 48 * 2**20, "cache_bytes": 96 * 2**20, "prefetch_records": 4, "run_on": 4}
    split = predict_step(paths, forward_backward_seconds=0.04, overlapped=False, **run)
    overlapped = predict_step(paths, forward_backward_seconds=0.04, overlapped=True, **run)
    assert split <= overlapped <= 1.01 * split, (overlapped, split)


def test_plan_prints_both_steps_and_takes_a_full_duplex_path(capsys):
    assert speeds.declared_speed("nvme=4GB/s:2GB/s:duplex") == PathSpeed("nvme", 4e9, 2e9, 0.0)
    assert speeds.declared_speed("nvme=4GB/s:2GB/s").serial == 1.0
    common = ["plan", "--params", "2e8", "--compute-s", "2", "--host-cache", "256MiB"]
    steps = {}
    for entry in ("disk=1GB/s", "disk=1GB/s:1GB/s:duplex"):
        assert cli.main([*common, "--paths", entry]) == 0
        out = capsys.readouterr().out
        steps[entry] = [line.split()[2:4] for line in out.splitlines() if line.strip().startswith("step, ")]
    for rows in steps.values():
        assert len(rows) == 2 and float(rows[1][0]) < float(rows[0][0]), rows
    assert float(steps["disk=1GB/s:1GB/s:duplex"][0][0]) < float(steps["disk=1GB/s"][0][0])


ROOT = pathlib.Path(__file__).parents[1]


def test_the_overlap_benchmark_runs_both_routes_beside_each_other_and_the_model(tmp_path):
    result = load_module(ROOT / "benchmarks" / "overlap.py").main(["--smoke", "--out", str(tmp_path)])
    written = tmp_path / f"overlap_emulated_{result['layers']}x{result['width']}.json"
    assert json.loads(written.read_text()) == json.loads(json.dumps(result))
    (run,) = result["factors"][0]["runs"]
    assert run["split"]["rolled_back"] == run["overlapped"]["rolled_back"] == 0
    assert sum(run["overlapped"]["overlapped"][:5]) > 0 and sum(run["split"]["overlapped"]) == 0
    # the library's trial of both modes (steps 5-8 split: nothing overlapped), then the faster
    assert sum(run["overlapped"]["overlapped"][5:9]) == 0 and len(run["overlapped"]["step_s"]) == 9 + 3
    chosen = run["overlapped"]["fallback"][9]
    assert run["overlapped"]["fallback"] == [False] * 9 + [chosen] * 3
    assert not chosen or sum(run["overlapped"]["overlapped"][9:]) == 0
    assert set(run["model_s"]) == {"split", "overlapped"} and result["disk_s"] > 0


def test_the_gpu_overlap_benchmark_dry_run_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    script = ROOT / "benchmarks" / "gpu" / "overlap_step.py"
    done = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--out", str(tmp_path)], env=env, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "overlap_step.json").read_text())
    assert result["dry_run"] and result["exact"] and result["backward"]["stall"] > 0
    assert len(result["step"]["subgroups_before_update"]) == 3


def test_an_nnx_model_overlaps_through_its_param_state(tmp_path):
    from flax import nnx

    def run(overlapped: bool):
        model = nnx.Sequential(*[nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(i)) for i in range(LAYERS)])
        offload = jax_mlp.mlp_offload(optax.adamw(1e-2), paths=[tmp_path / str(overlapped)], subgroup_size=SUBGROUP)

        def loss_of(model, x):
            if overlapped:
                nnx.update(model, offload.overlap(nnx.state(model, nnx.Param)))
            return jnp.mean(jnp.tanh(model(x)) ** 2)

        grads_of = nnx.jit(nnx.grad(loss_of))
        stats = []
        with offload:
            state = offload.init(nnx.state(model, nnx.Param))
            for step in range(4):
                grads = grads_of(model, batch(step))
                params = nnx.state(model, nnx.Param)
                updates, state = offload.update(grads, state, params)
                nnx.update(model, optax.apply_updates(params, updates))
                stats.append(offload.stats)
        return nnx.state(model, nnx.Param), stats

    plain, _ = run(False)
    overlapped, stats = run(True)
    assert_same_bits(overlapped, plain, "nnx")
    assert sum(s.overlap_bytes > 0 for s in stats) > len(stats) // 2 and not any(s.rolled_back for s in stats)
