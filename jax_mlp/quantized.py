"""Compressed optimizer state: ``quantized_state`` and the codecs behind it, as a public namespace.

``jax_mlp.quantized_state(inner, codec)`` keeps an optax optimizer's state in bf16 or blockwise int8
between steps (docs/api.md#quantized_state). The codecs are public here for code that reads such a
state, e.g. a checkpoint restored into plain optax: ``decompress`` turns it back into float32.
"""

from jax_mlp._src.state_codecs import CODECS, QuantizedState, compress, decompress, quantized_state, stored_fraction

__all__ = ["CODECS", "QuantizedState", "compress", "decompress", "quantized_state", "stored_fraction"]
