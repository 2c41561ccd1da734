"""Device backends: where the model runs and how it is compiled.

- ``cpu``: the simulated accelerator, on the host CPU; compile backend
  ``inductor`` (default) or ``eager`` (the same bucketed shapes, not compiled).
- ``hpu``: Intel Gaudi, chosen automatically when ``habana_frameworks.torch``
  is importable; compile backend ``hpu_backend`` (default) or ``eager``.

Tensor-parallel workers talk over ``gloo`` on cpu and ``hccl`` on hpu.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from vllm_accel.settings import AccelSettings, env_var_name, resolve_device

_COMPILE_BACKENDS = {"cpu": ("inductor", "eager"), "hpu": ("hpu_backend", "eager")}
# torch.distributed backend of the tensor-parallel workers' device group.
_DIST_BACKENDS = {"cpu": "gloo", "hpu": "hccl"}


@dataclass(frozen=True)
class DeviceBackend:
    device: str  # "cpu" or "hpu": also the torch device type
    compile_backend: str  # a torch.compile backend name, or "eager"

    @property
    def compiles(self) -> bool:
        return self.compile_backend != "eager"

    @property
    def dist_backend(self) -> str:
        """torch.distributed backend the tensor-parallel workers use."""
        return _DIST_BACKENDS[self.device]


def select_backend(settings: AccelSettings) -> DeviceBackend:
    """The device backend the settings ask for; fails naming the setting."""
    device = resolve_device(settings)
    allowed = _COMPILE_BACKENDS[device]
    backend = allowed[0] if settings.compile_backend == "auto" else settings.compile_backend
    if backend not in allowed:
        raise ValueError(
            f"{env_var_name('compile_backend')}={backend} is not available on device "
            f"'{device}': expected one of auto, {', '.join(allowed)}."
        )
    if device == "hpu":
        # Importing it registers the "hpu" device and the "hpu_backend" compiler.
        importlib.import_module("habana_frameworks.torch")
    return DeviceBackend(device=device, compile_backend=backend)
