"""What vLLM's Platform leaves raising, ours answers (issue: a CUDA build of
torch made vLLM ask num_compute_units, which the base class leaves raising)."""

from __future__ import annotations

import ast
import inspect
import logging
import textwrap
from datetime import timedelta

import pytest
import torch
from vllm.platforms.interface import Platform

from vllm_accel.platform import AccelPlatform

# Features vllm-accel does not support: the method must raise, naming the feature.
UNSUPPORTED = {"get_punica_wrapper": "LoRA", "get_all_gpu_pci_bus_ids": "PCI"}


def _raises_not_implemented(function) -> bool:
    """Whether the function's body raises NotImplementedError (read from source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return any(isinstance(node, ast.Raise) and "NotImplementedError" in ast.unparse(node)
               for node in ast.walk(tree))


def _base_methods_that_raise() -> list[str]:
    names = []
    for name, member in vars(Platform).items():
        function = getattr(member, "__func__", member)
        if inspect.isfunction(function) and _raises_not_implemented(function):
            names.append(name)
    return sorted(names)


def test_every_method_the_base_leaves_raising_is_ours():
    raising = _base_methods_that_raise()
    # The seven the issue named, and those vLLM needed already.
    assert {"num_compute_units", "check_if_supports_dtype", "get_device_uuid",
            "stateless_init_device_torch_dist_pg", "get_device_name"} <= set(raising)
    left_to_base = [name for name in raising
                    if name not in vars(AccelPlatform) and name != "__getattr__"]
    assert left_to_base == [], f"left to vLLM's Platform, which raises: {left_to_base}"


def test_answers_on_the_cpu_device():
    assert AccelPlatform.num_compute_units() == torch.get_num_threads()
    assert AccelPlatform.get_device_uuid() == AccelPlatform.get_device_uuid(0)
    assert AccelPlatform.get_device_total_memory() > 2**30
    AccelPlatform.check_if_supports_dtype(torch.bfloat16)
    AccelPlatform.check_runner_kv_caches_multi_layer()
    AccelPlatform.set_device(torch.device("cpu"))


def test_bfloat16_on_a_cpu_without_its_instructions_warns(monkeypatch, caplog):
    from vllm_accel import devices

    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    assert not devices.cpu_multiplies_bfloat16(avx2)
    assert devices.cpu_multiplies_bfloat16(avx2.replace("avx2", "avx2 avx512f avx512_bf16"))
    assert devices.cpu_multiplies_bfloat16("Features\t: fp asimd sve bf16\n")  # Arm
    assert not devices.cpu_multiplies_bfloat16("Features\t: fp asimd\n")

    assert devices.cpu_widens_bfloat16(avx2)  # our linear kernel widens it
    skylake = avx2.replace("avx2", "avx2 avx512f avx512bw avx512vl")
    assert devices.cpu_widens_bfloat16(skylake)  # AVX-512 without BF16: widened too
    assert not devices.cpu_widens_bfloat16(skylake.replace("avx512f", "avx512f avx512_bf16"))
    assert not devices.cpu_widens_bfloat16("processor\t: 0\nflags\t\t: fpu sse2 avx\n")

    monkeypatch.setattr(devices, "cpu_multiplies_bfloat16", lambda: False)
    monkeypatch.setattr(devices, "cpu_widens_bfloat16", lambda: True)
    with caplog.at_level(logging.WARNING):
        devices.check_dtype("cpu", torch.bfloat16)  # AVX2: said at info, no warning
        assert "bfloat16" not in caplog.text
    monkeypatch.setattr(devices, "cpu_widens_bfloat16", lambda: False)
    with caplog.at_level(logging.WARNING):
        devices.check_dtype("cpu", torch.float32)
        assert "bfloat16" not in caplog.text
        devices.check_dtype("cpu", torch.bfloat16)
    assert "slower than --dtype" in caplog.text


@pytest.mark.parametrize("method", sorted(UNSUPPORTED))
def test_unsupported_features_say_so(method):
    with pytest.raises(NotImplementedError, match=UNSUPPORTED[method]):
        getattr(AccelPlatform, method)()


def test_stateless_process_group_on_cpu_is_gloo():
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))
    group = AccelPlatform.stateless_init_device_torch_dist_pg(
        "gloo", PrefixStore("test", store), 0, 1, timedelta(seconds=10))
    tensor = torch.tensor([3.0])
    group.allreduce([tensor]).wait()
    assert tensor.item() == 3.0 and group.size() == 1


def test_repetition_penalty_without_vllms_compiled_ops():
    """Patch 11: vLLM built as pure Python has no compiled ops, and its
    repetition penalty for CUDA tensors called one (every penalized request
    failed on the cuda device); it now runs vLLM's PyTorch version."""
    from vllm import _custom_ops as ops

    from vllm_accel.patches import apply_patches

    apply_patches()
    assert not hasattr(torch.ops._C, "apply_repetition_penalties_")  # pure-Python vLLM
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    in_prompt = torch.tensor([[True, False, False, False]])
    in_output = torch.tensor([[False, True, False, False]])
    penalty = torch.tensor([2.0])
    got = logits.clone()
    ops.apply_repetition_penalties_cuda(got, in_prompt, in_output, penalty)
    assert got.tolist() == [[1.0, -2.0, 0.5, 3.0]]


def test_outside_a_config_the_platform_answers_for_its_workers_device(monkeypatch):
    """Patch 21: vLLM sets its current config only around a worker's init, so
    at a step or on a helper thread the platform answered for the
    environment's device, not the one the engine's ``additional_config``
    chose. Once a worker exists, its device answers outside a config;
    inside one, that config's."""
    from types import SimpleNamespace

    import vllm.config.vllm as vllm_config_module
    from vllm.config import VllmConfig

    from vllm_accel.worker.worker import AccelWorker

    monkeypatch.setenv("VLLM_ACCEL_DEVICE", "hpu")  # the environment's choice
    monkeypatch.setattr(AccelPlatform, "worker_device", None)  # restored after the test
    assert AccelPlatform.device_type == "hpu"  # no worker yet: the environment's
    engine = VllmConfig(additional_config={"accel": {"device": "cpu"}})  # the engine's
    AccelWorker(engine, local_rank=0, rank=0, distributed_init_method="tcp://127.0.0.1:1",
                is_driver_worker=True)
    assert vllm_config_module.get_current_vllm_config_or_none() is None
    assert AccelPlatform.device_type == "cpu" and AccelPlatform.dispatch_key == "CPU"
    config = SimpleNamespace(additional_config={"accel": {"device": "hpu"}})
    monkeypatch.setattr(vllm_config_module, "get_current_vllm_config_or_none", lambda: config)
    assert AccelPlatform.device_type == "hpu"  # inside a config: that config's


def test_the_one_pass_sampling_kernel_leaves_top_p_rows_to_the_split_pipeline_on_cuda(
        monkeypatch):
    """Patch 9: vLLM's split top-p pipeline runs for every CUDA tensor of at
    most 64 rows; its one-pass top-k/top-p kernel must then skip top-p-alone
    rows, or they get top-p twice. Its module asked whether the platform is
    cuda-alike, which ours is not; it now sees a platform that is wherever
    torch has a CUDA device (the masking itself: tests/test_cuda.py)."""
    pytest.importorskip("triton")
    from vllm_accel.patches import apply_patches

    apply_patches()
    from vllm.v1.sample.ops import topk_topp_triton as ops

    logits, k, p = torch.zeros(8, 64), torch.full((8,), 5), torch.full((8,), 0.9)

    def covers(batch_logits=logits, k=k, p=p) -> bool:
        _, kwargs = ops._topk_topp._dispatch_fn(batch_logits, logits, logits, logits, k, p,
                                                float("-inf"), 132)
        return kwargs["SPLIT_COVERS_PONLY"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert covers()
    assert not covers(p=None)  # no top-p: nothing for the pipeline
    assert not covers(batch_logits=torch.zeros(65, 64), k=torch.full((65,), 5),
                      p=torch.full((65,), 0.9))  # above 64 rows the pipeline does not run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not covers()  # a host without CUDA (Gaudi): no pipeline


def test_an_architecture_fms_maps_fails_naming_the_layer_kinds_it_lacks():
    """Every architecture FMS's registry maps is either served or names the
    layer kinds the runner lacks for it (the table cannot drift from FMS)."""
    from fms.models.hf.config_utils import _FMS_MODEL_CONFIG_REGISTRY

    from vllm_accel.architectures import ARCHITECTURES, MISSING_LAYER_KINDS, find_architecture

    served = {name for arch in ARCHITECTURES for name in arch.hf_names}
    fms_names = set(_FMS_MODEL_CONFIG_REGISTRY.model_arch_mappings)
    # FMS's own parts and aliases, not checkpoints served alone
    internal = {"FMSMinistral3ForConditionalGeneration", "SiglipModel", "PixtralVisionModel"}
    assert set(MISSING_LAYER_KINDS) <= fms_names
    assert fms_names - internal <= served | set(MISSING_LAYER_KINDS), \
        fms_names - internal - served - set(MISSING_LAYER_KINDS)
    with pytest.raises(ValueError, match=r"BertForMaskedLM.*masked-LM heads.*supports"):
        find_architecture(["BertForMaskedLM"])
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM.*FMS has no model for it"):
        find_architecture(["Qwen2ForCausalLM"])


def test_qwen3_takes_its_rope_theta_from_the_checkpoint():
    """FMS's Qwen3 param builder loses the rotary base (it passes "rope_base",
    which Qwen3Config lacks): the entry's overrides read it from the HF config,
    and refuse a scaled rotary FMS would drop as well."""
    from transformers import Qwen3Config

    from vllm_accel.architectures import find_architecture

    arch = find_architecture(["Qwen3ForCausalLM"])
    config = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 5e6},
                         architectures=["Qwen3ForCausalLM"])
    assert arch.fms_config_overrides(config) == {"rope_theta": 5e6, "multiple_of": 1}
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                              "original_max_position_embeddings": 32768}
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM.*rope type 'yarn'"):
        arch.fms_config_overrides(config)


class _FakeNvml:
    """NVML's calls the platform makes, for two GPUs; counts init/shutdown."""

    def __init__(self):
        self.open = 0
        self.gpus = {0: ("GPU-aaaa", "NVIDIA H200", 141 * 2**30),
                     1: ("GPU-bbbb", "NVIDIA H100 80GB HBM3", 80 * 2**30)}

    def nvmlInit(self):
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return next(i for i, gpu in self.gpus.items() if gpu[0] == uuid)

    def nvmlDeviceGetName(self, handle):
        return self.gpus[handle][1]

    def nvmlDeviceGetUUID(self, handle):
        return self.gpus[handle][0]

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("Memory", (), {"total": self.gpus[handle][2]})()


@pytest.fixture
def cuda_host_before_cuda(monkeypatch):
    """A CUDA build of torch in a process that has not initialized CUDA (as
    vLLM's front-end process): torch's own CUDA queries must not be used."""
    import vllm.utils.import_utils

    nvml = _FakeNvml()
    monkeypatch.setattr(vllm.utils.import_utils, "import_pynvml", lambda: nvml)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

    def initializes_cuda(*args, **kwargs):
        raise AssertionError("initialized CUDA in the front-end process")

    for name in ("is_available", "get_device_name", "get_device_properties", "device_count"):
        monkeypatch.setattr(torch.cuda, name, initializes_cuda)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return nvml


def test_cuda_queries_before_cuda_starts_ask_nvml(cuda_host_before_cuda, monkeypatch):
    from vllm_accel import devices

    nvml = cuda_host_before_cuda
    assert devices.cuda_available()
    assert devices.device_name("cuda") == "NVIDIA H200"
    assert devices.total_memory("cuda", 1) == 80 * 2**30
    assert devices.device_uuid("cuda") == "GPU-aaaa"
    # The process's GPUs as CUDA_VISIBLE_DEVICES lists them, by index or UUID.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert devices.device_name("cuda", 0) == "NVIDIA H100 80GB HBM3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb,GPU-aaaa")
    assert devices.device_uuid("cuda", 1) == "GPU-aaaa"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not devices.cuda_available()
    assert nvml.open == 0  # every query shut NVML down again


def test_cuda_queries_fall_back_to_torch_without_nvml(cuda_host_before_cuda, monkeypatch):
    import vllm.utils.import_utils

    from vllm_accel import devices

    def no_nvml():
        raise ImportError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(vllm.utils.import_utils, "import_pynvml", no_nvml)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device_id=0: "from torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.device_name("cuda") == "from torch"
    assert devices.cuda_available()


def test_accelerator_cache_patch_asks_only_when_called(monkeypatch):
    """Patch 3 asks torch for an accelerator only when called, not at import
    (on a CUDA build torch asks the CUDA driver); a call without one frees
    nothing and does not raise."""
    from vllm_accel import module_patches

    freed = []
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: freed.append(1))
    # A torch without CUDA (with it, a process that never initialized CUDA frees nothing).
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)

    def asked():
        raise AssertionError("asked for an accelerator while patching")

    monkeypatch.setattr(torch.accelerator, "is_available", asked)
    module_patches._make_accelerator_cache_calls_noops()
    module_patches._make_accelerator_cache_calls_noops()  # idempotent
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    torch.accelerator.empty_cache()
    assert freed == []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    torch.accelerator.empty_cache()
    assert freed == [1]
