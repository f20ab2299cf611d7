"""``offload/inputs.py`` and the offload's other refusals of what a user hands in: trees, leaves, shapes and
dtypes against the plan, params with no leaves or integer leaves, a master of the params' own dtype, paths that
cannot be used, ``init`` under jit, and ``params`` left out where optax allows it. Every refusal is an
``OffloadError`` (also a ``ValueError``) that names the leaf or path and says what to do, and loses nothing.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_close_to_optax, grads_at, make_params

import jax_mlp

SUBGROUP = "16KiB"


def test_mismatched_grads_tree_names_the_leaf(paths):
    params = make_params()
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP) as tx:
        state = tx.init(params)
        grads = grads_at(params, 0)
        missing = dict(grads)
        del missing["temperature"]
        with pytest.raises(jax_mlp.OffloadError, match=r"grads tree does not match.*\['temperature'\]"):
            tx.update(missing, state, params)
        reshaped = dict(grads, head=dict(grads["head"], w=jnp.zeros((10, 16))))
        with pytest.raises(
            jax_mlp.OffloadError, match=r"grads leaf \['head'\]\['w'\] has shape \(10, 16\).*\(16, 10\)"
        ):
            tx.update(reshaped, state, params)
        retyped = dict(params, embed=params["embed"].astype(jnp.bfloat16))
        with pytest.raises(jax_mlp.OffloadError, match=r"params leaf \['embed'\] has dtype bfloat16.*float32"):
            tx.update(grads, state, retyped)
        _updates, state = tx.update(grads, state, params)  # nothing was lost: the same update still works
        assert int(state.step) == 1


def _refused(call, match: str) -> None:
    """``call`` raises an OffloadError matching ``match``, which is also a ValueError."""
    with pytest.raises(jax_mlp.OffloadError, match=match) as caught:
        call()
    assert isinstance(caught.value, ValueError)


def test_bad_input_raises_an_offload_error_that_is_a_value_error_and_says_what_to_do(paths):
    """One ``except jax_mlp.OffloadError`` catches every refusal of bad input; ``except ValueError`` still does."""
    _refused(
        lambda: jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=0),
        r"subgroup_size must be positive, got 0: give the bytes of state to stream at once",
    )
    _refused(lambda: jax_mlp.quantized_state(optax.adam(1e-2), "fp8"), r"codec 'fp8' is not one of .*: pass one of")
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]]) as tx:
        _refused(lambda: tx.init({}), r"params has no leaves, so there is no optimizer state to offload: pass")
    params = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[1]]) as tx:
        state = tx.init(params)
        _refused(lambda: tx.update({"w": params["w"]}, state, params), r"missing leaves \[\"\['b'\]\"\]\. Pass grads")
        _refused(
            lambda: tx.update(dict(params, b=jnp.arange(8)), state, params),
            r"grads leaf \['b'\] has dtype int32, but only floating-point leaves can be optimized: cast it",
        )
    devices = jax.devices()[:2]  # each leaf whole on another device: no one mesh to map the update over
    spread = {"w": jax.device_put(params["w"], devices[0]), "b": jax.device_put(params["b"], devices[1])}
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[2]]) as tx:
        state = tx.init(spread)
        _refused(lambda: jax.jit(tx.update)(spread, state, spread), r"several devices, .*call tx.update outside jit")


def test_paths_that_cannot_be_used_are_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    params = make_params()
    with (
        pytest.raises(jax_mlp.PathError, match=f"path {blocker}/sub cannot be created"),
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[blocker / "sub"]) as tx,
    ):
        tx.init(params)
    with (
        pytest.raises(jax_mlp.PathError, match="path /sys is not writable"),
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=["/sys"]) as tx,
    ):
        tx.init(params)
    with pytest.raises(jax_mlp.OffloadError, match="is given twice"):
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "x", str(tmp_path / "x") + "/"])
    with pytest.raises(jax_mlp.OffloadError, match="host_cache='lots' is not a size"):
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path / "y"], host_cache="lots")


def test_init_under_jit_says_to_call_it_eagerly(paths):
    with (
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP) as tx,
        pytest.raises(jax_mlp.OffloadError, match="call init eagerly"),
    ):
        jax.jit(tx.init)(make_params())


def test_integer_params_are_refused_at_init_before_anything_is_written(paths):
    params = dict(make_params(), steps=jnp.zeros((3,), jnp.int32))
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP) as tx:
        with pytest.raises(jax_mlp.OffloadError, match=r"param leaf \['steps'\] has dtype int32") as refused:
            tx.init(params)
        assert "nnx.state(model, nnx.Param)" in str(refused.value)
        assert not list(Path(paths[0]).rglob("run.json")) and not list(Path(paths[0]).rglob("zarr.json"))


def test_update_without_params_matches_optax_and_needs_them_only_when_optax_does(paths):
    params = make_params()
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP) as tx:
        state = tx.init(params)
        updates, state = tx.update(grads_at(params, 0), state)
        expected, _ = optax.adam(1e-2).update(grads_at(params, 0), optax.adam(1e-2).init(params))
        assert_close_to_optax(updates, expected, bound=1e-6)

    with jax_mlp.mlp_offload(optax.adamw(1e-2), paths=[paths[1]], subgroup_size=SUBGROUP) as tx:
        state = tx.init(params)
        with pytest.raises(ValueError, match="params"):  # optax's own error: adamw needs params
            tx.update(grads_at(params, 0), state)


def test_a_master_of_the_params_own_dtype_is_refused_and_a_mixed_tree_keeps_one(paths):
    params = make_params()
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], master_dtype=jnp.float32) as tx:
        with pytest.raises(
            jax_mlp.OffloadError, match=r"every param leaf is already float32.*Leave master_dtype unset"
        ):
            tx.init(params)
        assert not list(Path(paths[0]).rglob("run.json"))
    mixed = dict(params, embed=params["embed"].astype(jnp.bfloat16))
    with jax_mlp.mlp_offload(
        optax.adam(1e-2), paths=[paths[1]], subgroup_size=SUBGROUP, master_dtype=jnp.float32
    ) as tx:
        tx.init(mixed)
        assert all(sg.layout.master_fields for sg in tx.plan.subgroups)
