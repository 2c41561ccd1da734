"""Give a tiny LlavaNext or Qwen2.5-VL fixture the hub's full-size vision tower (random
weights, transformers' own init, seeded), keeping its tiny language model, tokenizer and
processor. What batch evaluation of a real checkpoint spends its time on is the tower; the
tiny fixtures' towers (a few layers of width 64) leave the processor and per-step host work.

    llava_next: SigLIP so400m/14 at 384 px (27 layers, width 1152, 729 patches a tile) with
                granite-vision's feature layers [-24, -20, -12, -1]; tiles of 384 px
    qwen2_5_vl: Qwen2.5-VL's ViT (32 blocks, width 1280, 112-px windows, full attention in
                blocks 7/15/23/31); images up to 448 x 448 pixels

    .venv/bin/python benchmarks/full_vision_model.py {llava_next,qwen2_5_vl} DIR

DIR holds the tiny fixture (vllm_accel.testing.fixtures) and is rewritten in place.
"""
import argparse
import json
from pathlib import Path

SIGLIP_SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                     num_attention_heads=16, image_size=384, patch_size=14)
GRANITE_VISION_FEATURE_LAYERS = [-24, -20, -12, -1]
LLAVA_PINPOINTS = [[384, 384], [384, 768], [768, 384], [768, 768], [384, 1152], [1152, 384]]
QWEN2_5_VL_VIT = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                      window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
QWEN_MAX_PIXELS = 448 * 448


def _edit_json(path: Path, **changes) -> dict:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    path.write_text(json.dumps(data, indent=2))
    return data


def _tower_state_dict(model, prefix: str) -> dict:
    return {prefix + k: v.detach().contiguous() for k, v in model.state_dict().items()}


def llava_next(out: Path, seed: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import SiglipVisionConfig, SiglipVisionModel

    tile = SIGLIP_SO400M["image_size"]
    config = _edit_json(out / "config.json",
                        vision_config=SIGLIP_SO400M,
                        vision_feature_layer=GRANITE_VISION_FEATURE_LAYERS,
                        image_grid_pinpoints=LLAVA_PINPOINTS,
                        image_seq_length=(tile // SIGLIP_SO400M["patch_size"]) ** 2,
                        # a 768 x 768 image is ~3,700 tokens at 729 a tile
                        text_config={"max_position_embeddings": 4096})
    size = {"height": tile, "width": tile}
    _edit_json(out / "preprocessor_config.json", crop_size=size, size=size,
               image_grid_pinpoints=LLAVA_PINPOINTS)
    _edit_json(out / "processor_config.json", patch_size=SIGLIP_SO400M["patch_size"])

    torch.manual_seed(seed)
    vision = SiglipVisionConfig(**{**config["vision_config"], **SIGLIP_SO400M})
    tower = SiglipVisionModel(vision).eval()
    sd = {k: v for k, v in load_file(str(out / "model.safetensors")).items()
          if not k.startswith(("vision_tower.", "multi_modal_projector.linear_1."))}
    sd.update(_tower_state_dict(tower, "vision_tower.vision_model."))
    projector_in = SIGLIP_SO400M["hidden_size"] * len(GRANITE_VISION_FEATURE_LAYERS)
    text_hidden = config["text_config"]["hidden_size"]
    sd["multi_modal_projector.linear_1.weight"] = torch.randn(text_hidden, projector_in) \
        * projector_in ** -0.5
    sd["multi_modal_projector.linear_1.bias"] = torch.zeros(text_hidden)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def qwen2_5_vl(out: Path, seed: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    config = _edit_json(out / "config.json", vision_config=QWEN2_5_VL_VIT)
    _edit_json(out / "preprocessor_config.json", max_pixels=QWEN_MAX_PIXELS)

    torch.manual_seed(seed)
    vision = Qwen2_5_VLVisionConfig(**config["vision_config"])
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision).eval()
    sd = {k: v for k, v in load_file(str(out / "model.safetensors")).items()
          if not k.startswith("visual.")}
    sd.update(_tower_state_dict(tower, "visual."))
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("arch", choices=["llava_next", "qwen2_5_vl"])
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    {"llava_next": llava_next, "qwen2_5_vl": qwen2_5_vl}[a.arch](Path(a.out_dir), a.seed)
    print(a.out_dir)


if __name__ == "__main__":
    main()
