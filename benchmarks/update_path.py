"""The jax_mlp modules one eager update enters, on every thread: the hops of docs/architecture.md, counted.

Every call of jax_mlp code is profiled (``sys.setprofile``, and ``threading.setprofile`` for the
reader and writer threads the offloader starts) during one adam update of three leaves with a host
cache, on one path, and the idle-time I/O it starts; the modules are listed with their count.

Writes ``update_path.json`` into ``--out``.

    python benchmarks/update_path.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import threading

import jax
import jax.numpy as jnp
import optax
from common import print_and_save

import jax_mlp


def modules_entered() -> list[str]:
    package = os.path.dirname(jax_mlp.__file__)
    params = {"w": jnp.ones((256, 256)), "b": jnp.ones((256,)), "big": jnp.ones((1024, 512))}
    entered: set[str] = set()
    recording = False

    def profile(frame, event, arg) -> None:
        if recording and event == "call" and frame.f_code.co_filename.startswith(package):
            entered.add(os.path.relpath(frame.f_code.co_filename, package))

    threading.setprofile(profile)  # the threads the offloader starts are profiled too
    with tempfile.TemporaryDirectory() as directory:
        offload = jax_mlp.mlp_offload(optax.adam(1e-3), paths=[directory], subgroup_size="256KiB", host_cache="512KiB")
        with offload:
            state = offload.init(params)
            grads = jax.tree.map(lambda p: p * 0.1, params)
            for _ in range(2):
                _, state = offload.update(grads, state, params)
            offloader = offload
            offloader.flush()
            sys.setprofile(profile)
            recording = True
            _, state = offload.update(grads, state, params)
            offloader.flush()  # waits for the idle-time I/O the update started
            recording = False
            sys.setprofile(None)
    threading.setprofile(None)
    return sorted(entered)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="output folder for the JSON")
    args = parser.parse_args(argv)
    modules = modules_entered()
    result = {"count": len(modules), "modules": modules}
    out = None if args.out is None else pathlib.Path(args.out) / "update_path.json"
    print_and_save(result, out)
    return result


if __name__ == "__main__":
    main()
