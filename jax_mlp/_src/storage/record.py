"""The record: one subgroup's state at one step, as a sealed, checksummed buffer.

A record is a 64-byte header (magic, version, step, payload size, layout hash, and a CRC-32 of the
header and payload) followed by the raw payload: the subgroup's state leaves, then its master
leaves, each at a 64-byte-aligned offset (its :class:`RecordLayout`, computed by :mod:`jax_mlp._src.plan.partition`).
Step ``s`` of subgroup ``k`` lives in slot ``s % 2`` of its path, so writing step ``s + 1`` never touches step ``s``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

# ISA-L's CRC-32 is zlib's (the same polynomial and bits, so every record ever written still
# verifies) at 28 GB/s here against zlib's 2.5; a hardware CRC32C was no faster (docs/efficiency.md).
from isal.isal_zlib import crc32

from jax_mlp._src.errors import OffloadError, RecordError
from jax_mlp._src.storage.buffers import ALIGNMENT, aligned_buffer, round_up

HEADER_SIZE = 64
CHUNK_BYTES = 4 * 1024**2
"""About the size of a record's zarr3 chunk (see :func:`chunk_bytes`), and of a checkpoint's where it has the choice."""
RECORD_REMEDY = "restore the last checkpoint, or resume from the tiers at the last complete step"
"""What to do about a record that is missing, damaged or of another step."""
_MAGIC = b"JMLP"
_VERSION = 1
_HEADER = struct.Struct("<4sHxxqQ16s")  # magic, version, step, payload bytes, layout hash
_CRC_OFFSET = HEADER_SIZE - 4  # the CRC-32 of bytes [0, 60) and of the payload ends the header


class Field(NamedTuple):
    """One array inside a record payload."""

    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class RecordLayout(NamedTuple):
    """Where each state leaf and master leaf of a subgroup lives inside its record payload."""

    state_treedef: Any
    state_fields: tuple[Field, ...]
    master_fields: tuple[Field, ...]
    nbytes: int


def record_name(subgroup: int, slot: int) -> str:
    """The key of subgroup ``subgroup``'s record in ``slot``, relative to a path's directory."""
    return f"sg{subgroup:06d}.{slot}"


def chunk_bytes(nbytes: int) -> int:
    """The zarr chunk size of a record of ``nbytes``: about ``CHUNK_BYTES``, equal chunks, block-aligned.

    zarr stores an edge chunk at full size, so splitting evenly wastes less than a block per chunk
    where fixed 4 MiB chunks would store a 64 MiB + 64 B record as 68 MiB. Block-aligned chunks
    can be moved with O_DIRECT.
    """
    count = -(-nbytes // CHUNK_BYTES)
    return round_up(-(-nbytes // count), ALIGNMENT)


def new_record(payload_nbytes: int, *, zeroed: bool = True) -> np.ndarray:
    """An aligned buffer for a record (header room plus payload), padded with zeros up to whole
    chunks, so every chunk file is written straight from it.

    Args:
      payload_nbytes: the payload's size.
      zeroed: zero the header and payload too; pass False when the caller writes every byte (as
        :func:`pack` and :func:`seal` do), which saves a pass over a reused buffer.
    """
    nbytes = HEADER_SIZE + payload_nbytes
    buffer = aligned_buffer(round_up(nbytes, chunk_bytes(nbytes)), zeroed=zeroed)
    buffer[nbytes:] = 0
    return buffer[:nbytes]


def payload_of(record: np.ndarray) -> np.ndarray:
    """The payload part of a record buffer (a view)."""
    return record[HEADER_SIZE:]


def _checksum(record: np.ndarray) -> int:
    return crc32(payload_of(record), crc32(record[:_CRC_OFFSET]))


def seal(record: np.ndarray, step: int, layout_hash: bytes) -> None:
    """Writes the header of ``record`` for ``step``, ending with the checksum of header and payload.

    Records are made only as fields leave RAM for a path (:meth:`TierStack.write`), so fields
    that live and die in the host cache never pay for the checksum (with zlib it was 40% of a
    cached update here).
    """
    fields = _HEADER.pack(_MAGIC, _VERSION, step, record.nbytes - HEADER_SIZE, layout_hash)
    record[:HEADER_SIZE] = 0
    record[: _HEADER.size] = np.frombuffer(fields, np.uint8)
    record[_CRC_OFFSET:HEADER_SIZE] = np.frombuffer(struct.pack("<I", _checksum(record)), np.uint8)


class Header(NamedTuple):
    """The decoded header of a record."""

    step: int
    payload_nbytes: int
    layout_hash: bytes
    checksum: int


def read_header(record: np.ndarray, name: str) -> Header:
    """Decodes a record's header; raises RecordError naming ``name`` when it is not one."""
    if record.nbytes < HEADER_SIZE:
        raise RecordError(f"record {name} is truncated ({record.nbytes} bytes, less than its header); {RECORD_REMEDY}")
    magic, version, step, nbytes, layout_hash = _HEADER.unpack(record[: _HEADER.size].tobytes())
    (checksum,) = struct.unpack("<I", record[_CRC_OFFSET:HEADER_SIZE].tobytes())
    if magic != _MAGIC or version != _VERSION:
        raise RecordError(
            f"record {name} has no jax_mlp header: it is not a jax_mlp record or it was never written; {RECORD_REMEDY}"
        )
    return Header(step, nbytes, layout_hash, checksum)


def verify(record: np.ndarray, *, name: str, step: int, layout_hash: bytes) -> np.ndarray:
    """Checks a record read back from storage and returns its payload.

    Raises:
      RecordError: naming the record, when the header, size, checksum, layout hash or step is wrong.
    """
    header = read_header(record, name)
    if header.payload_nbytes != record.nbytes - HEADER_SIZE:
        raise RecordError(
            f"record {name} is truncated: {record.nbytes - HEADER_SIZE} of {header.payload_nbytes} bytes; "
            + RECORD_REMEDY
        )
    if _checksum(record) != header.checksum:
        raise RecordError(f"record {name} fails its checksum: it is corrupt or torn; {RECORD_REMEDY}")
    if header.layout_hash != layout_hash:
        raise RecordError(
            f"record {name} belongs to another run or subgroup layout (layout hash {header.layout_hash.hex()}, "
            f"expected {layout_hash.hex()}); use a fresh directory or the same params, optimizer and subgroup_size"
        )
    if header.step != step:
        raise RecordError(f"record {name} holds step {header.step}, expected step {step}; {RECORD_REMEDY}")
    return payload_of(record)


def pack(
    layout: RecordLayout, state_leaves: Sequence[np.ndarray], master_leaves: Sequence[np.ndarray], out: np.ndarray
) -> None:
    """Copies a subgroup's state and master leaves into ``out``, a uint8 payload buffer.

    Every byte of ``out`` is written, the alignment gaps with zeros, so ``out`` may hold old data.
    """
    end = 0
    for index, (field, value) in enumerate(
        zip((*layout.state_fields, *layout.master_fields), (*state_leaves, *master_leaves), strict=True)
    ):
        value = np.asarray(value)
        if value.shape != field.shape or value.dtype != field.dtype:
            raise OffloadError(
                f"{_field_name(layout, index)} is {value.dtype}{list(value.shape)}, but inner.init laid it out as "
                f"{field.dtype}{list(field.shape)}: the inner optimizer's update must return each state leaf with "
                "the shape and dtype its init gave it (cast it back in the optimizer)"
            )
        out[end : field.offset] = 0
        out[field.offset : field.offset + field.nbytes].view(field.dtype).reshape(field.shape)[...] = value
        end = field.offset + field.nbytes
    out[end:] = 0


def _field_name(layout: RecordLayout, index: int) -> str:
    """How errors name field ``index`` of ``layout``: the state leaf by its path in the subgroup's inner state."""
    count = len(layout.state_fields)
    if index >= count:
        return f"master param {index - count} of the subgroup"
    numbered = jax.tree_util.tree_unflatten(layout.state_treedef, range(count))
    path = jax.tree_util.tree_flatten_with_path(numbered)[0][index][0]
    return f"state leaf {jax.tree_util.keystr(path)}"


def unpack(layout: RecordLayout, payload: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Views of a record payload as the subgroup's state leaves and master leaves (no copy)."""

    def read(field: Field) -> np.ndarray:
        return payload[field.offset : field.offset + field.nbytes].view(field.dtype).reshape(field.shape)

    return [read(f) for f in layout.state_fields], [read(f) for f in layout.master_fields]


class RecordCodec(NamedTuple):
    """How a subgroup's fields become a sealed record and back; the tiers never look inside fields.

    Attributes:
      pack: ``pack(subgroup, fields, step)`` returns a sealed record of ``fields`` at ``step``.
      unpack: ``unpack(subgroup, payload)`` returns the fields a verified payload holds.
    """

    pack: Callable[[int, Any, int], np.ndarray]
    unpack: Callable[[int, np.ndarray], Any]


def record_codec(layouts: Sequence[RecordLayout], layout_hash: bytes) -> RecordCodec:
    """Packs a subgroup's (state leaves, master leaves) into a sealed record by its layout, and back.

    Args:
      layouts: each subgroup's record layout, by subgroup index.
      layout_hash: the hash of the whole layout, sealed into every record.

    Returns:
      The codec the tiers pack and unpack records with.
    """

    def pack_record(index: int, fields: tuple, step: int) -> np.ndarray:
        layout = layouts[index]
        record = new_record(layout.nbytes, zeroed=False)  # pack and seal write every byte
        pack(layout, *fields, payload_of(record))
        seal(record, step, layout_hash)
        return record

    def unpack_record(index: int, payload: np.ndarray) -> tuple:
        return unpack(layouts[index], payload)

    return RecordCodec(pack_record, unpack_record)
