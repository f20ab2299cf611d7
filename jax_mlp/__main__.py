"""``python -m jax_mlp``: the ``jax-mlp`` command, for an environment whose scripts are not on the PATH."""

import sys

from jax_mlp._src.cli.main import main

sys.exit(main())
