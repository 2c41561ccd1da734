"""Every change vllm-accel makes to process-wide state - torch, vLLM and
transformers behaviour, environment variables, global settings - in one
place, each with why. Patches 1-3, 9-11, 17 and 20 are applied by
``apply_patches`` (our ``vllm.general_plugins`` entry point, once in every vLLM
process; their code is in ``module_patches.py``); 4-8, 12-15, 18, 19, 22 and 23
are functions called where the change is needed (18, 19, 22 and 23 in
``inductor_tuning.py``); 16 and 21 are state the platform keeps (``platform.py``),
named here so that one file lists them all. None edits an installed file (13
keeps a record in inductor's cache); each is idempotent.

1. transformers 5.16-5.20 / vLLM 0.33, without torchvision (no CPU build on the
   registry): two torchvision image-processor modules fail to import, yet vLLM
   imports a helper from each, also when its registry inspects the model in a
   subprocess: ``_num_image_tokens`` from
   ``transformers.models.pixtral.image_processing_pixtral`` (vLLM's
   ``models/pixtral.py``, imported by its LlavaNext, Llava and Mistral3
   modules) and ``smart_resize`` from
   ``transformers.models.qwen2_vl.image_processing_qwen2_vl`` (vLLM's
   ``models/qwen2_vl.py``, imported by its Qwen2.5-VL module). Each name is
   made to resolve to its PIL variant (``image_processing_pil_*``), which
   defines the same function.

2. transformers 5.16-5.20, without torchvision: there are no PIL video
   processors: ``AutoVideoProcessor`` maps qwen2_vl/qwen2_5_vl to
   ``Qwen2VLVideoProcessor``, a dummy class that raises ImportError, so
   ``Qwen2_5_VLProcessor.from_pretrained`` (called by vLLM's Qwen2.5-VL
   processing) fails even for images. When
   ``transformers.models.auto.video_processing_auto`` is imported, a stand-in
   class of the same name (``video_stub.py``; Qwen2-VL video defaults:
   patch_size 14, temporal_patch_size 2, merge_size 2, ...) is registered with
   ``AutoVideoProcessor`` for Qwen2-VL and Qwen2.5-VL. Registered classes are
   looked up by name before the built-in dummy, so the name inferred from
   ``image_processor_type`` ("Qwen2VLImageProcessor") resolves to it. It loads
   its settings like the real one, but processing a video raises ImportError.
   ProcessorMixin then type-checks it against ``transformers.VideoProcessorMixin``,
   which transformers exports only with torchvision: that attribute is set to
   the (torchvision-free) class from ``transformers.video_processing_utils``.

3. torch 2.13 / vLLM 0.33, on a host without a torch accelerator: vLLM's
   shutdown and weight loading call ``torch.accelerator.empty_cache()`` on
   every platform but its own CPU one, and torch raises when there is no
   accelerator (our simulated device is the host CPU). Those calls become
   no-ops, as vLLM's own CPU worker makes them; with a real accelerator
   present nothing changes. Each call asks: asked at import, torch would ask
   the CUDA driver in every process that imports the plugin (vLLM's front end).

4. ``use_spawn_for_workers`` (the platform, with tensor parallelism):
   ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unless the user set it. Our workers
   compute with OpenMP threads, and a process forked after its parent ran an
   OpenMP parallel region hangs in its first one (libgomp is not fork-safe;
   e.g. ``LLM(...)`` after any torch math). vLLM does the same for CUDA.

5. ``set_worker_threads`` (the worker): torch's thread count for this worker,
   and inductor's compile threads to match. vLLM sets
   ``TORCHINDUCTOR_COMPILE_THREADS=1`` at import (against inductor's
   subprocess pools); inductor builds CPU kernels in a thread pool instead, so
   g++ may use the worker's cores (cold start: benchmarks/README.md).

6. ``raise_recompile_limit`` (compiling): dynamo keeps 8 graphs per function
   by default, then silently runs eager; we compile one graph per bucket.

7. ``inductor_cache_dir`` (a forward whose context names a compile cache:
   while an engine may still compile, i.e. during warmup or without it):
   inductor reads ``TORCHINDUCTOR_CACHE_DIR`` at each compile; it points at
   the engine's compile cache only during such a forward, so other code in the
   process (another engine, a test) keeps its own, and a warmed-up engine's
   steps never touch the environment.

8. ``nan_for_unloaded_weights`` (loading): torch's deterministic mode fills
   memory FMS leaves uninitialised (weights it did not load) with NaN, for
   the duration of ``get_model``, so a skipped checkpoint key is visible.
   The caller's deterministic mode (``warn_only`` too) is restored after.

9. vLLM 0.33 with a CUDA build of torch (Triton importable): its top-k/top-p
   masking (``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p``) takes
   its Triton kernel for every tensor, and Triton cannot read host memory
   ("Pointer argument cannot be accessed from Triton (cpu tensor?)"): our
   cpu device samples on the host. When that module is imported, its function
   is wrapped so that host tensors take vLLM's own PyTorch path (as vLLM's CPU
   build does); device tensors keep the Triton kernel.
   On cuda, the Triton module (``topk_topp_triton``) runs its split top-p
   pipeline for every CUDA tensor, but asks ``current_platform.is_cuda_alike()``
   whether that pipeline runs when it tells its one-pass kernel to leave
   top-p-alone rows to it (``SPLIT_COVERS_PONLY``) and when it lists warmup
   variants. Our platform is not cuda-alike, so in a batch of at most 64
   rows mixing top-k rows with top-p-alone ones, those got top-p twice (a
   narrower nucleus than asked). That module sees the platform through a
   view that is cuda-alike wherever torch has a CUDA device (host tensors
   never reach it: the wrapper above).

10. vLLM 0.33, Molmo checkpoints whose config says ``"num_key_value_heads":
   null`` (Molmo-7B-O: multi-head attention): vLLM's generic
   ``ModelArchConfigConvertor`` returns that None as the KV head count and
   ``ModelConfig`` fails validation before any platform hook runs (its own
   Molmo model reads ``num_key_value_heads or num_attention_heads``). A
   convertor for ``model_type`` "molmo" with that same fallback (MolmoE's
   config, "molmo" too, has no such key: multi-head) is added to
   ``MODEL_ARCH_CONFIG_CONVERTORS`` when that module is imported (or now, if
   it already is); a convertor vLLM registers itself for "molmo" is kept.

11. vLLM 0.33 built as pure Python (no ``vllm._C`` ops: how install.sh and the
   offline bundle build it) with CUDA tensors: ``vllm._custom_ops``'s
   ``apply_repetition_penalties`` sends contiguous CUDA logits to the compiled
   op ``torch.ops._C.apply_repetition_penalties_``, which is not there, so any
   request with a repetition penalty failed on the cuda device. When that
   module is imported and the op is missing, its CUDA entry point runs vLLM's
   own PyTorch version (``apply_repetition_penalties_torch``) instead.

12. ``exact_float32_dots`` (the worker, a float32 model on cuda):
   ``TRITON_F32_DEFAULT=ieee`` unless the user set it. Triton multiplies
   float32 matrices as TF32 (a 10-bit mantissa) unless a kernel says
   otherwise, and vLLM's attention kernel leaves it to that default; torch's
   own float32 matmuls are full precision unless asked, and so is HF's float32
   model we check tokens against. Only Triton dots of float32 inputs change
   (inductor states its precision; bfloat16 dots are bfloat16), and Triton's
   compile cache keys on the variable.

13. ``probe_cpu_vector_isa`` (the worker, inductor on the cpu device): inductor
   picks the CPU's vector instruction set by building a test program for each
   candidate (AVX-512 VNNI, AVX-512, AVX2, ...) and loading it, once per
   process, into its cache directory. Inside an engine that directory is the
   engine's compile cache (7), so every new compile cache built the programs
   again: ~6 s of each cold start on 2 cores. Probed first, outside it, they
   land in inductor's own directory (where it keeps its precompiled headers
   too: facts of the machine, not of a model), and later starts find them
   built. Loading each still starts a Python process (1.5 s of a 4 s warm
   start on 2 cores), so the probe's answer is kept beside them, keyed by
   torch, the CPU's vector flags and the compiler: where an earlier probe
   found every candidate good, inductor's ``cpp.vec_isa_ok`` is set, which
   makes it take them without the test.

14. ``keep_large_buffers_mapped`` (the worker, cpu device): glibc's malloc
   serves an allocation above its mmap threshold (at most 32 MiB) with a
   fresh mapping and unmaps it when freed, and the heap's freed top goes back
   to the OS; every such buffer is then mapped in again page by page, a fault
   each 4 KiB (~4 us on these VMs). A forward's large intermediates (the
   full-size Molmo ViT's 13 crops: 61 MB a linear layer's output) are
   allocated and freed every call: 900k faults a batch, its linear layers at
   half their speed. The threshold goes to 1 GiB (or the largest glibc
   takes) and the heap keeps what is freed: memory stays at its peak, as a
   device's memory pool does.

15. ``use_v1_model_runner`` (the platform, configuring an engine):
   ``VLLM_USE_V2_MODEL_RUNNER=0`` in ``os.environ``, read by the scheduler in
   this process and the engine processes it starts. Our runner speaks vLLM's
   V1 model-runner protocol; vLLM switches to the V2 one (resumed requests
   sent as new ones, no copy of a request's tokens) wherever Triton imports,
   i.e. with any CUDA build of torch. The platform refuses a user's
   ``VLLM_USE_V2_MODEL_RUNNER=1`` (and a configuration vLLM still gives V2).

16. ``AccelPlatform.served_image_token_id`` (``platform.py``, set for each
   model configured): a class attribute, one per process: the image token of
   the vision model configured last (None: a text model). vLLM's
   ``validate_request`` is given no model; ours checks a prompt without images
   against it (a literal image token typed in the text would reach the model
   as one), a prompt with images against its own placeholders' token.

17. transformers 5.20 / vLLM 0.33, without torchvision: ``transformers`` and
   ``transformers.models.pixtral`` hand out a placeholder for
   ``PixtralProcessor`` (declared to need torchvision), so vLLM's Mistral3
   processing and ``AutoProcessor`` fail; its module imports with patch 1's
   alias. Once either lazy module is imported, the name is struck from its
   missing-backend list (a cached placeholder dropped): it resolves to the
   real class. The hook checks for torchvision itself (the route would recurse).

18. ``tune_gpu_reductions`` (the worker, inductor on cuda): inductor's
   ``coordinate_descent_tuning`` unless the user set
   ``TORCHINDUCTOR_COORDINATE_DESCENT_TUNING``. With it, inductor decomposes
   a one-row matmul (a batch-1 decode's linear layers) into a Triton
   reduction it may fuse with neighbouring ops, not cuBLAS, and tunes the
   block sizes of every Triton kernel it generates. gpt-fast's path: 8.5 %
   off the 1.1B batch-1 step on an H100 (benchmarks/README.md). A graph that
   serves every bucket above 1 compiles without it (``shared_graph_compile``):
   tuned at the size it first runs (the largest bucket), its block sizes
   would fit no other; on an H100 that tuning cost ~14 s of the 1.1B cold
   start and bought nothing measurable when serving (one round each).

19. ``reuse_tuned_block_sizes`` (the worker, inductor on cuda): a kernel
   whose tuned config comes from the autotune cache without the mark that
   coordinate descent found it is tuned again at its first launch, at every
   warm start (its pick then moves with timing noise). Two losses: torch
   2.11 (fixed in 2.12), a statically launched kernel loaded from inductor's
   cache drops it when it asks the autotune cache again (a warm 1.1B start
   on an H100: 228 tuning benchmarks with a graph per bucket, 0 with this
   fix: benchmarks/README.md); the recheck is torch 2.12's, the cached
   config taken with its mark. And Triton's ``Config`` unpickles only the
   fields it knows, so a kernel sent back by a compile worker loses it
   (with patch 22 none launches statically; warm starts on an H100 tuned
   11-25 times again, as this loss explains by the code); it is kept. The
   second is not yet run on a GPU.

20. vLLM 0.33, our platform only: vLLM's registry inspects a model's class
   (pooling or not, multimodal, ...) in a new Python process, to keep CUDA out
   of the front end, on every start without its record in ``modelinfos/``:
   a first ``LLM()`` on 2 cores took 44 s with it, 28 s without
   (benchmarks/README.md). Our platform runs no vLLM model class; it is
   inspected in this process, with a warning should that initialize CUDA
   (vLLM then spawns its engine core).

21. ``AccelPlatform.worker_device`` (``platform.py``, set by each worker):
   the device backend of the engine whose worker runs in this process. The
   platform answers vLLM's device questions (``device_type``, ...) for the
   backend the settings select, reading ``additional_config`` from vLLM's
   current config; vLLM sets that only around a worker's init, so at a step
   or on a helper thread the answer was the environment's (the cpu, for an
   engine given ``{"accel": {"device": "cuda"}}``). By the code, vLLM's
   sampling-kernel warmup then listed its top-k/top-p kernel's variants with
   the cpu's block sizes, and an H100's start-up still compiled 3 GPU
   variants at its first steps; with this patch it compiled none there
   (benchmarks/README.md). Outside a config the worker's backend answers;
   inside one, that config's.

22. ``overlap_kernel_launches`` (the worker, inductor on cuda): inductor's
   ``triton.enable_pdl`` on GPUs of compute capability 9 and later, unless
   the user set ``TORCHINDUCTOR_ENABLE_PDL`` (vLLM leaves it off): CUDA's
   programmatic dependent launch, a kernel starting while its predecessor
   finishes and waiting (``gdc_wait``) before it touches what that wrote. A
   batch-1 decode step is ~280 small launches: 2.3-4.8 % off the 1.1B step
   on H100s, ``tests/test_cuda.py`` passing with it (benchmarks/README.md).

23. ``compile_tuning_candidates_ahead`` (the worker, inductor on cuda):
   coordinate descent (patch 18) compiles each config it benchmarks, one
   after another: ~14 s of a cold 1.1B start of 45-49 s on an H100. Before
   it benchmarks a config not yet compiled, this compiles that config and
   every neighbour of the best so far (its next candidates) on threads side
   by side; its walk and pick are unchanged. Not yet run on a GPU.

The forward's context (``forward_context.py``) is process-wide too while a
forward runs: the ops are opaque to the compiler and take only tensors, so
what steers them is set around each forward by ``set_forward_context``, which
is also the only caller of patch 7.

Patches 1, 2 and 17 act only without torchvision (by transformers' own test),
9 only with Triton, 11 only without vLLM's compiled ops, 20 only on our
platform; these and 10 wait for the module they concern to be imported: applying
them appends one finder to ``sys.meta_path`` (eager imports cost seconds).
"""

from __future__ import annotations

import contextlib
import os

# Patches 1-3, 9-11, 17 and 20 live in module_patches.py (a relative import:
# benchmarks/native_shims.py loads this package under a name of its own);
# apply_patches is the plugin's entry point.
from .module_patches import apply_patches, torchvision_available  # noqa: F401
# Patches 18, 19, 22 and 23 (inductor on cuda) live in inductor_tuning.py.
from .inductor_tuning import (compile_tuning_candidates_ahead,  # noqa: F401
                              overlap_kernel_launches, recheck_autotune_cache,
                              reuse_tuned_block_sizes, shared_graph_compile,
                              tune_gpu_reductions)


# ---- 4-8, 12-15: called where needed ----------------------------------------


def use_spawn_for_workers() -> bool:
    """Patch 4. True when it set the start method (the user had not)."""
    if "VLLM_WORKER_MULTIPROC_METHOD" in os.environ:
        return False
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return True


def use_v1_model_runner() -> None:
    """Patch 15 (the platform refuses a user's VLLM_USE_V2_MODEL_RUNNER=1 first)."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def set_worker_threads(threads: int, inductor: bool) -> None:
    """Patch 5. ``threads`` 0 keeps torch's count."""
    import torch

    if threads and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    if inductor:
        import torch._inductor.config

        torch._inductor.config.compile_threads = torch.get_num_threads()


def raise_recompile_limit(graphs_per_function: int) -> None:
    """Patch 6: room for this many graphs per compiled function, plus slack."""
    import torch

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, graphs_per_function + 8)


_INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


@contextlib.contextmanager
def inductor_cache_dir(path):
    """Patch 7: inductor's cache directory is ``path`` inside the block (None:
    unchanged)."""
    if path is None:
        yield
        return
    previous = os.environ.get(_INDUCTOR_CACHE_ENV)
    os.environ[_INDUCTOR_CACHE_ENV] = str(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_INDUCTOR_CACHE_ENV, None)
        else:
            os.environ[_INDUCTOR_CACHE_ENV] = previous


def keep_large_buffers_mapped() -> bool:
    """Patch 14. True where glibc's malloc took the settings (glibc only)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not mallopt(m_trim_threshold, 2**31 - 1):  # the largest an int holds
        return False
    # glibc caps the mmap threshold (32 MiB where heaps are 64 MiB).
    return bool(mallopt(m_mmap_threshold, 1 << 30) or mallopt(m_mmap_threshold, 32 << 20))


def probe_cpu_vector_isa() -> None:
    """Patch 13: inductor's vector-ISA probe, under its own cache directory,
    or its earlier answer where that found every candidate good."""
    import json
    from pathlib import Path

    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    machine = _vector_isa_machine()
    if config.cpp.vec_isa_ok is not None or machine is None:  # the user's choice, or not x86
        valid_vec_isa_list()  # cached for the process: later compiles reuse it
        return
    record = Path(cache_dir()) / "vllm_accel_vec_isa.json"
    try:
        earlier = json.loads(record.read_text())
    except (OSError, ValueError):
        earlier = None
    if earlier == {**machine, "good": machine["candidates"]}:
        config.cpp.vec_isa_ok = True
        valid_vec_isa_list()
        return
    good = [str(isa) for isa in valid_vec_isa_list()]
    with contextlib.suppress(OSError):  # a read-only cache: later starts probe again
        record.write_text(json.dumps({**machine, "good": good}))


def _vector_isa_machine() -> dict | None:
    """What inductor's vector-ISA probe depends on (x86 only): torch, the
    ISAs the CPU's flags allow (inductor's candidates), the compilers."""
    import platform
    import shutil

    import torch
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import supported_vec_isa_list, x86_isa_checker

    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = x86_isa_checker()
    compilers = []
    for name in config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else [config.cpp.cxx]:
        path = shutil.which(name) if name else None
        stat = os.stat(path) if path else None
        compilers.append([name, path, stat and stat.st_mtime_ns, stat and stat.st_size])
    return {"torch": [torch.__version__, torch.__file__], "compilers": compilers,
            "candidates": [str(isa) for isa in supported_vec_isa_list
                           if all(flag in flags for flag in str(isa).split())]}


@contextlib.contextmanager
def nan_for_unloaded_weights():
    """Patch 8: memory torch allocates uninitialised is NaN inside the block."""
    import torch
    from torch.utils import deterministic

    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_filling = deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)
        deterministic.fill_uninitialized_memory = was_filling


def exact_float32_dots() -> None:
    """Patch 12: Triton's float32 dots in full precision, unless the user chose."""
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
