"""``config.py`` and ``parsing.py``: ``OffloadConfig`` normalises human values once (paths, sizes, rates, dtypes, the
node lock, extra arguments) and refuses bad ones saying what to pass, its ``Literal`` choices named; ``Path``;
sizes, rates and storage locations parsed, and ``format_bytes``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import pathlib
import tempfile
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_mlp
from jax_mlp._src import config
from jax_mlp._src.config import OffloadConfig, total_memory
from jax_mlp._src.parsing import format_bytes, kvstore_url, parse_location, parse_rate, parse_size

LITERALS = {
    "order": config.Order,
    "flush": config.Flush,
    "placement": config.Placement,
    "transfer": config.TransferChoice,
    "master_storage": config.MasterStorage,
    "overlap_mode": config.OverlapMode,
}


def test_human_values_are_normalised_once_into_the_types_the_fields_hold(tmp_path):
    made = OffloadConfig(
        [tmp_path / "a", str(tmp_path / "b"), {"driver": "memory", "path": "run"}, jax_mlp.Path(tmp_path / "c")],
        host_cache="1GiB",
        subgroup_size="1.5MB",
        master_dtype=jnp.bfloat16,
        node_lock=tmp_path / "locks",
        extra_args={"value": jnp.zeros((), jnp.float32), "lr": jax.ShapeDtypeStruct((3,), jnp.bfloat16)},
        accumulator_dtype="bfloat16",
    )
    assert all(isinstance(path, jax_mlp.Path) for path in made.paths) and isinstance(made.paths, tuple)
    assert [path.location for path in made.paths] == [
        str(tmp_path / "a"),
        str(tmp_path / "b"),
        {"driver": "memory", "path": "run"},
        str(tmp_path / "c"),
    ]
    assert (made.host_cache, made.subgroup_size) == (2**30, 1_500_000)
    assert made.master_dtype == np.dtype(jnp.bfloat16) and made.accumulator_dtype == np.dtype(jnp.bfloat16)
    assert made.node_lock == str(tmp_path / "locks")
    assert made.extra_args == (
        ("lr", jax.ShapeDtypeStruct((3,), jnp.bfloat16)),
        ("value", jax.ShapeDtypeStruct((), jnp.float32)),
    ), "sorted by name, each as the shape and dtype it must have"
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.host_cache = 0


def test_one_path_a_relative_one_and_the_node_lock_switch_are_normalised_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    made = OffloadConfig("run", node_lock=True, master_dtype=None)
    assert made.paths == (jax_mlp.Path(str(tmp_path / "run")),)
    assert made.node_lock == os.path.join(tempfile.gettempdir(), "jax_mlp-locks")
    assert OffloadConfig("run").node_lock is None and OffloadConfig("run").master_dtype is None


def test_the_defaults_are_the_signatures_and_each_option_is_documented():
    defaults = OffloadConfig.defaults()
    signature = inspect.signature(OffloadConfig).parameters
    assert defaults == {name: p.default for name, p in signature.items() if name != "paths"}
    made = OffloadConfig("/x")
    assert made.subgroup_size == parse_size(defaults["subgroup_size"]) and made.host_cache == 0
    assert all(getattr(made, name) == defaults[name] for name in ("prefetch_depth", "order", "flush", "transfer"))
    doc = OffloadConfig.options_doc()
    assert doc.lstrip().startswith("paths:")
    assert all(f"{field.name}:" in doc for field in dataclasses.fields(OffloadConfig))


def test_every_literal_option_takes_its_choices_and_refuses_others_naming_them():
    hints = typing.get_type_hints(OffloadConfig, globalns=vars(config))
    literal = {name for name, hint in hints.items() if typing.get_origin(hint) is typing.Literal}
    assert literal == set(LITERALS), "each Literal option is checked here"
    for name, kind in LITERALS.items():
        choices = typing.get_args(kind)
        assert len(choices) >= 2
        for choice in choices:
            assert getattr(OffloadConfig("/x", **{name: choice}), name) == choice
        with pytest.raises(jax_mlp.OffloadError) as refused:
            OffloadConfig("/x", **{name: "bogus"})
        assert str(refused.value) == f"{name} must be one of {choices}, got 'bogus': pass one of those"


BAD_OPTIONS = [
    ({"prefetch_depth": 0}, "prefetch_depth must be at least 1, got 0: pass 1 or more"),
    ({"write_depth": -1}, "write_depth must be at least 1, got -1: pass 1 or more"),
    ({"max_inflight": 0}, "max_inflight must be at least 1, got 0: pass 1 or more"),
    ({"io_timeout": 0}, "io_timeout must be positive, got 0: pass a number of seconds"),
    ({"peer_timeout": -1.0}, "peer_timeout must be positive, got -1.0: pass a number of seconds"),
    ({"subgroup_size": "0"}, "subgroup_size must be positive, got 0: give the bytes of state to stream at once"),
    ({"master_dtype": jnp.int8}, "master_dtype must be a floating dtype, got int8: pass jnp.float32"),
    ({"accumulator_dtype": np.int32}, "accumulator_dtype must be a floating dtype, got int32"),
    ({"accumulate_steps": 2.0}, "accumulate_steps must be a whole number of calls, at least 1, got 2.0"),
    ({"host_cache": "8 apples"}, "host_cache='8 apples' is not a size: write a number of bytes"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS, ids=[next(iter(o)) for o, _ in BAD_OPTIONS])
def test_bad_options_are_refused_saying_what_to_pass(options, message):
    with pytest.raises(jax_mlp.OffloadError) as refused:
        OffloadConfig("/x", **options)
    assert str(refused.value).startswith(message), str(refused.value)


def test_no_paths_and_extra_arguments_that_are_not_arrays_are_refused():
    with pytest.raises(jax_mlp.OffloadError, match=r"^paths is empty: give at least one directory"):
        OffloadConfig([])
    with pytest.raises(
        TypeError, match=r"^extra_args\['fn'\] must be an array or a jax.ShapeDtypeStruct, got function"
    ):
        OffloadConfig("/x", extra_args={"fn": lambda: 0})


def test_a_path_parses_its_rates_and_knows_when_two_are_the_same_storage(tmp_path):
    path = jax_mlp.Path(tmp_path, max_read="400MB/s", max_write="2GiB/s", read_bandwidth=5e9)
    assert (path.max_read, path.max_write, path.read_bandwidth, path.write_bandwidth) == (4e8, 2 * 2**30, 5e9, None)
    assert path.name == str(tmp_path)
    assert jax_mlp.Path(tmp_path / "run").identity == jax_mlp.Path(f"{tmp_path}/run/").identity
    assert jax_mlp.Path(tmp_path / "a").identity != jax_mlp.Path(tmp_path / "b").identity
    link = tmp_path / "link"
    (tmp_path / "target").mkdir()
    link.symlink_to(tmp_path / "target")
    assert jax_mlp.Path(link).identity == jax_mlp.Path(tmp_path / "target").identity, "the real directory"
    with pytest.raises(jax_mlp.OffloadError, match="given twice"):
        OffloadConfig([link, tmp_path / "target"])
    with pytest.raises(jax_mlp.OffloadError, match=r"^max_read='fast' is not a size"):
        jax_mlp.Path(tmp_path, max_read="fast")
    with pytest.raises(jax_mlp.OffloadError, match=r"^write_bandwidth='0MB/s' must be positive"):
        jax_mlp.Path(tmp_path, write_bandwidth="0MB/s")


def test_sizes_accept_human_units():
    assert jax_mlp.parse_size("256MiB") == 256 * 1024**2
    assert jax_mlp.parse_size("1.5GB") == 1_500_000_000
    assert jax_mlp.parse_size(4096) == 4096
    assert jax_mlp.parse_size("0") == 0


UNITS = [("1", 1), ("12B", 12), ("2k", 2000), ("2KB", 2000), ("2KiB", 2048), (" 3 mib ", 3 * 2**20), ("1e3", 1000)]
UNITS += [("0.5GiB", 2**29), ("2TB", 2 * 10**12), ("1TiB", 2**40), (".25MiB", 2**18), (7.9, 7), (np.int64(5), 5)]


@pytest.mark.parametrize(("text", "size"), UNITS)
def test_every_unit_is_parsed_alike(text, size):
    assert parse_size(text) == size


def test_what_is_not_a_size_or_a_rate_is_refused_naming_the_option():
    with pytest.raises(jax_mlp.OffloadError, match=r"^cache='-1MiB' is not a size"):
        parse_size("-1MiB", name="cache")
    with pytest.raises(jax_mlp.OffloadError, match=r"^cache=-5 must not be negative"):
        parse_size(-5, name="cache")
    with pytest.raises(jax_mlp.OffloadError, match=r"^size='5 parsecs' is not a size"):
        parse_size("5 parsecs")
    with pytest.raises(TypeError, match="got True"):
        parse_size(True)
    assert parse_rate(None) is None and parse_rate("400MB/s") == 4e8 and parse_rate(" 2GiB/s ") == 2 * 2**30
    with pytest.raises(jax_mlp.OffloadError, match=r"^cap=0 must be positive"):
        parse_rate(0, name="cap")


def test_format_bytes_is_the_inverse_of_parse_size_within_its_one_decimal():
    assert [format_bytes(n) for n in (0, 512, 1023, 1024, 1536 * 1024, 5 * 2**30)] == [
        "0 B",
        "512 B",
        "1023 B",
        "1.0 KiB",
        "1.5 MiB",
        "5.0 GiB",
    ]
    assert format_bytes(5 * 2**50) == "5120.0 TiB", "TiB is the largest unit"
    for n in (1, 999, 4097, 3 * 10**6 + 7, 2**33 + 12345, 7 * 10**13):
        assert abs(parse_size(format_bytes(n)) - n) <= 0.05 * n, format_bytes(n)


def test_locations_are_absolute_directories_or_kvstore_specs(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_location("~/run") == str(tmp_path / "run")
    assert parse_location(pathlib.Path("a") / "b") == os.path.abspath("a/b")
    assert parse_location("file:///tmp/run") == "/tmp/run"
    assert parse_location("memory://x/") == {"driver": "memory", "path": "x/"}
    spec = {"driver": "s3", "bucket": "b", "path": "p"}
    assert parse_location(spec) == spec and parse_location(spec) is not spec
    with pytest.raises(
        jax_mlp.OffloadError, match=r"is a dict but not a tensorstore kvstore spec: it needs a 'driver'"
    ):
        parse_location({"path": "x"})
    assert kvstore_url(spec) == "s3://b/p/" and kvstore_url({"driver": "gcs", "bucket": "g"}) == "gs://g/"
    assert kvstore_url({"driver": "memory", "path": "a/b/"}) == "memory://a/b/"


def test_a_host_cache_larger_than_the_memory_is_refused_when_the_offload_is_made(paths):
    memory = total_memory()
    with pytest.raises(jax_mlp.OffloadError, match=r"host_cache=.* is larger than this machine's memory") as refused:
        jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], host_cache=2 * memory)
    assert jax_mlp.format_bytes(memory) in str(refused.value)
    assert not list(Path(paths[0]).rglob("run.json"))
