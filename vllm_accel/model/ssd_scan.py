"""Mamba2's SSD scan over one sequence from any state: the chunked algorithm
of the Mamba2 paper, as HF transformers' ``mamba2_chunk_scan`` computes it
(Bamba's reference, the oracle in tests/test_mamba2.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[..., i, j] = x[j+1] + ... + x[i] for
    i >= j, -inf above the diagonal (HF transformers' stable segment sum)."""
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    below = torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    on_or_below = torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool))
    return sums.masked_fill(~on_or_below, -torch.inf)


def chunked_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, chunk: int, state: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's SSD over one sequence, in chunks of ``chunk`` tokens (float32).

    x [L, heads, head_dim]; dt [L, heads] (after softplus); A [heads];
    B, C [L, heads, state] (groups repeated per head); state [heads,
    head_dim, state]: the state before the first token. Returns y [L, heads,
    head_dim] (without the D skip) and the state after the last token."""
    length, heads, head_dim = x.shape
    # A chunk is only a blocking of the same sums: a sequence shorter than
    # one is one chunk of its own length (padded to the model's chunk, the
    # within-chunk products grow with its square).
    chunk = min(chunk, length)
    pad = (chunk - length % chunk) % chunk
    x = x * dt[..., None]
    A = A * dt  # [L, heads]
    if pad:
        x, A, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, A, B, C))
    chunks = (length + pad) // chunk
    x = x.view(chunks, chunk, heads, head_dim)
    B = B.reshape(chunks, chunk, heads, -1)
    C = C.reshape(chunks, chunk, heads, -1)
    A = A.view(chunks, chunk, heads).permute(2, 0, 1)  # [heads, chunks, chunk]
    A_cumsum = torch.cumsum(A, dim=-1)

    # Within each chunk: attention-like, masked by the decay between positions.
    decay = torch.exp(segment_sum(A))  # [heads, chunks, l, s]
    scores = torch.einsum("clhn,cshn->clsh", C, B) * decay.permute(1, 2, 3, 0)
    y = torch.einsum("clsh,cshp->clhp", scores, x)

    # Each chunk's own contribution to the state at its end.
    decay_to_end = torch.exp(A_cumsum[..., -1:] - A_cumsum)  # [heads, chunks, chunk]
    B_decayed = B * decay_to_end.permute(1, 2, 0)[..., None]
    states = torch.einsum("clhn,clhp->chpn", B_decayed, x)

    # Across chunks: the state at each chunk's start (from the initial state on).
    states = torch.cat([state[None].to(states.dtype), states], dim=0)  # [chunks + 1, ...]
    decay_chunks = torch.exp(segment_sum(F.pad(A_cumsum[..., -1], (1, 0))))  # [h, c+1, c+1]
    states = torch.einsum("hiz,zhpn->ihpn", decay_chunks, states)
    states, final = states[:-1], states[-1]

    # The state at each chunk's start, seen by its tokens.
    y = y + torch.einsum("clhn,chpn->clhp", C, states) \
        * torch.exp(A_cumsum).permute(1, 2, 0)[..., None]
    return y.reshape(-1, heads, head_dim)[:length], final
