"""jax_mlp's implementation: private, so it may change at any time; use what ``jax_mlp`` exports.

The folders are the layers, top to bottom (docs/architecture.md): ``transform`` (the optax face),
``cli`` and ``checkpoint`` (integrations), ``offload`` (the lifecycle and the routes a call takes),
``stream`` (one update), ``plan`` and ``schedule`` (what runs where), ``storage`` (the tiers), and
the foundation modules beside them. A module imports only from its own layer or the layers below.
"""
