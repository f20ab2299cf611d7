"""Real throttled block devices for benchmarks and tests: loop-backed ext4 file systems under a blkio cgroup.

The library's own caps (a token bucket per path) pace transfers exactly as its scheduler models them,
so they cannot show where that model is wrong. These devices are throttled by the kernel instead:
each direction separately (``blkio.throttle.read_bps_device`` and ``write_bps_device`` of cgroup v1),
with the bursts a throttle lets through after idle time. Only direct I/O is throttled under cgroup v1
(buffered write-back is not charged to the writer's cgroup); records on local paths use ``O_DIRECT``.

    with throttled_devices([Throttle(300e6, 300e6), Throttle(100e6, 100e6)], size=1 << 30) as made:
        join(made)  # this process's I/O to them is now throttled
        paths = [jax_mlp.Path(device.mount) for device in made.devices]

Needs root, cgroup v1's blkio controller, loop devices and ``mkfs.ext4``; :func:`check_support`
raises :class:`Unsupported` with the reason where any is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

BLKIO = "/sys/fs/cgroup/blkio"


class Unsupported(RuntimeError):
    """This machine cannot make throttled devices (not root, no blkio cgroup v1, no loop devices or mkfs.ext4)."""


class Throttle(NamedTuple):
    """A device's kernel throttle, bytes/s in each direction."""

    read_bps: float
    write_bps: float


class Device(NamedTuple):
    """One throttled file system: where it is mounted, its loop device, and its ``MAJ:MIN``."""

    mount: str
    loop: str
    major_minor: str
    throttle: Throttle


class Devices(NamedTuple):
    """The devices made by :func:`throttled_devices`, and the blkio cgroup that throttles them."""

    devices: tuple[Device, ...]
    cgroup: str


def check_support() -> None:
    """Raises :class:`Unsupported` with the reason if throttled devices cannot be made here."""
    if os.geteuid() != 0:
        raise Unsupported("throttled devices need root (loop devices, mount, blkio cgroup)")
    if not os.path.exists(os.path.join(BLKIO, "blkio.throttle.read_bps_device")):
        raise Unsupported(f"no blkio cgroup v1 controller with throttling at {BLKIO}")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            raise Unsupported(f"{tool} is not installed")
    if subprocess.run(["losetup", "-f"], capture_output=True).returncode != 0:
        raise Unsupported("no free loop device (losetup -f failed)")


def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def throttled_devices(throttles: Sequence[Throttle], size: int, root: str | None = None) -> Iterator[Devices]:
    """Makes one loop-backed ext4 file system per throttle, each throttled in a fresh blkio cgroup.

    Everything made is torn down on exit, also after an error or a SIGTERM: processes in the cgroup are moved back
    to the root cgroup, file systems unmounted, loop devices detached, images and the cgroup removed.

    Args:
      throttles: each device's read and write rate.
      size: bytes of each file system's image (sparse).
      root: where the images and mount points go (default: a fresh temporary directory).

    Yields:
      The devices and their cgroup; :func:`join` puts a process in it.

    Raises:
      Unsupported: the machine cannot make them (see :func:`check_support`).
    """
    check_support()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_exit_on_sigterm())
        base = root or stack.enter_context(tempfile.TemporaryDirectory(prefix="jax_mlp_devices_"))
        cgroup = os.path.join(BLKIO, f"jax_mlp_{os.getpid()}")
        os.mkdir(cgroup)
        stack.callback(_remove_cgroup, cgroup)
        devices = tuple(
            stack.enter_context(_device(base, index, throttle, size, cgroup))
            for index, throttle in enumerate(throttles)
        )
        yield Devices(devices, cgroup)


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """Turns SIGTERM (``kill``, a test runner's timeout) into SystemExit, so the teardown runs; main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _device(base: str, index: int, throttle: Throttle, size: int, cgroup: str) -> Iterator[Device]:
    """One image, loop device, ext4 mount and throttle rule, undone in reverse order on exit."""
    image, mount = os.path.join(base, f"dev{index}.img"), os.path.join(base, f"dev{index}")
    with contextlib.ExitStack() as stack:
        with open(image, "wb") as f:
            f.truncate(size)
        stack.callback(os.remove, image)
        _run("mkfs.ext4", "-q", "-F", image)
        loop = _run("losetup", "-f", "--show", image)
        stack.callback(_run, "losetup", "-d", loop)
        os.makedirs(mount, exist_ok=True)
        stack.callback(os.rmdir, mount)
        _run("mount", loop, mount)
        stack.callback(_unmount, mount)
        rdev = os.stat(loop).st_rdev
        major_minor = f"{os.major(rdev)}:{os.minor(rdev)}"
        _write(os.path.join(cgroup, "blkio.throttle.read_bps_device"), f"{major_minor} {int(throttle.read_bps)}")
        _write(os.path.join(cgroup, "blkio.throttle.write_bps_device"), f"{major_minor} {int(throttle.write_bps)}")
        yield Device(mount, loop, major_minor, throttle)


def join(devices: Devices, pid: int | None = None) -> None:
    """Puts process ``pid`` (default: this one, all its threads) in the devices' cgroup: its I/O to them is throttled."""
    _write(os.path.join(devices.cgroup, "cgroup.procs"), str(pid or os.getpid()))


def _unmount(mount: str) -> None:
    """Unmounts ``mount``; if a process still holds files there (a run that failed), detaches it lazily."""
    if subprocess.run(["umount", mount], capture_output=True).returncode != 0:
        _run("umount", "-l", mount)


def _remove_cgroup(cgroup: str) -> None:
    """Moves every process left in ``cgroup`` back to the root cgroup, then removes it."""
    with open(os.path.join(cgroup, "cgroup.procs")) as f:
        pids = f.read().split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, OSError):
            _write(os.path.join(BLKIO, "cgroup.procs"), pid)
    os.rmdir(cgroup)
