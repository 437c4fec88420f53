"""Decode a stored weight to float32 once, for the NumPy reference ops' speed.

Weights never change after loading and both decodes (bf16 bits; INT4 nibbles times bf16 group scales) are exact
in float32, so the memo changes no result. Entries die with the array (or record) they belong to.
"""
import weakref

_F32 = {}


def memo_f32(owner, decode, *key):
    """decode() computed once per (owner object, key) while owner lives."""
    k = (id(owner),) + key
    if k not in _F32:
        _F32[k] = decode()
        weakref.finalize(owner, _F32.pop, k, None)
    return _F32[k]
