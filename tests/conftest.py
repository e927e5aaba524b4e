"""Root conftest for every test directory: keep it minimal.

The device backend emulates 8 chips on the host platform; XLA reads this flag once, when JAX
initialises, so it has to be in the environment before anything imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
