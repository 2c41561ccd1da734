"""Bad configuration fails at start-up with a message naming what was wrong
and what is allowed."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from helpers import running_llm
from vllm_accel.settings import AccelSettings, load_settings


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_unsupported_architecture_fails_naming_it(tiny_models, tmp_path):
    model_dir = copy_model(tiny_models["llama"], tmp_path / "qwen2")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"Qwen2ForCausalLM.*supports.*LlamaForCausalLM"):
        with running_llm(model_dir):
            pass


def test_kv_budget_too_small_fails_naming_the_setting(tiny_models, monkeypatch):
    monkeypatch.setenv("VLLM_ACCEL_KVCACHE_SPACE", "0.001")
    with pytest.raises(ValueError, match=r"VLLM_ACCEL_KVCACHE_SPACE=0.001 GiB is too small"):
        with running_llm(tiny_models["llama"], max_model_len=512):
            pass


def test_invalid_setting_fails_naming_variable_and_allowed_values(tiny_models, monkeypatch):
    monkeypatch.setenv("VLLM_ACCEL_DEVICE", "gpu")
    with pytest.raises(Exception, match=r"VLLM_ACCEL_DEVICE.*auto, cpu, hpu"):
        with running_llm(tiny_models["llama"]):
            pass


def test_weight_missing_from_checkpoint_fails_naming_it(tiny_models, tmp_path):
    model_dir = copy_model(tiny_models["llama"], tmp_path / "broken")
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"not loaded.*layers\.1\.ff_sub_layer\.w2"):
        with running_llm(model_dir):
            pass


def test_additional_config_overrides_environment(monkeypatch):
    monkeypatch.setenv("VLLM_ACCEL_KVCACHE_SPACE", "2")
    assert load_settings().kvcache_space == 2.0
    assert load_settings({"accel": {"kvcache_space": 0.5}}).kvcache_space == 0.5
    assert load_settings({}).device == AccelSettings().device
    with pytest.raises(ValueError, match=r"Unknown vllm-accel setting 'kv_space'.*kvcache_space"):
        load_settings({"accel": {"kv_space": 1}})
    with pytest.raises(ValueError, match=r"accel.num_threads.*integer"):
        load_settings({"accel": {"num_threads": "many"}})


def test_mixed_attention_layer_kinds_fail_naming_the_setting(tiny_models, tmp_path):
    """A config whose layer_types mix windowed and full attention, for an
    architecture whose model attends every layer with one window (HF's
    Mistral ignores layer_types): refused at start-up, naming the setting and
    what is allowed (Granite SWA mixes them)."""
    model_dir = copy_model(tiny_models["mistral"], tmp_path / "mistral-mixed")
    config = json.loads((model_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"layer_types.*Allowed: one attention kind.*"
                                         r"GraniteSWAForCausalLM"):
        with running_llm(model_dir, max_model_len=512):
            pass


def test_a_rotary_base_per_layer_fails_naming_the_setting(tiny_models, tmp_path):
    """Granite SWA's layer_rope_theta (a rotary base per layer, 0 for none):
    FMS's model has one rotary embedding, so any other base is refused at
    start-up, naming the setting."""
    model_dir = copy_model(tiny_models["granite_swa"], tmp_path / "granite-swa-nope")
    config = json.loads((model_dir / "config.json").read_text())
    config["layer_rope_theta"][1] = 0
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"rotary base per layer.*layer_rope_theta.*Allowed"):
        with running_llm(model_dir, max_model_len=512):
            pass
