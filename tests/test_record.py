"""``storage/record.py``: a record's layout, ``pack``/``unpack``, header, ``seal`` and ``verify`` (a torn, truncated,
foreign, other-run or other-step record is refused, naming it), chunk sizes and the codec; and records caught by
their checksum, or sealed by zlib's CRC-32, through a whole offload.
"""

from __future__ import annotations

import math
import zlib

import jax
import numpy as np
import optax
import pytest
from helpers import assert_same_bits, grads_at, make_params, run_offload, train

import jax_mlp
from jax_mlp._src.plan import partition
from jax_mlp._src.storage import record
from jax_mlp._src.storage.buffers import ALIGNMENT
from jax_mlp._src.storage.record import CHUNK_BYTES, HEADER_SIZE, RECORD_REMEDY

SUBGROUP = "16KiB"
TREE = {"w": jax.ShapeDtypeStruct((5, 3), np.float32), "s": jax.ShapeDtypeStruct((), np.float32)}


@pytest.fixture(scope="module")
def planned():
    """A one-subgroup plan of adam on ``TREE``: its layout and layout hash, and a codec of them."""
    plan = partition.make_plan(TREE, optax.adam(1e-3), 1 << 20)
    layout = plan.subgroups[0].layout
    return layout, plan.layout_hash, record.record_codec([layout], plan.layout_hash)


def fields_of(layout, seed=0):
    """State leaves of ``layout``'s shapes and dtypes with distinct values, and no master leaves."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(f.shape).astype(f.dtype) for f in layout.state_fields], []


def sealed(planned, step=7, seed=0):
    layout, _, codec = planned
    return codec.pack(0, fields_of(layout, seed), step)


def test_a_sealed_record_verifies_and_unpacks_to_what_was_packed(planned):
    layout, layout_hash, codec = planned
    fields = fields_of(layout)
    packed = codec.pack(0, fields, 7)
    assert packed.dtype == np.uint8 and packed.nbytes == HEADER_SIZE + layout.nbytes
    header = record.read_header(packed, "sg000000.1")
    assert (header.step, header.payload_nbytes, header.layout_hash) == (7, layout.nbytes, layout_hash)
    payload = record.verify(packed, name="sg000000.1", step=7, layout_hash=layout_hash)
    state, master = codec.unpack(0, payload)
    assert master == []
    assert_same_bits(state, fields[0])


def test_pack_and_unpack_round_trip():
    tree = {"w": jax.ShapeDtypeStruct((5, 3), np.float32), "s": jax.ShapeDtypeStruct((), np.float32)}
    plan = partition.make_plan(tree, optax.adam(1e-3), 1 << 20)
    layout = plan.subgroups[0].layout
    values = [
        np.arange(np.prod(f.shape), dtype=f.dtype).reshape(f.shape) + i for i, f in enumerate(layout.state_fields)
    ]
    payload = np.zeros(layout.nbytes, np.uint8)
    record.pack(layout, values, [], payload)
    state, master = record.unpack(layout, payload)
    assert master == []
    for got, want in zip(state, values, strict=True):
        np.testing.assert_array_equal(got, want)
    # A reused buffer full of old bytes packs to the same payload: every byte, gaps too, is written.
    reused = np.full(layout.nbytes, 0xFF, np.uint8)
    record.pack(layout, values, [], reused)
    np.testing.assert_array_equal(reused, payload)


def refusal(packed, planned, step=7, layout_hash=None, name="/nvme/proc0000/sg000000.1"):
    """The RecordError ``verify`` raises for ``packed``; it names the record."""
    with pytest.raises(jax_mlp.RecordError) as refused:
        record.verify(packed, name=name, step=step, layout_hash=layout_hash or planned[1])
    message = str(refused.value)
    assert message.startswith(f"record {name} "), message
    return message


def test_a_torn_record_fails_its_checksum_wherever_the_tear_is(planned):
    """A flipped bit in the payload or the header, a tail of zeros (half the record reached the disk), or the
    head of one step's record with the tail of another's: each is refused, and never read as data."""
    torn = f"fails its checksum: it is corrupt or torn; {RECORD_REMEDY}"
    flipped = sealed(planned)
    flipped[HEADER_SIZE + 5] ^= 0x40
    assert refusal(flipped, planned).endswith(torn)
    header = sealed(planned, step=7)
    header[8] ^= 0x01  # the step's low byte (7 becomes 6): the checksum covers every byte of the header
    assert refusal(header, planned, step=6).endswith(torn)
    half = sealed(planned)
    half[half.nbytes // 2 :] = 0
    assert refusal(half, planned).endswith(torn)
    mixed = sealed(planned, step=7)
    mixed[HEADER_SIZE + 64 :] = sealed(planned, step=7, seed=1)[HEADER_SIZE + 64 :]
    assert refusal(mixed, planned).endswith(torn)


def test_a_truncated_record_says_how_much_of_it_there_is(planned):
    packed = sealed(planned)
    cut = packed[: HEADER_SIZE + 100]
    assert refusal(cut, planned).endswith(f"is truncated: 100 of {packed.nbytes - HEADER_SIZE} bytes; {RECORD_REMEDY}")
    assert refusal(packed[:10], planned).endswith(f"is truncated (10 bytes, less than its header); {RECORD_REMEDY}")


def test_a_foreign_or_never_written_record_has_no_header(planned):
    expected = "has no jax_mlp header: it is not a jax_mlp record or it was never written"
    assert expected in refusal(np.zeros_like(sealed(planned)), planned)
    other = sealed(planned)
    other[:4] = np.frombuffer(b"ZARR", np.uint8)
    assert expected in refusal(other, planned)


def test_a_record_of_another_layout_or_step_is_refused_naming_both(planned):
    _, layout_hash, _ = planned
    other_hash = bytes(15) + b"\x01"
    assert (
        f"belongs to another run or subgroup layout (layout hash {layout_hash.hex()}, expected {other_hash.hex()}); "
        "use a fresh directory or the same params, optimizer and subgroup_size"
    ) in refusal(sealed(planned), planned, layout_hash=other_hash)
    assert refusal(sealed(planned, step=7), planned, step=8).endswith(f"holds step 7, expected step 8; {RECORD_REMEDY}")
    assert record.verify(sealed(planned, step=8), name="x", step=8, layout_hash=layout_hash).nbytes > 0


def test_pack_refuses_a_leaf_of_another_shape_or_dtype_naming_it_by_its_path(planned):
    layout, _, _ = planned
    payload = np.zeros(layout.nbytes, np.uint8)
    state, master = fields_of(layout)
    # adam's state is (ScaleByAdamState(count, mu, nu), EmptyState()): field 1 is mu['s'], field 2 mu['w']
    retyped = [*state[:1], state[1].astype(np.float16), *state[2:]]
    with pytest.raises(
        jax_mlp.OffloadError, match=r"^state leaf \[0\]\.mu\['s'\] is float16\[\], but inner\.init laid"
    ):
        record.pack(layout, retyped, master, payload)
    reshaped = [*state[:2], state[2].reshape(3, 5), *state[3:]]
    with pytest.raises(jax_mlp.OffloadError, match=r"state leaf \[0\]\.mu\['w'\] is float32\[3, 5\].*float32\[5, 3\]"):
        record.pack(layout, reshaped, master, payload)


@pytest.mark.parametrize("nbytes", [1, ALIGNMENT, CHUNK_BYTES, CHUNK_BYTES + 1, 64 * 2**20 + 64, 300 * 2**20 + 7])
def test_chunks_are_equal_block_aligned_and_about_chunk_bytes(nbytes):
    chunk = record.chunk_bytes(nbytes)
    count = math.ceil(nbytes / chunk)
    assert chunk % ALIGNMENT == 0
    assert count == math.ceil(nbytes / CHUNK_BYTES), "as many chunks as CHUNK_BYTES would take"
    assert count * chunk - nbytes < count * ALIGNMENT, "less than a block wasted per chunk"


def test_a_new_record_is_header_room_plus_payload_and_names_follow_subgroup_and_slot():
    assert record.new_record(1000).nbytes == HEADER_SIZE + 1000 and not record.new_record(1000).any()
    assert record.payload_of(record.new_record(1000)).nbytes == 1000
    assert record.record_name(3, 1) == "sg000003.1" and record.record_name(123456, 0) == "sg123456.0"


def test_a_corrupt_record_is_caught_by_its_checksum(paths):
    params = make_params()
    # No read-ahead after init: it could read the record before the test corrupts it (with the default
    # depth of 4 it reaches subgroup 3).
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], subgroup_size=SUBGROUP, idle_prefetch=False) as tx:
        state = tx.init(params)
        chunk = paths[0] / "proc0000" / "sg000003.0" / "c" / "0"
        data = bytearray(chunk.read_bytes())
        data[HEADER_SIZE + 5] ^= 0x40
        chunk.write_bytes(bytes(data))
        with pytest.raises(jax_mlp.RecordError, match=r"sg000003\.0 fails its checksum"):
            tx.update(grads_at(params, 0), state, params)


def test_records_sealed_by_zlib_as_before_resume_and_train_on(paths, monkeypatch):
    """The default install used to seal records with zlib's CRC-32; ISA-L's is the same checksum."""
    params = make_params()
    options = dict(subgroup_size=SUBGROUP, host_cache=0)
    expected = run_offload(optax.adam(1e-2), params, 4, [paths[1]], **options)[0]

    with monkeypatch.context() as old_code:
        old_code.setattr(record, "crc32", zlib.crc32)
        with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], **options) as tx:
            current, _ = train(tx, params, tx.init(params), range(2))
    assert record.crc32 is not zlib.crc32
    with jax_mlp.mlp_offload(optax.adam(1e-2), paths=[paths[0]], resume=True, **options) as tx:
        state = tx.init(params)  # verifies every record of the last step
        assert int(state.step) == 2
        current, _ = train(tx, current, state, range(2, 4))
    assert_same_bits(current, expected)
