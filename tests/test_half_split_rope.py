"""Rotary embedding on head halves (half_split_rope.py): the same model
outputs as FMS's rotary on adjacent pairs, with each head's query and key
projection rows reordered to match."""

from __future__ import annotations

import pytest
import torch
from fms.modules.positions import RotaryEmbedding
from transformers import AutoConfig

from vllm_accel.model import half_split_rope
from vllm_accel.model.fms_causal_lm import load_fms_model
from vllm_accel.testing.tiny_models import make_tiny_checkpoint


def _logits(model, ids):
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        return model(ids, position_ids=positions)


@pytest.mark.parametrize("arch", ["llama", "granite"])
def test_same_logits_as_fms_rotary(tmp_path, arch):
    path = make_tiny_checkpoint(arch, tmp_path / arch)
    model = load_fms_model(str(path), AutoConfig.from_pretrained(path), torch.float32)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    q_rows = {name: p.clone() for name, p in model.named_parameters() if "qkv" in name}

    switched = half_split_rope.install(model, max_positions=64)

    assert switched == model.config.nlayers
    # The projections really were reordered (a no-op would also match).
    assert any(not torch.equal(q_rows[name], p) for name, p in model.named_parameters()
               if name in q_rows)
    # Rounding apart (the products are summed in another order; 1.3e-5 seen
    # on an Intel CPU): a wrong reordering moves logits by ~1.
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)


def test_table_reaches_max_positions(tmp_path):
    """FMS built its table to the config's length first; positions past it
    still get their own angles."""
    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    model = load_fms_model(str(path), AutoConfig.from_pretrained(path), torch.float32)
    rotary = model.base_model.rot_emb
    built = rotary.cached_freqs[None][1].shape[0]
    half_split_rope.install(model, max_positions=built + 100)
    encoder = model.base_model.layers[0].attn.position_encoder
    assert encoder.cos.shape[0] >= built + 100
    angles = torch.outer(torch.arange(built + 100.0), 1.0 / (
        rotary.rope_scaling.ratio ** (torch.arange(0, rotary.dim, 2).float() / rotary.dim)))
    torch.testing.assert_close(encoder.cos[: built + 100], angles.cos())


def test_length_dependent_angles_keep_fms_rotary(tmp_path):
    """NTK scaling changes the angles with the sequence length: not switched."""
    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    model = load_fms_model(str(path), AutoConfig.from_pretrained(path), torch.float32)
    ntk = RotaryEmbedding(dim=model.base_model.rot_emb.dim, scaling={"rope_type": "ntk"})
    for layer in model.base_model.layers:
        layer.attn.position_encoder = ntk
    weights = [p.clone() for p in model.parameters()]
    assert half_split_rope.install(model, max_positions=64) == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_bfloat16_rotated_in_float32_and_rounded_once():
    """A bfloat16 head is rotated in float32 (as FMS and HF do) and each half
    rounded once on the way out: the same values as rotating its float32
    copy, not bfloat16 arithmetic (which moves ~1 % of them)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=generator).to(torch.bfloat16)
    angles = torch.randn(64, 1, 16, generator=generator)
    cos, sin = angles.cos(), angles.sin()
    out = half_split_rope.rotate_halves(x, cos, sin)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, half_split_rope.rotate_halves(x.float(), cos, sin).to(torch.bfloat16))
    first, second = x.chunk(2, dim=-1)  # the same rotation in bfloat16 differs
    c, s = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    assert not torch.equal(out, torch.cat([c * first - s * second, s * first + c * second], -1))
