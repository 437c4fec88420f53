"""Checkpoint formats: bf16/e4m3 bits, safetensors shards, INT4 pack-quantized and FP8 block weights, the tensor
layout of K2 targets and DFlash drafters, a synthetic-checkpoint writer (numbaengine.weights.synth), and the shipped
model pair (default/: a toy target and drafter, see default/MODEL_CARD.md)."""
from pathlib import Path

from .shards import Checkpoint, CheckpointError, write_checkpoint, write_checkpoint_lazy

SHIPPED_PAIR = Path(__file__).resolve().parent / "default"     # target/ and draft/

__all__ = ["SHIPPED_PAIR", "Checkpoint", "CheckpointError", "write_checkpoint", "write_checkpoint_lazy"]
