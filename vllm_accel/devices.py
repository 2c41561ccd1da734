"""Device backends: where the model runs, how it is compiled, and what vLLM
asks of each.

- ``cpu``: the simulated accelerator, on the host CPU; compile backend
  ``inductor`` (default) or ``eager`` (the same bucketed shapes, not compiled).
- ``hpu``: Intel Gaudi, chosen automatically when ``habana_frameworks.torch``
  is importable; compile backend ``hpu_backend`` (default) or ``eager``.
- ``cuda``: an NVIDIA GPU (``VLLM_ACCEL_DEVICE=cuda``; never chosen by
  ``auto``); compile backend ``inductor`` (Triton kernels, default) or
  ``eager``; attention is vLLM's Triton kernel, and forwards replay CUDA
  graphs captured at warmup.

Tensor-parallel workers talk over ``gloo`` on cpu, ``hccl`` on hpu and
``nccl`` on cuda.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from vllm_accel.log import get_logger
from vllm_accel.kernels.build import cpu_flags
from vllm_accel.settings import AccelSettings, env_var_name, resolve_device

logger = get_logger(__name__)

_COMPILE_BACKENDS = {"cpu": ("inductor", "eager"), "hpu": ("hpu_backend", "eager"),
                     "cuda": ("inductor", "eager")}
# torch.distributed backend of the tensor-parallel workers' device group.
DIST_BACKENDS = {"cpu": "gloo", "hpu": "hccl", "cuda": "nccl"}


@dataclass(frozen=True)
class DeviceBackend:
    device: str  # "cpu", "hpu" or "cuda": also the torch device type
    compile_backend: str  # a torch.compile backend name, or "eager"
    # One compiled graph serves every bucket above 1 (settings.bucket_graphs):
    # the decoder's token buckets; apart, the buckets of a vision tower (where
    # its adapter names their axis) or of an encoder-only model.
    shared_bucket_graphs: bool = False
    shared_encoder_graphs: bool = False

    @property
    def compiles(self) -> bool:
        return self.compile_backend != "eager"

    def shares_layer_graphs(self, encoder_only: bool) -> bool:
        """Whether one graph serves a model's token buckets above 1."""
        return self.shared_encoder_graphs if encoder_only else self.shared_bucket_graphs

    @property
    def attends_in_one_launch(self) -> bool:
        """Whether attention reads a forward's layout as one ``SequenceTable``
        (vLLM's Triton kernel: cuda) rather than decodes and prefill chunks
        apart (PyTorch, and the cpu decode kernel)."""
        return self.device == "cuda"

    @property
    def runs_apart_from_host(self) -> bool:
        """Whether the host returns while the device computes (kernels queue on
        a stream), so that scheduling the next step can overlap this one."""
        return self.device == "cuda"

    @property
    def prefers_large_forwards(self) -> bool:
        """Whether fewer, larger forwards win over padding less: a forward's
        fixed cost (its kernel launches, the host's work) outweighs its
        padded rows on a GPU, not on the cpu, where every row costs compute."""
        return self.device == "cuda"

    def synchronize(self) -> None:
        """Wait until the device has done the work queued so far (for timing)."""
        if self.device != "cpu":
            getattr(torch, self.device).synchronize()

    @property
    def dist_backend(self) -> str:
        """torch.distributed backend the tensor-parallel workers use."""
        return DIST_BACKENDS[self.device]


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
    if device == "cuda" and not cuda_available():
        raise ValueError(
            f"{env_var_name('device')}=cuda, but torch {torch.__version__} sees no CUDA "
            "device here: use a CUDA build of torch on a host with an NVIDIA GPU, or "
            "device cpu."
        )
    if device == "cuda" and importlib.util.find_spec("triton") is None:
        raise ValueError(
            f"{env_var_name('device')}=cuda needs Triton (attention is vLLM's Triton kernel), "
            f"and it is not installed beside torch {torch.__version__}: install the triton "
            "release that torch names, or use device cpu.")
    if settings.bucket_graphs == "shared" and device == "hpu":
        raise ValueError(
            f"{env_var_name('bucket_graphs')}=shared is for devices 'cpu' and 'cuda'; on "
            f"'{device}' each token bucket has its own graph: expected auto or per_bucket.")
    compiles, choice = backend != "eager", settings.bucket_graphs
    # auto: shared on cpu; on cuda the decoder's only (shared vision tower
    # graphs are untried on a GPU; an encoder's failed to compile on an H100:
    # dynamo fixed its marked token count at the masked SDPA).
    shared = compiles and (choice == "shared" or (choice == "auto" and device != "hpu"))
    shared_encoder = compiles and (choice == "shared" or (choice == "auto" and device == "cpu"))
    return DeviceBackend(device=device, compile_backend=backend, shared_bucket_graphs=shared,
                         shared_encoder_graphs=shared_encoder)


# ---- what vLLM's Platform asks, per device ----------------------------------
# vLLM asks some of these in its front-end process, before it starts the
# engine core process. There NVML answers for cuda: a front end that has
# initialized CUDA makes vLLM start the engine core with "spawn" (a new
# interpreter that imports vLLM again: ~15 s of every start), not "fork".


def cuda_available() -> bool:
    if torch.cuda.is_initialized() or not torch.backends.cuda.is_built():
        return torch.cuda.is_available()
    try:
        with _nvml() as nvml:
            return nvml.nvmlDeviceGetCount() > 0 and _visible_devices() != []
    except Exception:  # no NVML here (no driver): torch decides
        return torch.cuda.is_available()


def _visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES' entries (indices or UUIDs), or None where unset."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if visible is None else [d.strip() for d in visible.split(",") if d.strip()]


@contextmanager
def _nvml():
    from vllm.utils.import_utils import import_pynvml

    nvml = import_pynvml()
    nvml.nvmlInit()
    try:
        yield nvml
    finally:
        nvml.nvmlShutdown()


def _nvml_query(device_id: int, query):
    """``query(nvml, handle)`` for the process's ``device_id``-th visible
    GPU, or None where NVML cannot say (torch answers then)."""
    if torch.cuda.is_initialized():
        return None
    visible = _visible_devices()
    try:
        with _nvml() as nvml:
            entry = str(device_id) if visible is None else visible[device_id]
            handle = (nvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit()
                      else nvml.nvmlDeviceGetHandleByUUID(entry))
            return query(nvml, handle)
    except Exception:  # e.g. no NVML, or a UUID prefix NVML does not resolve
        return None


def device_name(device: str, device_id: int = 0) -> str:
    if device != "cuda":
        return device
    name = _nvml_query(device_id, lambda nvml, h: nvml.nvmlDeviceGetName(h))
    return name if name is not None else torch.cuda.get_device_name(device_id)


def total_memory(device: str, device_id: int = 0) -> int:
    if device == "cuda":
        total = _nvml_query(device_id, lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).total)
        return int(total) if total is not None \
            else torch.cuda.get_device_properties(device_id).total_memory
    import psutil

    return psutil.virtual_memory().total  # cpu; hpu keeps its weights in host memory too


def memory_in_use(device: str) -> float:
    if device == "cuda":
        return float(torch.cuda.memory_allocated())
    import psutil

    return float(psutil.Process().memory_info().rss)


def compute_units(device: str, device_id: int = 0) -> int:
    """NVIDIA SMs on cuda; on the host CPU, the threads torch computes with."""
    if device == "cuda":
        return torch.cuda.get_device_properties(device_id).multi_processor_count
    return torch.get_num_threads()


def device_uuid(device: str, device_id: int = 0) -> str:
    if device == "cuda":  # NVML's form, as vLLM's CUDA platform and nvidia-smi give it
        uuid = _nvml_query(device_id, lambda nvml, h: nvml.nvmlDeviceGetUUID(h))
        return uuid if uuid is not None \
            else f"GPU-{torch.cuda.get_device_properties(device_id).uuid}"
    import platform
    import socket

    # One host CPU: the same id for every "device" of this machine.
    return f"{device}-{socket.gethostname()}-{platform.machine()}"


def pci_bus_ids(device: str) -> dict[int, str]:
    """Device index -> PCI bus id (vLLM's VLLM_GPU_NIC_PCIE_MAPPING)."""
    if device == "cuda":
        def bus_id(props) -> str:  # the form nvidia-smi and NVML print
            return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"

        return {i: bus_id(torch.cuda.get_device_properties(i))
                for i in range(torch.cuda.device_count())}
    raise NotImplementedError(
        f"VLLM_GPU_NIC_PCIE_MAPPING (NIC selection by PCI bus) is not supported by "
        f"vllm-accel's '{device}' device: it has no PCI device of its own.")


def check_dtype(device: str, dtype: torch.dtype) -> None:
    if device == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{torch.cuda.get_device_name()} does not support bfloat16: "
                         "use --dtype float16 or float32.")
    if device == "cpu" and dtype == torch.bfloat16 and not cpu_multiplies_bfloat16():
        if cpu_widens_bfloat16():
            logger.info(
                "bfloat16 on a CPU without bfloat16 instructions: vllm-accel's linear kernel "
                "widens it to float32 in registers, several times torch's and oneDNN's "
                "bfloat16 rate here (benchmarks/README.md).")
            return
        # It works, but a user who picked bfloat16 for speed should know.
        logger.warning(
            "bfloat16 on a CPU without bfloat16 instructions (no AVX-512 BF16, AMX or "
            "Arm BF16) nor AVX2: its matmuls are emulated and run slower than --dtype "
            "float32 (torch's ran 3-7x slower on an AVX2 CPU, benchmarks/README.md).")


def cpu_widens_bfloat16(cpuinfo: str | None = None) -> bool:
    """Whether our linear kernel runs bfloat16 here by widening it to float32
    in registers: an x86 CPU without bfloat16 instructions (AVX-512 BF16),
    with AVX2 and FMA or with AVX-512 (F, BW, VL: Skylake, Cascade Lake);
    linear_kernel.cpp builds its widening types there."""
    flags = cpu_flags(cpuinfo)
    if flags is None or "avx512_bf16" in flags:
        return False
    return {"avx2", "fma"} <= flags or {"avx512f", "avx512bw", "avx512vl"} <= flags


def cpu_multiplies_bfloat16(cpuinfo: str | None = None) -> bool:
    """Whether the host CPU has bfloat16 dot-product instructions (x86
    ``avx512_bf16``/``amx_bf16`` flags, Arm ``bf16`` feature). True where
    /proc/cpuinfo cannot be read: unknown, so nothing to warn about."""
    flags = cpu_flags(cpuinfo)
    return flags is None or bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
