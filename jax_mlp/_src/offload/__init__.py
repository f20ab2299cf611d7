"""The lifecycle of one ``mlp_offload`` and the routes a call of ``update`` or ``apply`` takes."""
