"""The ``jax-mlp`` command: ``probe``, ``plan`` (sizing a run) and ``report`` (plotting a log)."""
