"""Root conftest for every test directory: keep it minimal.

The device backend emulates 8 chips on the host platform; XLA reads this flag once, when JAX
initialises, so it has to be in the environment before anything imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# Files that take a minute or more (multi-rank jobs, compiled engines), longest first. With two
# pytest-xdist workers and whole files per worker, the work queue follows collection order: a heavy file
# collected last runs alone while the other worker idles (the 4-rank collectives file, ~100 s, did so for
# ~3 minutes). Started first, the short files fill the gaps instead. Order only: every file still runs.
_HEAVY_FIRST = (
    "tests/serve/test_tensor_parallel.py",
    "tests/distributed/test_parallel_training.py",
    "tests/distributed/test_collectives.py",
    "tests/train/test_torchtitan.py",
    "tests/serve/test_engine_on_device.py",
    "tests/distributed/test_faults.py",
    "tests/route/test_deploy.py",
    "tests/route/test_supervise.py",
    "tests/device/test_hf_models.py",
)


def pytest_collection_modifyitems(items: list) -> None:
    rank = {path: i for i, path in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
