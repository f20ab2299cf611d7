"""Orbax checkpoints of the offloaded state in the standard optax layout, and params from the tiers."""
