"""GPU checks: host-device bandwidth, offloaded vs in-memory update throughput, subgroup streaming.

Each figure is measured side by side in one run and reported with the ratio that matters:

* ``transfer``: host to device and back, from pageable numpy memory and from ``pinned_host``;
* ``update``: ``mlp_offload(adamw)`` with the whole state in the host cache (``flush="lazy"``, so no
  disk I/O at all) against plain optax
  adamw with its state in device memory, on a state that fits (bytes of state updated per second);
* ``streaming``: the rate at which ``mlp_offload`` moves subgroups host -> device -> host, against
  what the pinned copy bandwidth allows for the same bytes;
* ``transfer_paths``: the offloaded update with ``transfer="pinned"`` (through the device's
  ``pinned_host`` memory, zero-copy views) against ``transfer="plain"`` (``device_put``/``np.asarray``),
  interleaved, with the path each run's stats report.

``--dry-run`` uses tiny sizes on whatever backend is there (the CPU here), to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_mlp


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` (which blocks until done) over ``repeats`` runs after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def transfer_bandwidths(nbytes: int, device: jax.Device, repeats: int) -> dict:
    """Host-to-device and device-to-host bandwidth from pageable and pinned host memory."""
    host = np.ones(nbytes // 4, np.float32)
    on_device = jax.device_put(host, device).block_until_ready()
    result = {
        "bytes": nbytes,
        "pageable_h2d": nbytes / timed(lambda: jax.device_put(host, device).block_until_ready(), repeats),
        "pageable_d2h": nbytes / timed(lambda: np.asarray(on_device + 0), repeats),
    }
    kinds = device.addressable_memories() if hasattr(device, "addressable_memories") else []
    if any(m.kind == "pinned_host" for m in kinds):
        pinned_sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        device_sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        pinned = jax.device_put(host, pinned_sharding).block_until_ready()
        result["pinned_h2d"] = nbytes / timed(
            lambda: jax.device_put(pinned, device_sharding).block_until_ready(), repeats
        )
        result["pinned_d2h"] = nbytes / timed(
            lambda: jax.device_put(on_device, pinned_sharding).block_until_ready(), repeats
        )
        # What the pinned transfer path does for each field: the pinned copy, then a zero-copy numpy view.
        result["pinned_d2h_view"] = nbytes / timed(
            lambda: np.asarray(jax.device_put(on_device, pinned_sharding)), repeats
        )
    return result


def make_params(num_params: int, device: jax.Device) -> dict:
    rows = num_params // 4096
    return {f"w{i}": jax.device_put(jnp.full((rows // 4, 4096), 0.01, jnp.float32), device) for i in range(4)}


def update_throughput(
    num_params: int, device: jax.Device, directory: str, repeats: int, transfers: tuple[str, ...] = ("auto",)
) -> dict:
    """adamw offloaded (all cached in host RAM) against adamw in device memory: state bytes per second.

    Each of ``transfers`` gets its own offloader, stepped interleaved with the others; the first is the
    one the top-level figures describe, and ``by_transfer`` holds each one's median and reported path.
    """
    params = make_params(num_params, device)
    grads = jax.tree.map(lambda p: p * 0.5, params)
    inner = optax.adamw(1e-3, weight_decay=0.1)
    state_bytes = 2 * 4 * num_params

    plain_update = jax.jit(inner.update)
    plain_state = [inner.init(params)]

    def plain():
        updates, plain_state[0] = plain_update(grads, plain_state[0], params)
        jax.block_until_ready(updates)

    offloads = {
        transfer: jax_mlp.mlp_offload(
            inner,
            paths=[f"{directory}_{transfer}"],
            host_cache=2 * state_bytes + (64 << 20),
            subgroup_size="64MiB",
            prefetch_depth=4,
            write_depth=4,
            transfer=transfer,
        )
        for transfer in transfers
    }
    states = {transfer: offload.init(params) for transfer, offload in offloads.items()}

    def offloaded(transfer: str) -> None:
        updates, states[transfer] = offloads[transfer].update(grads, states[transfer], params)
        jax.block_until_ready(updates)

    plain_s = timed(plain, repeats)
    times: dict[str, list[float]] = {transfer: [] for transfer in transfers}
    for transfer in transfers:
        offloaded(transfer)  # warm-up
    for _ in range(repeats):
        for transfer in transfers:
            start = time.perf_counter()
            offloaded(transfer)
            times[transfer].append(time.perf_counter() - start)
    by_transfer = {
        transfer: {"offloaded_cached_s": statistics.median(times[transfer]), "ran": offloads[transfer].stats.transfer}
        for transfer in transfers
    }
    offloaded_s = by_transfer[transfers[0]]["offloaded_cached_s"]
    stats = offloads[transfers[0]].stats._asdict()
    for offload in offloads.values():
        offload.close(delete=True)
    return {
        "num_params": num_params,
        "state_bytes": state_bytes,
        "plain_optax_s": plain_s,
        "offloaded_cached_s": offloaded_s,
        "plain_state_bytes_per_s": state_bytes / plain_s,
        "offloaded_state_bytes_per_s": state_bytes / offloaded_s,
        "offloaded_over_plain": offloaded_s / plain_s,
        "last_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
        "by_transfer": by_transfer,
    }


def gpu_arguments(argv: list[str] | None, description: str) -> argparse.Namespace:
    """``--out`` and ``--dry-run``; exits unless jax sees a GPU or ``--dry-run`` is given."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, any backend")
    args = parser.parse_args(argv)
    platform = jax.devices()[0].platform
    if not args.dry_run and platform != "gpu":
        sys.exit(f"no GPU found (jax sees {platform}); use --dry-run to check the script on a CPU")
    return args


def save(result: dict, out: str, name: str) -> dict:
    """Writes ``result`` as ``out/name`` (indented JSON), prints it, and returns it."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> dict:
    args = gpu_arguments(argv, __doc__)
    device = jax.devices()[0]
    transfer_bytes = (16 << 20) if args.dry_run else (2 << 30)
    num_params = (1 << 20) if args.dry_run else (256 << 20)
    repeats = 2 if args.dry_run else 5
    with tempfile.TemporaryDirectory(prefix="jax_mlp_gpu_") as directory:
        result = {
            "device": str(device),
            "platform": device.platform,
            "jax": jax.__version__,
            "dry_run": args.dry_run,
            "transfer": transfer_bandwidths(transfer_bytes, device, repeats),
            "update": update_throughput(
                num_params, device, os.path.join(directory, "tier"), repeats, ("auto", "pinned", "plain")
            ),
        }
    update, transfer = result["update"], result["transfer"]
    copy_bandwidth = min(
        transfer.get("pinned_h2d", transfer["pageable_h2d"]), transfer.get("pinned_d2h", transfer["pageable_d2h"])
    )
    streamed = 2 * update["state_bytes"]  # every record goes to the device and comes back
    result["streaming"] = {
        "bytes_per_s": streamed / update["offloaded_cached_s"],
        "copy_bandwidth_bytes_per_s": copy_bandwidth,
        "fraction_of_copy_bandwidth": streamed / update["offloaded_cached_s"] / copy_bandwidth,
    }
    paths = update["by_transfer"]
    result["transfer_paths"] = {
        "auto_ran": paths["auto"]["ran"],
        "pinned_s": paths["pinned"]["offloaded_cached_s"],
        "plain_s": paths["plain"]["offloaded_cached_s"],
        "plain_over_pinned": paths["plain"]["offloaded_cached_s"] / paths["pinned"]["offloaded_cached_s"],
    }
    return save(result, args.out, "gpu.json")


if __name__ == "__main__":
    main()
