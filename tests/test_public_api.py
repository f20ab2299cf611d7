"""``jax_mlp/__init__.py``: the public face (``jax_mlp``, ``jax_mlp.quantized``, ``jax_mlp.report``), its one
handle, the typed options, and the names deprecated with a dated removal."""

from __future__ import annotations

import inspect

import optax
import pytest

import jax_mlp
from jax_mlp._src.config import OffloadConfig, OffloadOptions
from jax_mlp._src.offload.offloader import Offloader


def test_every_public_name_is_named_by_its_public_path():
    """Tracebacks and reprs say ``jax_mlp.OffloadError``, not where it is implemented."""
    for name in jax_mlp.__all__:
        assert getattr(jax_mlp, name).__module__ == "jax_mlp", name
    assert repr(jax_mlp.PeerError) == "<class 'jax_mlp.PeerError'>"


def test_the_public_namespaces_import_on_first_use():
    assert "bf16" in jax_mlp.quantized.CODECS
    assert jax_mlp.report.load_log is jax_mlp.report.__dict__["load_log"]
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = jax_mlp.nothing


def test_the_offloader_is_private_and_its_old_public_name_warns_with_its_removal():
    assert "Offloader" not in jax_mlp.__all__
    with pytest.warns(
        DeprecationWarning, match=r"jax_mlp\.Offloader is deprecated and goes in 0\.4 \(after 2027-06-01\)"
    ):
        assert jax_mlp.Offloader is Offloader


def test_the_flat_layouts_module_paths_are_gone():
    """Dropped at 0.3 (CHANGELOG.md): the old paths no longer import."""
    with pytest.raises(ModuleNotFoundError):
        __import__("jax_mlp.partition")


def test_one_handle_is_an_optax_transformation_with_every_verb(tmp_path):
    """What ``mlp_offload`` returns is a ``GradientTransformationExtraArgs`` and carries every verb and view."""
    import jax.numpy as jnp

    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[tmp_path]) as offload:
        assert isinstance(offload, optax.GradientTransformationExtraArgs)
        assert offload.plan is None and offload.step == 0 and offload.stats is None
        params = {"w": jnp.ones((4, 3))}
        state = offload.init(params)
        for verb in ("apply", "apply_to", "overlap", "flush", "close", "pin", "read_pinned", "set_caps", "plan_for"):
            assert callable(getattr(offload, verb)), verb
        _, state = optax.chain(offload).update({"w": jnp.ones((4, 3))}, (state,), params)
        assert offload.step == 1 and offload.plan.leaves[0].shape == (4, 3) and offload.stats.step == 1
        assert list(offload.scheduler.placement) == [0] and offload.config.paths[0].name == str(tmp_path)
    with pytest.raises(TypeError, match=r"not an optax\.chain holding it"):
        jax_mlp.restore_params(optax.chain(offload), params)


def test_the_typed_options_are_the_configs_arguments():
    """``mlp_offload(**options: Unpack[OffloadOptions])``: a type checker sees every option, with the config's types."""
    parameters = inspect.signature(OffloadConfig).parameters
    said = {name: getattr(hint, "__forward_arg__", hint) for name, hint in OffloadOptions.__annotations__.items()}
    assert list(said) == list(parameters)
    config = {name: p.annotation for name, p in parameters.items()}
    assert said == {**config, "paths": f"Required[{config['paths']}]"}
    assert jax_mlp.mlp_offload.__annotations__["options"] == "Unpack[OffloadOptions]"
