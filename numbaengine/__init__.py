"""numbaengine: Kimi-K2-class inference with a DFlash drafter and DDTree verification."""
from numbaengine.engine import Engine

__all__ = ["Engine"]
