"""Test helpers for vllm-accel (offline tiny checkpoints, etc.)."""
