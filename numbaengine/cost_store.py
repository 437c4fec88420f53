"""Budget auto's measured cost tables kept on disk, so a process does not time its rounds again.

A table lives at <kernel cache dir>/cost_tables/<key>.json: CostTable.to_dict() plus its key and "measured_at" (UTC,
ISO 8601). The key is a sha256 over everything that changes a round's cost: the target's and drafter's configs, the
rounds' Shape, the number of devices, whether rounds are graphs, the op table's choices, the GPU and its toolchain,
and a digest of numbaengine's own source (any code change measures again). The kernel cache's switch
(--no-kernel-cache, NUMBAENGINE_KERNEL_CACHE=0, the simulator) turns it off; writes are atomic (temp file and rename),
so processes racing on one key leave one whole file; a damaged file is reported in one line, measured and rewritten.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from numbaengine import env
from numbaengine.budget import CostTable
from numbaengine.kernels import cache

FORMAT = 1


@functools.cache
def source_digest() -> str:
    """Hex sha256 over every numbaengine/**/*.py file (its path in the package, then its bytes), sorted by path."""
    root, h = Path(__file__).parent, hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        h.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode() + data)
    return h.hexdigest()


def cost_key(target_cfg, drafter_cfg, shape, devices, graphs, gpu, toolchain, ops=(), source=None) -> str:
    """Hex sha256 naming a cost table: configs and Shape are frozen dataclasses (their repr lists every field);
    ops: the op table's choices; source: source_digest() by default."""
    parts = (FORMAT, target_cfg, drafter_cfg, shape, int(devices), bool(graphs), str(gpu), toolchain, ops,
             source or source_digest())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def rounds_key(target, drafter, shape, ranks, graphs) -> str | None:
    """cost_key of DeviceSlots' rounds on this GPU; None when the kernel cache is off."""
    if not cache.enabled():
        return None
    from numbaengine.device_round import device_name
    ops = target.ops
    choices = (ops.name, ops.mla, ops.gemm_wg, ops.dispatch, ops.moe_cfg, ops.poison, ops.trim_warps,
               target.cache_dtype, env.PDL, env.GEMM_WG)
    return cost_key(target.cfg, drafter.cfg if drafter is not None else None, shape,
                    len(ranks.devices) if ranks is not None else 1, graphs, device_name(ops),
                    cache.toolchain(cache.current_cc()), choices)


def table_path(key) -> Path:
    return cache.cache_dir() / cache.COST_TABLES / f"{key}.json"


def load(key) -> CostTable | None:
    """key's table; None when there is none, or (reported in one line) a damaged one or one of another key."""
    path = table_path(key)
    try:
        d = json.loads(path.read_text())
        if not isinstance(d, dict) or d.get("key") != key:
            raise ValueError("holds another key" if isinstance(d, dict) else "is not a cost table")
        return CostTable.from_dict(d)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as e:
        cache.warn(f"cost table {path}: {e}: measuring it again")
        return None


def save(key, table: CostTable):
    """Write key's table atomically: a temp file in the same folder, renamed over the table."""
    path = table_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    d = dict(key=key, measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), **table.to_dict())
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(d, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def table_for(key, measure) -> tuple[CostTable, str]:
    """key's saved table, else measure() saved under key -> (table, where it came from: its file or "measured").
    key None, the kernel cache off or a dry run (warmup's precompile: nothing launched, garbage seconds): measure()
    alone."""
    if key is None or not cache.enabled() or cache.dry_run():
        return measure(), "measured"
    table = load(key)
    if table is not None:
        return table, str(table_path(key))
    table = measure()
    try:
        save(key, table)
    except OSError as e:
        cache.warn(f"cannot write to {table_path(key).parent} ({e.strerror}): cost tables are not kept")
    return table, "measured"
