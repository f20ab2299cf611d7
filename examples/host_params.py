"""Params and grads in host memory, the optimizer state on disk: the recipe for a model larger than its devices.

The model is the demo's transformer block (``train_gpt.Block``, Flax NNX) stacked ``--layers`` deep,
used functionally: ``nnx.split`` gives each layer's params, which are stacked along a leading layer
axis. Every param lives in host memory, ``NamedSharding(mesh, spec, memory_kind="pinned_host")``, as
MaxText's ``parameter_memory_host_offload`` keeps them, sharded over ``--devices`` with FSDP:

1. the jitted loss and gradients run a ``jax.lax.scan`` over the stacked layers, and each layer's
   params are brought to device memory inside it (``jax.device_put(layer, jax.memory.Space.Device)``),
   so the device holds one layer at a time (XLA gathers its FSDP shards);
2. the grads are written straight back to host memory (``out_shardings`` in ``pinned_host``);
3. ``jax_mlp.mlp_offload(optax.adam(...))`` keeps Adam's state on disk (``--paths``) and streams it
   through the device subgroup by subgroup, and with it each subgroup's param and grad blocks; the
   updates (or, with ``--apply``, the new params) come back to host memory.

Run it with::

    python examples/host_params.py                       # fp32 params in pinned_host, one device
    python examples/host_params.py --param-dtype bf16    # bf16 params, fp32 masters in the tiers
    python examples/host_params.py --apply               # the fused apply writes the new params in place
    XLA_FLAGS=--xla_force_host_platform_device_count=8 NPROC=24 python examples/host_params.py --devices 8
    python examples/host_params.py --compare --checkpoint-at 10   # the checks below, through a checkpoint

``--compare`` trains the same model again with its params in device memory, on the same batches: the
two runs must give the same bits (losses and params). It also feeds the offloaded run's gradients to
plain in-memory optax (fp32 masters for bf16 params), which must agree within the exactness contract:
max|Δ|/max|p| and max|Δ(p - p0)|/max|p - p0| at most 1e-5 per leaf, or for bf16 params at most one
ulp apart on at most 0.1% of the elements. ``--checkpoint-at K`` saves the params and the offloaded
state with orbax at step K, restores them into a new ``mlp_offload`` on other paths and goes on. It
exits with status 1 if a check fails, or a param left host memory.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from offload_options import add_offload_arguments, state_paths
from pretrain import AXIS, fsdp_spec
from train_gpt import VOCAB, Batches, Block, build_corpus, encode

import jax_mlp

HOST, DEVICE = "pinned_host", "device"
TOLERANCE = 1e-5  # the exactness contract against plain optax, per leaf
BF16_ULPS, BF16_DIFFERING = 1, 1e-3  # bf16 params with fp32 masters: ulps apart, on at most this fraction


class Outer(nnx.Module):
    """Everything but the layers: token and position embeddings, the final norm and the head."""

    def __init__(self, seq_len: int, d_model: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(len(VOCAB), d_model, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model)))
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, len(VOCAB), rngs=rngs)


def build(args: argparse.Namespace) -> tuple[nnx.GraphDef, nnx.GraphDef, Any]:
    """The graph definitions of ``Outer`` and ``Block``, and the params ``{"outer": ..., "layers": stacked}`` on the host."""
    rngs = nnx.Rngs(args.seed)
    outer_def, outer = nnx.split(Outer(args.seq_len, args.d_model, rngs=rngs))
    blocks = [nnx.split(Block(args.d_model, args.heads, rngs=rngs)) for _ in range(args.layers)]
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *[state for _, state in blocks])
    dtype = jnp.bfloat16 if args.param_dtype == "bf16" else jnp.float32
    return (
        outer_def,
        blocks[0][0],
        jax.tree.map(lambda x: np.asarray(x.astype(dtype)), {"outer": outer, "layers": layers}),
    )


def to_device(tree: Any) -> Any:
    """``tree`` in device memory (its placement kept, its memory changed), in float32 for the math."""
    return jax.tree.map(lambda x: x.astype(jnp.float32), jax.device_put(tree, jax.memory.Space.Device))


def loss(outer_def: nnx.GraphDef, block_def: nnx.GraphDef, params: Any, inputs: jax.Array, targets: jax.Array):
    """Cross-entropy of the next character; the layers visit device memory one at a time, inside the scan."""
    outer = nnx.merge(outer_def, to_device(params["outer"]))
    x = outer.embed(inputs) + outer.position[: inputs.shape[1]]

    def layer(x: jax.Array, layer_params: Any) -> tuple[jax.Array, None]:  # one layer's slice, in host memory
        return nnx.merge(block_def, to_device(layer_params))(x), None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    logits = outer.head(outer.norm(x))
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def shardings(params: Any, mesh: jax.sharding.Mesh, kind: str) -> Any:
    """FSDP in memory ``kind``: each leaf sharded along its largest axis the mesh divides, never the layer axis."""

    def sharding(path: tuple, x: np.ndarray) -> NamedSharding:
        if path[0].key == "layers":
            return NamedSharding(mesh, P(None, *fsdp_spec(x.shape[1:], mesh.size)), memory_kind=kind)
        return NamedSharding(mesh, fsdp_spec(x.shape, mesh.size), memory_kind=kind)

    return jax.tree_util.tree_map_with_path(sharding, params)


def kinds(tree: Any) -> list[str]:
    return sorted({x.sharding.memory_kind for x in jax.tree.leaves(tree)})


class Reference:
    """Plain in-memory optax, jitted, fed the offloaded run's gradients (fp32 masters for bf16 params)."""

    def __init__(self, inner: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh):
        self.dtype = jax.tree.leaves(params)[0].dtype
        self.shardings = shardings(params, mesh, DEVICE)
        self.params = jax.device_put(jax.tree.map(lambda x: x.astype(np.float32), params), self.shardings)
        self.state = jax.jit(inner.init)(self.params)
        self._update = jax.jit(inner.update)

    def step(self, grads: Any) -> None:
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), jax.device_put(grads, self.shardings))
        updates, self.state = self._update(grads, self.state, self.params)
        self.params = optax.apply_updates(self.params, updates)

    def result(self) -> Any:
        return jax.tree.map(lambda x: np.asarray(x.astype(self.dtype)), self.params)


def round_trip(args: argparse.Namespace, step: int, tx: Any, opt_state: Any, params: Any, paths: list[str]):
    """Saves the params and the offloaded state with orbax, then restores both into a new ``mlp_offload`` on ``paths``."""
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    directory = tempfile.mkdtemp(prefix="jax_mlp_host_params_ckpt_")
    try:
        with ocp.CheckpointManager(directory) as manager:
            items = {"params": ocp.args.StandardSave(params), "opt_state": jax_mlp.OffloadSave(tx)}
            manager.save(step, args=ocp.args.Composite(**items))
            manager.wait_until_finished()
            tx.close(delete=True)
            tx = make_offload(args, paths)
            items = {"params": ocp.args.StandardRestore(like), "opt_state": jax_mlp.OffloadRestore(tx, like)}
            restored = manager.restore(step, args=ocp.args.Composite(**items))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return tx, restored.opt_state, restored.params


def make_offload(args: argparse.Namespace, paths: list[str]) -> jax_mlp.OffloadTransformation:
    master = jnp.float32 if args.param_dtype == "bf16" else None
    return jax_mlp.mlp_offload(
        optax.adam(args.lr),
        paths=paths,
        host_cache=args.host_cache,
        subgroup_size=args.subgroup_size,
        master_dtype=master,
    )


def train(args: argparse.Namespace, tokens: np.ndarray, kind: str, paths: list[str], compare: bool) -> dict[str, Any]:
    """Trains the model with its params in memory ``kind`` and Adam's state on ``paths``.

    Only the host run takes the ``--checkpoint-at`` round trip: ``--compare``'s run in device memory
    goes through uninterrupted.

    Returns:
      ``losses``, the final ``params`` (numpy) and their memory ``kinds``, ``seconds``, the last update's
      ``stats``, and with ``compare`` the plain optax ``reference`` params (numpy) and the initial ``start``.
    """
    outer_def, block_def, start = build(args)
    mesh = jax.make_mesh((args.devices,), (AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[: args.devices])
    placement = shardings(start, mesh, kind)
    params = jax.device_put(start, placement)
    grads_out = (NamedSharding(mesh, P()), placement)  # the grads go straight to the params' memory
    grad_step = jax.jit(jax.value_and_grad(functools.partial(loss, outer_def, block_def)), out_shardings=grads_out)
    reference = Reference(optax.adam(args.lr), start, mesh) if compare else None
    tx = make_offload(args, paths)
    opt_state = tx.init(params)
    batches = Batches(tokens, args.batch_size, args.seq_len, args.seed)
    batch_sharding = NamedSharding(mesh, P(AXIS) if args.batch_size % args.devices == 0 else P())
    losses, tick = [], time.perf_counter()
    for step in range(args.steps):
        if step == args.checkpoint_at and kind == HOST:
            tx, opt_state, params = round_trip(args, step, tx, opt_state, params, [f"{p}-restored" for p in paths])
        inputs, targets = (jax.device_put(x, batch_sharding) for x in batches.next())
        value, grads = grad_step(params, inputs, targets)
        if reference is not None:
            reference.step(grads)  # before the update, which may consume the grads
        if args.apply:
            params, opt_state = tx.apply(grads, opt_state, params)
        else:
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        losses.append(float(value))
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"{kind:>11} step {step:4d}  loss {losses[-1]:.4f}  update {tx.stats.seconds * 1e3:.0f} ms")
    result = {
        "losses": losses,
        "params": jax.tree.map(np.asarray, params),
        "kinds": kinds(params),
        "seconds": time.perf_counter() - tick,
        "stats": tx.stats.as_dict(),
    }
    tx.close(delete=True)
    if reference is not None:
        result.update(reference=reference.result(), start=start)
    return result


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def checks(host: dict[str, Any], device: dict[str, Any]) -> dict[str, Any]:
    """The ``--compare`` verdicts: host against device params (bits), and against plain optax (the contract)."""
    pairs = list(zip(jax.tree.leaves(host["params"]), jax.tree.leaves(device["params"]), strict=True))
    verdict: dict[str, Any] = {
        "bitwise_equal_to_device_params": all(np.array_equal(_bits(a), _bits(b)) for a, b in pairs)
        and np.array_equal(np.float32(host["losses"]), np.float32(device["losses"])),
    }
    actual, expected, start = (jax.tree.leaves(host[key]) for key in ("params", "reference", "start"))
    if actual[0].dtype == np.float32:
        values = displacements = 0.0
        for a, e, p0 in zip(actual, expected, start, strict=True):
            a, e, p0 = (np.asarray(x, np.float64) for x in (a, e, p0))
            values = max(values, np.abs(a - e).max() / max(np.abs(e).max(), 1e-30))
            displacements = max(displacements, np.abs((a - p0) - (e - p0)).max() / max(np.abs(e - p0).max(), 1e-30))
        verdict.update(deviation=float(values), displacement_deviation=float(displacements))
        verdict["within_contract"] = bool(values <= TOLERANCE and displacements <= TOLERANCE)
    else:
        distance = np.concatenate(
            [
                np.abs(_bits(a).astype(np.int64) - _bits(e).astype(np.int64)).ravel()
                for a, e in zip(actual, expected, strict=True)
            ]
        )
        verdict.update(
            bf16_max_ulps=int(distance.max()), bf16_differing=float(np.count_nonzero(distance) / distance.size)
        )
        verdict["within_contract"] = bool(
            verdict["bf16_max_ulps"] <= BF16_ULPS and verdict["bf16_differing"] <= BF16_DIFFERING
        )
    return verdict


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_offload_arguments(parser, steps=50, host_cache="0", subgroup_size="256KiB")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks, stacked and scanned over")
    parser.add_argument("--d-model", type=int, default=64, help="width of the residual stream")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--seq-len", type=int, default=32, help="characters of context")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the init and the batches")
    parser.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32", help="bf16 adds fp32 masters")
    parser.add_argument("--devices", type=int, default=1, help="devices to shard the params over (FSDP)")
    parser.add_argument("--apply", action="store_true", help="the fused tx.apply instead of update + apply_updates")
    parser.add_argument("--compare", action="store_true", help="check against device params and plain optax")
    parser.add_argument("--checkpoint-at", type=int, default=None, help="save and restore with orbax at this step")
    parser.add_argument("--log-every", type=int, default=10, help="print a loss line every this many steps")
    args = parser.parse_args(argv)
    if args.devices > len(jax.devices()):
        parser.error(
            f"--devices {args.devices}, but jax sees {len(jax.devices())}; on a CPU, start with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={args.devices} NPROC=24"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains with params and grads in host memory; with ``--compare``, again in device memory and against optax.

    Returns:
      ``losses``, ``kinds`` (the memory kinds of the final params), ``seconds``, ``stats`` and
      ``params_bytes``; with ``--compare`` the verdicts of :func:`checks` as well.
    """
    args = parse_args(argv)
    tokens = encode(build_corpus())
    with state_paths(args.paths, count=1, prefix="jax_mlp_host_params_") as (paths, _):
        host = train(args, tokens, HOST, [f"{p}/host" for p in paths], args.compare)
        device = train(args, tokens, DEVICE, [f"{p}/device" for p in paths], False) if args.compare else None
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(host["params"]))
    result = {key: host[key] for key in ("losses", "kinds", "seconds", "stats")}
    result["params_bytes"] = params_bytes
    print(
        f"{params_bytes / 2**20:.1f} MiB of {args.param_dtype} params kept in {', '.join(host['kinds'])} over "
        f"{args.devices} device(s); loss {host['losses'][0]:.3f} -> {host['losses'][-1]:.3f} in {args.steps} steps, "
        f"{host['seconds']:.1f} s"
    )
    if device is not None:
        result.update(checks(host, device))
        print({key: value for key, value in result.items() if key not in ("losses", "stats")})
    return result


if __name__ == "__main__":
    outcome = main()
    passed = outcome["kinds"] == [HOST] and outcome.get("bitwise_equal_to_device_params", True)
    sys.exit(0 if passed and outcome.get("within_contract", True) else 1)
