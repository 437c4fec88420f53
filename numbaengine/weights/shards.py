"""Safetensors checkpoints, read lazily through a memory map and written in streaming fashion.

File layout: [u64 little-endian N][N bytes of JSON header, space padded to a multiple of 8][data]. The header maps
each tensor name to {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end)} (byte offsets into the data
part, which they tile without gaps) plus an optional "__metadata__" {str: str}. A sharded checkpoint adds
`model.safetensors.index.json` = {"metadata": {"total_size": bytes}, "weight_map": {name: shard file name}}.
Arrays come back as read-only views of the mapped file: BF16 as uint16 bit patterns, F8_E4M3 as uint8 codes.
"""
from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 << 20          # the safetensors library's own limit
DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "F16": np.float16,
          "BF16": np.uint16, "U32": np.uint32, "I32": np.int32, "F32": np.float32, "U64": np.uint64,
          "I64": np.int64, "F64": np.float64, "F8_E4M3": np.uint8}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not hold what is expected; the message names the tensor/file."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file and absolute byte range [start, end)."""
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def nbytes(shape, dtype: str) -> int:
    return math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize


# ---------------------------------------------------------------- reading

def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one .safetensors header (reads only the header bytes)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated file ({size} bytes, no header length)")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > MAX_HEADER:
            raise CheckpointError(f"{path}: truncated file or bad header: header length {n} exceeds the "
                                  f"{size - 8} bytes after it")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    return {name: _tensor_info(path, name, entry, 8 + n, size) for name, entry in header.items()}


def _tensor_info(path: Path, name: str, entry, base: int, size: int) -> TensorInfo:
    try:
        dtype, shape, (a, b) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{path}: tensor {name}: malformed header entry") from None
    if dtype not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {dtype}")
    want = nbytes(shape, dtype)
    if not 0 <= a <= b or b - a != want:
        raise CheckpointError(f"{path}: tensor {name}: data_offsets [{a}, {b}) hold {b - a} bytes but "
                              f"{dtype} {list(shape)} needs {want}")
    if base + b > size:
        raise CheckpointError(f"{path}: truncated file: tensor {name} ends at byte {base + b}, file has {size}")
    return TensorInfo(path, dtype, shape, base + a, base + b)


def _read_index(index: Path) -> dict[str, TensorInfo]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid index (no weight_map or bad JSON: {e})") from None
    headers = {}
    for name, file in weight_map.items():
        if file not in headers:
            if not (index.parent / file).is_file():
                raise CheckpointError(f"{index}: shard {file} (holding tensor {name}) is missing")
            headers[file] = read_header(index.parent / file)
        if name not in headers[file]:
            raise CheckpointError(f"{index.parent / file}: tensor {name} listed in {INDEX} is not in this shard")
    return {name: headers[file][name] for name, file in weight_map.items()}


def _merge(files: list[Path]) -> dict[str, TensorInfo]:
    infos: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in read_header(f).items():
            if name in infos:
                raise CheckpointError(f"tensor {name} is in both {infos[name].file.name} and {f.name}")
            infos[name] = info
    return infos


def _open(path: Path) -> dict[str, TensorInfo]:
    if path.is_dir():
        if (path / INDEX).is_file():
            return _read_index(path / INDEX)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX}")
        return _merge(files)
    if path.name.endswith(".index.json") and path.is_file():
        return _read_index(path)
    if path.is_file():
        return read_header(path)
    raise CheckpointError(f"{path}: no such checkpoint file or folder")


class Checkpoint:
    """The tensors of a folder (index.json, or every *.safetensors in it), one .safetensors file or an index.json.

    Headers are parsed (and validated) up front; data is memory-mapped on first `get`, never read whole."""

    def __init__(self, path):
        self.path = Path(path)
        self._info = _open(self.path)                  # name -> TensorInfo
        self._maps: dict[Path, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def __len__(self) -> int:
        return len(self._info)

    def names(self) -> list[str]:
        return list(self._info)

    def info(self, name: str) -> TensorInfo:
        if name not in self._info:
            near = difflib.get_close_matches(name, self._info, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise CheckpointError(f"tensor {name} not found in {self.path}{hint}")
        return self._info[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> str:
        return self.info(name).dtype

    def get(self, name: str) -> np.ndarray:
        """Read-only view of the mapped bytes (no copy)."""
        info = self.info(name)
        if info.file not in self._maps:
            self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        raw = self._maps[info.file][info.start:info.end].view(np.ndarray)
        return raw.view(DTYPES[info.dtype]).reshape(info.shape)

    def check(self, name: str, shape, dtype: str | tuple[str, ...]) -> TensorInfo:
        """One-line CheckpointError unless `name` exists with this shape and dtype (any of them, for a tuple)."""
        info = self.info(name)
        ok_dtypes = (dtype,) if isinstance(dtype, str) else tuple(dtype)
        if info.shape != tuple(shape) or info.dtype not in ok_dtypes:
            raise CheckpointError(f"tensor {name}: expected {'|'.join(ok_dtypes)} {list(shape)}, found "
                                  f"{info.dtype} {list(info.shape)} in {info.file.name}")
        return info

    def get_checked(self, name: str, shape, dtype: str | tuple[str, ...]) -> np.ndarray:
        self.check(name, shape, dtype)
        return self.get(name)

    def check_all(self, expected: dict, prefix: str = "") -> None:
        """Check every tensor of `expected` {name: (shape, dtype)} (names without `prefix`) without reading data."""
        for name, (shape, dtype) in expected.items():
            self.check(prefix + name, shape, dtype)


# ---------------------------------------------------------------- writing

Spec = tuple[tuple[int, ...], str]          # (shape, safetensors dtype)


def write_checkpoint(out_dir, tensors: dict[str, tuple[np.ndarray, str]], shard_bytes: int | None = None,
                     metadata: dict[str, str] | None = None) -> list[Path]:
    """Write {name: (array, dtype)} as model.safetensors, or as shards of at most ~shard_bytes plus an index."""
    specs = {name: (tuple(a.shape), dt) for name, (a, dt) in tensors.items()}
    return write_checkpoint_lazy(out_dir, specs, lambda name: tensors[name][0], shard_bytes, metadata)


def write_checkpoint_lazy(out_dir, specs: dict[str, Spec], make: Callable[[str], np.ndarray | Iterable[np.ndarray]],
                          shard_bytes: int | None = None, metadata: dict[str, str] | None = None) -> list[Path]:
    """Streaming writer: `make(name)` is called once per tensor, in write order, and returns the array or an
    iterable of row chunks (so no tensor, and never the whole model, has to be held in memory).

    Shards are filled in `specs` order; one shard -> model.safetensors, else model-0000i-of-0000N.safetensors and
    model.safetensors.index.json. Returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, (_, dt) in specs.items():
        if dt not in DTYPES:
            raise CheckpointError(f"tensor {name}: unsupported dtype {dt}")
    groups = _split(specs, shard_bytes)
    files = [SINGLE] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                                for i in range(len(groups))]
    _remove_old(out)
    for file, group in zip(files, groups):
        _write_file(out / file, {n: specs[n] for n in group}, make, metadata or {"format": "pt"})
    if len(groups) > 1:
        total = sum(nbytes(*s) for s in specs.values())
        weight_map = {n: f for f, g in zip(files, groups) for n in g}
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return [out / f for f in files]


def _split(specs: dict[str, Spec], shard_bytes: int | None) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, spec in specs.items():
        n = nbytes(*spec)
        if shard_bytes and groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def _remove_old(out: Path) -> None:
    """Drop files of an earlier write that a reader of `out` would otherwise mix in."""
    for p in [out / INDEX, out / SINGLE, *out.glob("model-?????-of-?????.safetensors")]:
        p.unlink(missing_ok=True)


def _write_file(path: Path, specs: dict[str, Spec], make, metadata: dict[str, str]) -> None:
    # Largest itemsize first (stable), so every tensor starts at an offset aligned to its itemsize.
    order = sorted(specs, key=lambda n: -np.dtype(DTYPES[specs[n][1]]).itemsize)
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in order:
        shape, dt = specs[name]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + nbytes(shape, dt)]}
        offset += nbytes(shape, dt)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in order:
            _write_tensor(f, name, specs[name], make(name))


def _write_tensor(f, name: str, spec: Spec, data) -> None:
    shape, dt = spec
    chunks = [data] if isinstance(data, np.ndarray) else data
    written = 0
    for chunk in chunks:
        chunk = np.asarray(chunk)
        if chunk.dtype != DTYPES[dt]:
            raise CheckpointError(f"tensor {name}: array dtype {chunk.dtype} does not store {dt} "
                                  f"(needs {np.dtype(DTYPES[dt])})")
        if isinstance(data, np.ndarray) and chunk.shape != tuple(shape):
            raise CheckpointError(f"tensor {name}: array shape {list(chunk.shape)} != declared {list(shape)}")
        chunk = np.ascontiguousarray(chunk, dtype=chunk.dtype.newbyteorder("<"))
        f.write(chunk.data if chunk.ndim else chunk.tobytes())
        written += chunk.nbytes
    if written != nbytes(shape, dt):
        raise CheckpointError(f"tensor {name}: wrote {written} bytes but {dt} {list(shape)} needs {nbytes(shape, dt)}")
