"""The harness of real throttled devices (``benchmarks/devices.py``) really throttles.

Multi-path placement has to hold on devices that the kernel throttles (each direction apart, with
bursts after idle time), not only on the library's own token buckets; this checks the harness that
makes such devices. It needs root, cgroup v1's blkio controller and loop devices, and skips with the
reason where they are missing.
"""

from __future__ import annotations

import mmap
import os
import pathlib
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import devices


@pytest.fixture
def throttled():
    """One real loop device throttled by the kernel to 20 MB/s each way, this process in its cgroup."""
    try:
        devices.check_support()
    except devices.Unsupported as error:
        pytest.skip(str(error))
    with devices.throttled_devices([devices.Throttle(20e6, 20e6)], 256 * 2**20) as made:
        devices.join(made)
        yield made.devices[0]


def test_the_harness_throttles_direct_writes(throttled):
    buffer = mmap.mmap(-1, 2**20)  # page-aligned, as O_DIRECT needs
    fd = os.open(os.path.join(throttled.mount, "data"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    start = time.monotonic()
    try:
        for _ in range(32):
            os.write(fd, buffer)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert time.monotonic() - start >= 1.3, "32 MiB at 20 MB/s take 1.68 s, less what a burst lets through"
