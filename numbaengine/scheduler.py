"""Continuous batching: one engine thread runs decoding rounds; requests join between rounds (prefill, then the
next round) and leave as soon as they finish, hit a stop string, fail or are cancelled.

A request decodes as Engine.generate would decode it alone: sequence index 0 and its own seed key its sampling
noise, its cache has generate's size, and its round sees only its own tree. On numpy each sequence runs its own
decode_round (they are sequential there anyway); on the kernel backends the requests share one DeviceRounds, whose
Shape fixes mode, budget, temperature and seed: a request with other settings waits until that batch drains.
"""
from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter

from numbaengine import generate as gen
from numbaengine.ddtree import Params, Seq, decode_round


class QueueFull(Exception):
    """More requests are waiting than the scheduler accepts (HTTP 429)."""


@dataclass(eq=False)
class Request:
    ids: list                          # prompt token ids, checked by generate.prompt_ids
    max_tokens: int
    mode: str = "ddtree"
    budget: int = 16
    temperature: float = 0.0
    seed: int = 0
    stop_ids: list | None = None       # token ids that end the output (kept); None: the checkpoint's eos ids
    stop_strings: tuple = ()           # the text ends before the first one found
    emit: Callable = print             # emit(Update), called on the engine thread
    cancelled: bool = False


@dataclass
class Update:
    """What one prefill or round did for a request."""
    text: str = ""                     # text added since the last update
    tokens: int = 0                    # completion tokens so far
    finish_reason: str | None = None   # "stop" | "length" once finished
    error: str | None = None           # the engine failed this request (finish_reason is "error")


@dataclass(eq=False)
class Live:
    """A request in the batch: generation state, device slot, and the text sent so far."""
    req: Request
    run: gen.Run
    stop: set
    slot: int = 0
    limit: int = 0                     # cache rows generate would give it: prompt + max_tokens + tree width
    sent: str = ""


@dataclass
class RoundStats:
    seconds: float
    taus: list                         # tokens committed per sequence
    batch: int                         # sequences in the round
    queued: int                        # requests waiting after it


class Scheduler:
    """The engine thread and its queue. submit() and cancel() are called from any thread."""

    def __init__(self, engine, max_batch=8, max_queue=64, on_round=None, fail_ids=None):
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        self.rounds = HostRounds(engine) if engine.backend == "numpy" else DeviceSlots(engine, max_batch)
        self.on_round = on_round or (lambda stats: None)
        self.fail_ids = fail_ids           # test hook: a request with exactly these prompt ids fails in its round
        self.pending, self.live = deque(), []
        self.cond, self.stopping = threading.Condition(), False
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def submit(self, req: Request):
        with self.cond:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if len(self.pending) >= self.max_queue:
                raise QueueFull(f"{len(self.pending)} requests are queued (--max-queue {self.max_queue})")
            self.pending.append(req)
            self.cond.notify()

    def cancel(self, req: Request):
        """The request leaves before the next round (or the queue now); it gets no more updates."""
        with self.cond:
            req.cancelled = True
            if req in self.pending:
                self.pending.remove(req)

    def close(self, timeout=None):
        """Finish what is queued and running, then end the engine thread."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout)

    def load(self) -> dict:
        return dict(active=len(self.live), queued=len(self.pending), max_batch=self.max_batch)

    # --- the engine thread -----------------------------------------------------------------------------------------

    def _loop(self):
        with self.engine.blas_threads():     # the BLAS threads Engine.generate decodes with
            while self._wait():
                self._admit()
                self._leave([x for x in self.live if x.req.cancelled])
                if self.live:
                    self._round()

    def _wait(self) -> bool:
        """Block while there is nothing to do; False once stopping and drained."""
        with self.cond:
            while not self.live and not self.pending:
                if self.stopping:
                    return False
                self.cond.wait()
            return True

    def _admit(self):
        """Prefill queued requests into free places, in order, while the backend takes them."""
        while True:
            with self.cond:
                if not self.pending or len(self.live) >= self.max_batch or \
                        not self.rounds.fits(self.pending[0], self.live):
                    return
                req = self.pending.popleft()
            try:
                live = self.rounds.prefill(req)
            except Exception as e:      # noqa: BLE001 - one request's fault fails only that request
                req.emit(Update(finish_reason="error", error=f"{type(e).__name__}: {e}"))
                continue
            self.live.append(live)
            self._after(live, [live.run.seq.bonus])

    def _round(self):
        t0 = perf_counter()
        try:
            results = self.rounds.step(self.live)
        except Exception as e:          # noqa: BLE001 - a shared round failed: every sequence in it fails
            results = {id(x): e for x in self.live}
        for x in list(self.live):
            got = results[id(x)]
            if x.req.ids == self.fail_ids:
                got = RuntimeError("injected fault (--fail-prompt)")
            if isinstance(got, list):
                x.run.taus.append(len(got))
            self._after(x, got)
        taus = [len(r) for r in results.values() if isinstance(r, list)]
        self.on_round(RoundStats(perf_counter() - t0, taus, len(results), len(self.pending)))

    def _after(self, x: Live, got):
        """Commit a round's tokens (or its exception) and send the update; a finished sequence (stop token, length,
        context, stop string), a failed or a cancelled one leaves."""
        try:
            if isinstance(got, Exception):
                raise got
            if x.req.cancelled:
                self._leave([x])
                return
            push(x, got)
            update = settle(self.engine.tokenizer, x)
            x.req.emit(update)
            if update.finish_reason is not None:
                self._leave([x])
        except Exception as e:          # noqa: BLE001 - isolated to this request
            self._leave([x])
            with contextlib.suppress(Exception):     # an emit that failed too: the engine thread goes on
                x.req.emit(Update(tokens=len(x.run.tokens), finish_reason="error", error=f"{type(e).__name__}: {e}"))

    def _leave(self, done):
        if done:
            self.live = [x for x in self.live if x not in done]
            self.rounds.retire(done)


def push(x: Live, tokens):
    """generate.push, then generate's end at a full cache (its still_decoding, against the reference cache size)."""
    gen.push(x.run, tokens, x.stop, x.req.max_tokens)
    if x.run.stop_reason is None and x.run.seq.start >= x.limit:
        x.run.stop_reason = "context"


def settle(tokenizer, x: Live) -> Update:
    """The Update for a sequence's tokens so far. A stop string ends it: the tokens are cut after the one that
    completed it and the text before it. Unfinished, text that may still change is held back: a trailing U+FFFD
    (a character split between tokens) and a tail that could begin a stop string."""
    run, stops = x.run, x.req.stop_strings
    text = tokenizer.decode(run.tokens)
    cut = first_stop(text, stops)
    if cut >= 0:
        k = next(k for k in range(1, len(run.tokens) + 1) if first_stop(tokenizer.decode(run.tokens[:k]), stops) >= 0)
        run.tokens[k:], run.stop_reason, text = [], "stop", text[:cut]
    finish = None if run.stop_reason is None else ("length" if run.stop_reason in ("length", "context") else "stop")
    show = text if finish else held(text, stops)
    delta = show[len(x.sent):] if show.startswith(x.sent) else ""
    x.sent += delta
    return Update(delta, len(run.tokens), finish)


def first_stop(text, stops) -> int:
    """Index of the earliest stop string in text, -1 when none occurs."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def held(text, stops) -> str:
    """text without a trailing U+FFFD run and without its longest tail that is a proper prefix of a stop string."""
    text = text.rstrip("\ufffd")
    tail = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[:len(text) - tail]


# --- numpy: one decode_round per sequence ------------------------------------------------------------------------------

class HostRounds:
    """Host sequences, each with its own cache; any mix of settings runs in one round."""

    def __init__(self, engine):
        self.engine = engine

    def fits(self, req, live) -> bool:
        return True

    def prefill(self, req: Request) -> Live:
        e = self.engine
        gen.check_args(req.mode, req.budget, req.max_tokens, req.temperature, e.drafter)
        width = gen.tree_width(req.mode, req.budget, e.drafter)
        rows = min(e.max_context, len(req.ids) + req.max_tokens + width)
        drafter = e.drafter if req.mode != "ar" else None
        seq = gen.prefill(0, req.ids, e.target, drafter, e.target.ops, params(req), rows)
        return Live(req, gen.Run(seq, len(req.ids)), stop_set(e, req), limit=rows)

    def step(self, live) -> dict:
        """id(Live) -> new tokens (or the exception that sequence raised)."""
        out = {}
        for x in live:
            try:
                out[id(x)] = self._one(x)
            except Exception as e:      # noqa: BLE001 - isolated per sequence
                out[id(x)] = e
        return out

    def _one(self, x: Live) -> list:
        e, seq = self.engine, x.run.seq
        width = gen.tree_width(x.req.mode, x.req.budget, e.drafter)
        budget = min(width, seq.cache.max_len - seq.start - 1)            # generate's shrink near a full cache
        drafter = e.drafter if x.req.mode != "ar" else None
        return decode_round([seq], [budget], e.target, drafter, e.target.ops, params(x.req), gen.Timer())[0].tokens

    def retire(self, done):
        pass


def params(req: Request) -> Params:
    return Params(req.mode, float(req.temperature), int(req.seed))


def stop_set(engine, req: Request) -> set:
    return set(engine.cfg.eos_ids if req.stop_ids is None else (int(t) for t in req.stop_ids))


# --- kernel backends: slots of one DeviceRounds --------------------------------------------------------------------

@dataclass
class DeviceSlots:
    """`batch` slots of one DeviceRounds (its graph replayed every round). Its Shape holds one mode, budget,
    temperature and seed (any seed at temperature 0): requests with those settings share the rounds."""
    engine: object
    batch: int
    dev: object = None
    free: list = field(default_factory=list)

    def shape(self, req: Request):
        from numbaengine.device_round import Shape
        width = gen.tree_width(req.mode, req.budget, self.engine.drafter)
        seed = int(req.seed) if req.temperature > 0 else 0
        return Shape(self.batch, req.mode, width, self.engine.max_context, float(req.temperature), seed)

    def fits(self, req, live) -> bool:
        return not live or self.dev is None or self.shape(req) == self.dev.shape

    def prefill(self, req: Request) -> Live:
        e = self.engine
        gen.check_args(req.mode, req.budget, req.max_tokens, req.temperature, e.drafter)
        shape = self.shape(req)
        if self.dev is None or self.dev.shape != shape:
            self._build(shape)
        slot = self.free.pop(0)
        try:
            bonus = self.dev.prefill(slot, req.ids, 0)
        except Exception:
            self.retire_slots([slot])
            raise
        limit = min(e.max_context, len(req.ids) + req.max_tokens + shape.budget)
        return Live(req, gen.Run(Seq(0, None, None, len(req.ids), bonus), len(req.ids)), stop_set(e, req), slot, limit)

    def _build(self, shape):
        from numbaengine.device_round import DeviceRounds, Replicated
        e = self.engine
        self.dev = None
        e.rounds_cache.clear()                       # one resident set of round buffers
        self.dev = DeviceRounds(e.target, e.drafter, shape) if e.ranks is None else Replicated(e.ranks, shape)
        self.free = list(range(shape.batch))
        self.dev.retire(list(range(shape.batch)))   # unused slots stay parked at an empty context

    def step(self, live) -> dict:
        """One graph launch for every slot; each sequence's tau is cut to its reference cache size."""
        try:
            out = self.dev.step()
        except Exception:
            self.dev = None                          # rebuilt for the next request
            raise
        new = {}
        for x in live:
            tau = min(int(out[x.slot, 0]), x.limit - x.run.seq.start)
            x.run.seq.start += tau
            new[id(x)] = out[x.slot, 1:tau + 1].tolist()
        return new

    def retire(self, done):
        self.retire_slots([x.slot for x in done])

    def retire_slots(self, slots):
        if self.dev is not None and slots:
            self.dev.retire(slots)
            self.free = sorted(set(self.free) | set(slots))
