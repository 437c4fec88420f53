"""Budget auto's cost tables kept on disk (numbaengine/cost_store.py): the key and what changes it, save / load,
damaged files measured again, DeviceSlots reading the kept table instead of timing its rounds, racing writer
processes, the kernel cache's off switch and clear()."""
import dataclasses
import json
import multiprocessing
from datetime import datetime
from types import SimpleNamespace

import numpy as np
import pytest

from numbaengine import cost_store
from numbaengine.budget import CostTable
from numbaengine.config import load_config
from numbaengine.ddtree import Params
from numbaengine.device_round import Shape
from numbaengine.drafter import load_draft_config
from numbaengine.kernels import cache
from numbaengine.rounds import DeviceSlots, Run
from numbaengine.weights import SHIPPED_PAIR

TARGET, DRAFT = load_config(SHIPPED_PAIR / "target"), load_draft_config(SHIPPED_PAIR / "draft")
SHAPE = Shape(4, "ddtree", 64, 512, (0, 2, 4, 8, 16, 32, 64))
TABLE = CostTable((0, 2), {1: (0.1 + 0.2, 1 / 3), 2: (0.5, 1e-7)}, model="m", device="gpu")


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The kernel cache (and so the cost tables) on, in tmp_path; the defaults again afterwards."""
    monkeypatch.delenv("NUMBAENGINE_KERNEL_CACHE", raising=False)
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    cache.configure(tmp_path)
    yield tmp_path / cache.COST_TABLES
    cache.configure()


def key(**change):
    parts = {"target_cfg": TARGET, "drafter_cfg": DRAFT, "shape": SHAPE, "devices": 1, "graphs": True,
             "gpu": "NVIDIA H100", "toolchain": ((9, 0), 12080), "ops": ("cuda",), "source": None}
    return cost_store.cost_key(**(parts | change))


def test_key_follows_every_ingredient():
    changed = [key(target_cfg=dataclasses.replace(TARGET, hidden_size=512)),
               key(target_cfg=dataclasses.replace(TARGET, quant=dataclasses.replace(TARGET.quant, method="none"))),
               key(drafter_cfg=dataclasses.replace(DRAFT, block_size=8)), key(drafter_cfg=None),
               key(shape=dataclasses.replace(SHAPE, batch=8)), key(shape=dataclasses.replace(SHAPE, ladder=(0, 64))),
               key(shape=dataclasses.replace(SHAPE, max_len=1024)), key(devices=2), key(graphs=False),
               key(gpu="NVIDIA H200"), key(toolchain=((9, 0), 12090)), key(ops=("cuda", "wgmma off")),
               key(source="0" * 64)]
    assert len(set(changed)) == len(changed) and key() not in changed
    assert key() == key() == key(source=cost_store.source_digest()) and len(key()) == 64
    assert cost_store.source_digest() is cost_store.source_digest()          # once per process


def test_save_then_load_round_trips(store):
    k = key()
    cost_store.save(k, TABLE)
    assert cost_store.load(k) == TABLE
    saved = json.loads((store / f"{k}.json").read_text())
    assert saved["key"] == k and datetime.fromisoformat(saved["measured_at"]).utcoffset().total_seconds() == 0
    assert [p.name for p in store.iterdir()] == [f"{k}.json"]                # no temp file left


class Measure:
    """measure() for table_for: counts its calls."""
    def __init__(self, table=TABLE):
        self.table, self.calls = table, 0

    def __call__(self):
        self.calls += 1
        return self.table


@pytest.mark.parametrize("content, words", [("{not json", "Expecting"), ('{"key": "', "Unterminated"),
                                            ("other key", "another key"), ('"a string"', "not a cost table"),
                                            ("bad table", "sizes")])
def test_damaged_file_is_reported_measured_and_rewritten(store, capsys, content, words):
    k = key()
    store.mkdir(parents=True)
    d = dict(TABLE.to_dict(), key="ab" * 32 if content == "other key" else k)
    if content == "bad table":
        d["sizes"] = [2, 0]
    (store / f"{k}.json").write_text(json.dumps(d) if content in ("other key", "bad table") else content)
    measure = Measure()
    assert cost_store.table_for(k, measure) == (TABLE, "measured") and measure.calls == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(store / f"{k}.json") in err and words in err, err
    assert cost_store.table_for(k, measure) == (TABLE, str(store / f"{k}.json")) and measure.calls == 1
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("how", ["env", "configure"])
def test_cache_off_measures_and_writes_nothing(store, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("NUMBAENGINE_KERNEL_CACHE", "0")
    else:
        cache.configure(store.parent, enabled=False)
    measure = Measure()
    for _ in range(2):
        assert cost_store.table_for(key(), measure) == (TABLE, "measured")
    assert measure.calls == 2 and not store.exists()
    assert cost_store.rounds_key(None, None, SHAPE, None, True) is None


def test_dry_run_measures_and_writes_nothing(store):
    measure = Measure()
    with cache.recording():                                                  # launches skipped: garbage seconds
        assert cost_store.table_for(key(), measure) == (TABLE, "measured")
    assert measure.calls == 1 and not store.exists()


def test_clear_removes_the_tables_and_nothing_else(store):
    cost_store.save(key(), TABLE)
    (store / f".{key()}.left.tmp").write_text("half")                        # a killed writer's temp file
    (store.parent / "notes.txt").write_text("not ours")
    assert cache.clear(store.parent) == 2
    assert [p.name for p in store.parent.iterdir()] == ["notes.txt"]


# --- DeviceSlots over a stand-in device ------------------------------------------------------------------------------

class CostDev:
    """DeviceRounds stand-in for DeviceSlots.build: costs() counts its calls."""
    def __init__(self, shape):
        self.shape, self.table, self.calls = shape, None, 0

    def retire(self, slots):
        pass

    def costs(self, reps):
        self.calls += 1
        return CostTable(self.shape.ladder, {1: (1.0, 2.0), 2: (1.5, 3.0)}, device="stand-in")


def slots_run(table=None):
    """(the CostDev under DeviceSlots of two slots made for auto, their first auto run after begin())."""
    ops = SimpleNamespace(name="cuda", xp=np, mla=1, gemm_wg=2, dispatch=3, moe_cfg=4, poison=False, trim_warps=False)
    target = SimpleNamespace(cfg=TARGET, ops=ops, cache_dtype="bf16")
    slots = DeviceSlots(target, SimpleNamespace(cfg=DRAFT), 64, 2, table=table, ladder=(0, 2))
    run = Run([1], 8, set(), Params(mode="ddtree"), "auto")
    dev = slots.cache[slots.shape(run)] = CostDev(slots.shape(run))
    slots.begin(run, [])
    return dev, run


def test_device_slots_measure_once_then_load(store, monkeypatch):
    monkeypatch.setattr(cache, "current_cc", lambda: (9, 0))
    dev, run = slots_run()
    assert dev.calls == 1 and run.picks.stats()["cost_table_from"] == "measured"
    files = list(store.iterdir())
    assert len(files) == 1
    dev2, run2 = slots_run()                                                 # a new process's rounds, say
    assert dev2.calls == 0 and dev2.table == dev.table and run2.picks.stats()["cost_table_from"] == str(files[0])
    dev3, run3 = slots_run(table=TABLE)                                      # --cost-table FILE
    assert dev3.calls == 0 and dev3.table is None and run3.picks.stats()["cost_table_from"] == "given"


# --- racing writers ---------------------------------------------------------------------------------------------------

def write_many(directory, k, tag):
    """A writer process: save k's table over and over, its seconds marked by tag."""
    cache.configure(directory)
    for i in range(200):
        cost_store.save(k, CostTable((0, 2), {1: (tag, tag + i)}))


def test_racing_writer_processes_leave_one_valid_file(store, capsys):
    ctx, k = multiprocessing.get_context("spawn"), key()
    writers = [ctx.Process(target=write_many, args=(store.parent, k, float(t))) for t in (1, 2)]
    for w in writers:
        w.start()
    seen = set()
    while any(w.is_alive() for w in writers):
        table = cost_store.load(k)
        if table is not None:
            seen.add(table.seconds[1][0])
    for w in writers:
        w.join()
    assert [w.exitcode for w in writers] == [0, 0]
    table = cost_store.load(k)
    assert table is not None and table.seconds[1][0] in (1.0, 2.0) and seen <= {1.0, 2.0}
    assert capsys.readouterr().err == ""                                     # never a damaged file
    assert [p.name for p in store.iterdir()] == [f"{k}.json"]
