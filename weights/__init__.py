"""Checkpoint formats: bf16/e4m3 bits, safetensors shards, INT4 pack-quantized and FP8 block weights, the tensor
layout of K2 targets and DFlash drafters, and a synthetic-checkpoint writer (weights.synth)."""
from .shards import Checkpoint, CheckpointError, write_checkpoint, write_checkpoint_lazy

__all__ = ["Checkpoint", "CheckpointError", "write_checkpoint", "write_checkpoint_lazy"]
