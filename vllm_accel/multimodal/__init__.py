"""Multimodal support (mm_mappings): arrives with the multimodal issues."""
