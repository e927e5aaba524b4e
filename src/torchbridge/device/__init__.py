"""The bridge: the PyTorch device `tpu` (PrivateUse1), backed by XLA buffers through JAX.

`import torch` registers the device (registration.py, reached through PyTorch's backend autoload entry
point), and registering imports this package's modules in their dependency order. Importing torch
here, before any module of the package runs, keeps that order when the first import of a process is
one of these modules (`import torchbridge.device.dispatch`): otherwise torch's autoload would start
registering in the middle of that module's own import and find it half-initialised.
"""

import torch  # noqa: F401
