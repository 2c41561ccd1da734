"""The CPU decode-attention kernel against the PyTorch path (gather + SDPA),
and how it is built: cached, harmless to the process, optional."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch

from helpers import in_forward
from vllm_accel.kernels import decode_attention as decode_kernel
from vllm_accel.model.paged_attention import PagedAttentionMetadata, paged_attention

pytestmark = pytest.mark.usefixtures("every_core")  # the kernels split work by threads
BLOCKS, BLOCK = 16, 4


def _decode_step(heads, kv_heads, dim, context_lens, width, dtype=torch.float32, seed=0,
                 block=BLOCK):
    """Random caches and one decode token per row; each row's blocks are
    distinct, unused table entries point at block 0 as the runner's do."""
    g = torch.Generator().manual_seed(seed)
    rows = len(context_lens)
    blocks = max(BLOCKS, 1 + sum(-(-length // block) for length in context_lens))
    caches = [torch.randn(blocks, block, kv_heads, dim, generator=g).to(dtype) for _ in range(2)]
    block_table = torch.zeros(rows, width, dtype=torch.long)
    free = torch.randperm(blocks - 1, generator=g) + 1
    for row, length in enumerate(context_lens):
        used = -(-length // block)
        block_table[row, :used], free = free[:used], free[used:]
    query = torch.randn(1, rows, heads, dim, generator=g).to(dtype)
    new_kv = [torch.randn(1, rows, kv_heads, dim, generator=g).to(dtype) for _ in range(2)]
    # Each decode's own token is the last of its context.
    lens = torch.tensor(context_lens)
    slots = block_table[torch.arange(rows), (lens - 1) // block] * block + (lens - 1) % block
    metadata = PagedAttentionMetadata(slot_mapping=slots, num_decodes=rows,
                                      decode_block_table=block_table, decode_context_lens=lens)
    return query, new_kv, caches, metadata


def _run(kernel, query, new_kv, caches, metadata):
    caches = [c.clone() for c in caches]
    with in_forward(metadata, decode=kernel):
        return paged_attention(query, *new_kv, *caches, 0.125)


def test_kernel_matches_pytorch_path(kernel_cache):
    kernel = decode_kernel.load(kernel_cache)
    assert kernel is not None
    # Grouped (4 and 3 query heads per KV head), plain multi-head, and a
    # single head; head sizes of the vector path (64, 80, 96, 128) and of the
    # portable loop (16, 24, 32, 136); rows from 1 token to the full padded
    # width, and one that ends a block.
    for heads, kv_heads, dim in ((8, 2, 64), (4, 2, 128), (2, 2, 80), (4, 4, 32), (1, 1, 16),
                                 (6, 2, 96), (2, 1, 24), (2, 2, 136)):
        step = _decode_step(heads, kv_heads, dim, context_lens=[1, 7, 12, 4, 9], width=3)
        expected = _run(None, *step)
        got = _run(kernel, *step)
        assert got.shape == expected.shape == (1, 5, heads, dim)
        assert expected.abs().max() > 0.1
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_kernel_matches_pytorch_path_in_engine_blocks(kernel_cache):
    """Blocks of 32 tokens (the platform's default): the vector path sums 16
    tokens at a time, so contexts around 16 and 32 end a group mid-way."""
    kernel = decode_kernel.load(kernel_cache)
    lens = [1, 15, 16, 17, 31, 32, 33, 47, 64, 100]
    for heads, kv_heads, dim in ((16, 4, 64), (18, 6, 64), (4, 2, 128)):
        step = _decode_step(heads, kv_heads, dim, context_lens=lens, width=4, block=32,
                            seed=heads)
        expected = _run(None, *step)
        torch.testing.assert_close(_run(kernel, *step), expected, rtol=1e-5, atol=1e-5)


def test_kernel_reads_half_precision_caches(kernel_cache):
    """bfloat16/float16 caches: float32 arithmetic, so the kernel is at least as
    close to a float32 reference as the PyTorch path in that dtype is."""
    kernel = decode_kernel.load(kernel_cache)
    # bfloat16 at 64 multiplies bfloat16 pairs, at 80 widens first; float16
    # takes the portable loop.
    for dtype, dim in ((torch.bfloat16, 64), (torch.bfloat16, 80), (torch.float16, 64)):
        step = _decode_step(8, 2, dim, context_lens=[1, 7, 12, 4, 9], width=3, dtype=dtype)
        query, new_kv, caches, metadata = step
        reference = _run(None, query.float(), [t.float() for t in new_kv],
                         [c.float() for c in caches], metadata)
        got, pytorch = _run(kernel, *step), _run(None, *step)
        assert got.dtype == dtype
        kernel_error = (got.float() - reference).abs().max()
        assert kernel_error <= (pytorch.float() - reference).abs().max() + 1e-3
        torch.testing.assert_close(got.float(), reference, rtol=1e-2, atol=1e-2)


def test_kernel_is_cached_and_keeps_denormals(tmp_path):
    library = decode_kernel.build(tmp_path)
    built_at = library.stat().st_mtime_ns
    assert decode_kernel.build(tmp_path) == library
    assert library.stat().st_mtime_ns == built_at  # loaded, not rebuilt
    decode_kernel.DecodeAttentionKernel(library)
    # Linked with -ffast-math, loading it would flush denormals to zero in
    # every computation of the process.
    assert (torch.tensor(1e-40) * 1).item() != 0


def test_header_change_rebuilds(tmp_path):
    """A kernel is keyed on the headers it includes too (vector_math.h)."""
    from vllm_accel.kernels import build as cpu_kernels

    source, header = tmp_path / "k.cpp", tmp_path / "k.h"
    source.write_text('#include "k.h"\nextern "C" int value() { return VALUE; }\n')
    header.write_text("#define VALUE 1\n")
    first = cpu_kernels.build(source, tmp_path / "cache")
    header.write_text("#define VALUE 2\n")
    second = cpu_kernels.build(source, tmp_path / "cache")
    assert first != second and ctypes.CDLL(str(second)).value() == 2


def test_builds_started_in_the_background_are_waited_for_not_repeated(tmp_path, monkeypatch):
    """cpu_kernels.build_in_background: the builds run on their own threads,
    side by side; a later build of the same source waits for that one (one
    compile) and gets its library, or its error."""
    import threading

    from vllm_accel.kernels import build as cpu_kernels

    sources = []
    for value in (1, 2):
        source = tmp_path / f"k{value}.cpp"
        source.write_text(f'extern "C" int value() {{ return {value}; }}\n')
        sources.append(source)
    compiled, running, release = [], threading.Semaphore(0), threading.Event()
    real_compile = cpu_kernels._compile

    def slow_compile(cxx, source, library):
        compiled.append(source.name)
        running.release()
        release.wait(10)  # until both builds have started
        return real_compile(cxx, source, library)

    monkeypatch.setattr(cpu_kernels, "_compile", slow_compile)
    cpu_kernels.build_in_background(sources, tmp_path / "cache")
    assert running.acquire(timeout=10) and running.acquire(timeout=10)  # both at once
    release.set()
    libraries = [cpu_kernels.build(source, tmp_path / "cache") for source in sources]
    assert sorted(compiled) == ["k1.cpp", "k2.cpp"]
    assert [ctypes.CDLL(str(library)).value() for library in libraries] == [1, 2]

    broken = tmp_path / "broken.cpp"
    broken.write_text("not C++\n")
    cpu_kernels.build_in_background([broken], tmp_path / "cache")
    with pytest.raises(subprocess.CalledProcessError):
        cpu_kernels.build(broken, tmp_path / "cache")
    assert compiled.count("broken.cpp") == 1


def test_no_compiler_falls_back_to_pytorch(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert decode_kernel.load(tmp_path) is None


@pytest.mark.parametrize("kernel", ["decode", "linear", "span"])
def test_a_failed_build_warns_with_the_compilers_message(tmp_path, monkeypatch, kernel):
    """A compiler that fails: each kernel is left out (None: oneDNN's or
    torch's path runs) and a warning carries what the compiler said."""
    import logging

    from vllm_accel.kernels import linear, span_attention

    compiler = tmp_path / "broken-cxx"
    compiler.write_text("#!/bin/sh\necho 'fatal error: the compiler says no' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    load = {"decode": decode_kernel.load, "linear": linear.load, "span": span_attention.load}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.vllm_accel.kernels")  # the kernels' loggers' parent
    logger.addHandler(handler)
    try:
        assert load[kernel](tmp_path / "cache") is None
    finally:
        logger.removeHandler(handler)
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert warnings and "the compiler says no" in warnings[0].getMessage()


def test_kernel_supports_cpu_float_caches_only(kernel_cache):
    kernel = decode_kernel.load(kernel_cache)
    query, cache = torch.zeros(1, 1, 8), torch.zeros(2, BLOCK, 1, 8)
    assert kernel.supports(query, cache)
    assert kernel.supports(query.bfloat16(), cache.bfloat16())
    assert not kernel.supports(query, cache.bfloat16())  # mixed dtypes
    assert not kernel.supports(query.double(), cache.double())


def test_store_writes_what_index_copy_writes(kernel_cache):
    """The kernel library's KV store: rows spaced as in a fused qkv (both
    dtypes), the same caches as index_copy_; a layout it does not read is
    left to index_copy_ (False), a slot past the cache refused with nothing
    written."""
    kernel = decode_kernel.load(kernel_cache)
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        caches = [torch.zeros(6, BLOCK, 2, 8, dtype=dtype) for _ in range(2)]
        expected = [cache.clone() for cache in caches]
        qkv = torch.randn(5, 4 + 2 + 2, 8, generator=g).to(dtype)
        key, value = qkv[:, 4:6], qkv[:, 6:8]
        slots = torch.tensor([7, 0, 23, 12, 1])
        assert kernel.store(key, value, *caches, slots)
        for cache, new in zip(expected, (key, value)):
            cache.view(-1, 2, 8).index_copy_(0, slots, new)
        assert all(torch.equal(a, b) for a, b in zip(caches, expected))
        assert not kernel.store(key.transpose(1, 2), value, *caches, slots)  # dims spaced
        assert not kernel.store(key, value, *caches, slots.int())
        for bad in (24, -1):
            with pytest.raises(IndexError, match=f"slot {bad} .token 2. out of range"):
                kernel.store(2 * key, value, *caches, torch.tensor([7, 0, bad, 12, 1]))
            assert all(torch.equal(a, b) for a, b in zip(caches, expected))


def test_kernel_refuses_a_context_past_its_block_table(kernel_cache):
    """A context longer than its row of the block table would read blocks
    the table does not name: the kernel refuses it (the first such row) and
    computes nothing, for each dtype it reads."""
    kernel = decode_kernel.load(kernel_cache)
    for dtype in (torch.float32, torch.bfloat16):
        query, _, caches, metadata = _decode_step(4, 2, 64, context_lens=[5, 12, 3], width=3,
                                                  dtype=dtype)
        lens = metadata.decode_context_lens.clone()
        lens[1] = 3 * BLOCK + 1  # one token past its 3 blocks
        out = torch.full_like(query[0], 7.0)
        with pytest.raises(IndexError, match="decode row 1: context of 13 tokens, its block "
                                             "table holds 12"):
            kernel(query[0], *caches, metadata.decode_block_table, lens, 0.125, out)
        assert torch.equal(out, torch.full_like(out, 7.0))
        lens[1] = 3 * BLOCK  # exactly full: runs
        kernel(query[0], *caches, metadata.decode_block_table, lens, 0.125, out)
        assert not torch.equal(out, torch.full_like(out, 7.0))


@pytest.mark.parametrize("where", ["query", "key", "value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_propagates_as_in_the_pytorch_path(kernel_cache, where, dtype):
    """A NaN in one row's query head, or in one cached key or value of one
    row's context, makes exactly the outputs NaN that gather + SDPA makes NaN
    (that row's heads over that KV head), on the vector path (head size 64)
    and the portable one (24); every other output stays as it was."""
    kernel = decode_kernel.load(kernel_cache)
    for heads, kv_heads, dim in ((8, 2, 64), (4, 2, 24)):
        query, new_kv, caches, metadata = _decode_step(heads, kv_heads, dim,
                                                       context_lens=[5, 7, 12, 4], width=3,
                                                       dtype=dtype)
        if where == "query":
            query[0, 1, 3] = float("nan")
        else:  # the second token of row 2's context, KV head 1
            block = metadata.decode_block_table[2, 0]
            caches[0 if where == "key" else 1][block, 1, 1] = float("nan")
        expected = _run(None, query, new_kv, caches, metadata)
        got = _run(kernel, query, new_kv, caches, metadata)
        assert expected.isnan().any()
        assert torch.equal(got.isnan(), expected.isnan())
        finite = ~expected.isnan()
        torch.testing.assert_close(got[finite].float(), expected[finite].float(),
                                   rtol=1e-2, atol=1e-2)
