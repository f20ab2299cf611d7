"""``stream/transfer.py``: the pinned path (through the device's pinned_host memory) moves the same bits as the plain
one.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import as_bits, assert_same_bits, make_params, train

import jax_mlp
from jax_mlp import OffloadError
from jax_mlp._src.stream.transfer import Transfer, choose, has_pinned_host

STEPS = 3


def _train(paths, transfer: str, *, apply: bool):
    """Offloaded adam for ``STEPS`` (eager updates, or the fused apply), with every record in the tiers."""
    params = make_params()
    with jax_mlp.mlp_offload(
        optax.adam(1e-2), paths=paths, subgroup_size="16KiB", host_cache="64KiB", transfer=transfer
    ) as tx:
        state = tx.init(params)
        init_transfer = tx.stats.transfer
        params, state = train(tx, params, state, range(STEPS), apply=apply)
        tx.flush()
        stats = tx.stats
    records = {str(p.relative_to(paths[0])): p.read_bytes() for p in paths[0].rglob("sg*/c/*") if p.is_file()}
    return params, (init_transfer, stats.transfer), records


@pytest.mark.parametrize("apply", [False, True], ids=["update", "fused_apply"])
def test_pinned_path_runs_on_cpu_and_moves_the_same_bits_as_the_plain_path(tmp_path, apply):
    assert has_pinned_host(jax.devices()[0]), "jax 0.10's CPU devices have a pinned_host memory kind"
    plain_params, plain_ran, plain_records = _train([tmp_path / "plain"], "plain", apply=apply)
    pinned_params, pinned_ran, pinned_records = _train([tmp_path / "pinned"], "pinned", apply=apply)
    assert plain_ran == ("plain", "plain") and pinned_ran == ("pinned", "pinned")
    assert_same_bits(pinned_params, plain_params, "params")
    assert len(plain_records) > 1 and pinned_records.keys() == plain_records.keys()
    assert pinned_records == plain_records, "the records on disk differ between the two paths"


def test_auto_is_plain_on_cpu_and_pinned_on_a_gpu_with_pinned_host():
    assert choose("auto", jax.devices()).name == "plain"  # on CPU the plain path aliases, the pinned one copies
    gpu = _FakeDevice("cuda", ("device", "pinned_host", "unpinned_host"))
    assert choose("auto", [gpu]).name == "pinned"
    assert choose("auto", [_FakeDevice("cuda", ("device",))]).name == "plain"
    assert choose("plain", [gpu]).name == "plain"


def test_pinned_is_refused_where_a_device_has_no_pinned_host_and_bad_options_are_refused(tmp_path):
    with pytest.raises(OffloadError, match=r"pinned_host memory on every device.*transfer='auto'"):
        choose("pinned", [_FakeDevice("tpu", ("device",))])
    with pytest.raises(OffloadError, match="transfer must be one of"):
        jax_mlp.mlp_offload(optax.adam(1e-3), paths=[tmp_path], transfer="fast")


def test_to_host_gives_views_of_the_pinned_copy_and_passes_host_arrays_through():
    device_array = jax.numpy.arange(1024.0)
    host_array = np.arange(4, dtype=np.uint8)
    pinned_out = Transfer("pinned").to_host([device_array, host_array])
    assert pinned_out[1] is host_array
    assert not pinned_out[0].flags.owndata  # a view of the pinned buffer, not a copy numpy made
    np.testing.assert_array_equal(as_bits(pinned_out[0]), as_bits(Transfer("plain").to_host([device_array])[0]))
    on_device = Transfer("pinned").to_device((host_array,), None)[0]
    assert on_device.sharding.memory_kind == "device"


class _FakeDevice:
    """A device of another platform, for the choice alone (no such device runs here)."""

    def __init__(self, platform: str, kinds: tuple[str, ...]):
        self.platform = platform
        self._kinds = kinds

    def addressable_memories(self):
        return [type("Memory", (), {"kind": kind})() for kind in self._kinds]

    def __repr__(self):
        return f"{self.platform}:0"
