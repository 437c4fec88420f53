"""Continuous batching: one engine thread runs decoding rounds; requests join between rounds (prefill, then the
next round) and leave as soon as they finish, hit a stop string, fail or are cancelled.

A request decodes as Engine.generate would decode it alone: sequence index 0 and its own seed key its sampling
noise, its cache has generate's size, and its round sees only its own tree. On numpy each sequence runs its own
decode_round (they are sequential there anyway); on the kernel backends the requests share one DeviceRounds: any
temperature, seed and budget up to the running tree size join it; a request of another mode (or a larger budget)
waits until that batch drains. Between two rounds at most `prefill_chunk` prompt tokens are prefilled, so a long
prompt (prefilled in pieces on the kernel backends) does not stall the running decodes for long.
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
from numbaengine.tokenizer import TextStream

PREFILL_CHUNK = 512                    # prompt tokens prefilled between two rounds (at least one piece)


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
    """A request in the batch: prefill progress, generation state, device slot, and the text sent so far."""
    req: Request
    stop: set
    slot: int = 0
    limit: int = 0                     # cache rows generate would give it: prompt + max_tokens + tree width
    run: gen.Run | None = None         # once the whole prompt is prefilled
    filled: int = 0                    # prompt tokens prefilled
    stream: TextStream | None = None   # the output's text
    seen: int = 0                      # tokens the last update covered (no stop string in their text)
    sent: int = 0                      # characters sent


@dataclass
class RoundStats:
    seconds: float
    taus: list                         # tokens committed per sequence
    batch: int                         # sequences in the round
    queued: int                        # requests waiting after it


class Scheduler:
    """The engine thread and its queue. submit() and cancel() are called from any thread."""

    def __init__(self, engine, max_batch=8, max_queue=64, on_round=None, fail_ids=None, prefill_chunk=PREFILL_CHUNK):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: must be a positive number of tokens, got {prefill_chunk!r}")
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        self.prefill_chunk = prefill_chunk
        self.rounds = HostRounds(engine) if engine.backend == "numpy" else DeviceSlots(engine, max_batch, prefill_chunk)
        self.on_round = on_round or (lambda stats: None)
        self.fail_ids = fail_ids           # test hook: a request with exactly these prompt ids fails in its round
        self.pending, self.filling, self.live = deque(), [], []      # queued, being prefilled, decoding
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
        return dict(active=len(self.live) + len(self.filling), queued=len(self.pending), max_batch=self.max_batch)

    # --- the engine thread -----------------------------------------------------------------------------------------

    def _loop(self):
        with self.engine.blas_threads():     # the BLAS threads Engine.generate decodes with
            while self._wait():
                self._admit()
                self._leave([x for x in self.filling + self.live if x.req.cancelled])
                self._prefill()
                if self.live:
                    self._round()

    def _wait(self) -> bool:
        """Block while there is nothing to do; False once stopping and drained."""
        with self.cond:
            while not self.live and not self.filling and not self.pending:
                if self.stopping:
                    return False
                self.cond.wait()
            return True

    def _admit(self):
        """Take queued requests into free places, in order, while the backend takes them (prefilled by _prefill)."""
        while True:
            busy = self.filling + self.live
            with self.cond:
                if not self.pending or len(busy) >= self.max_batch or not self.rounds.fits(self.pending[0], busy):
                    return
                req = self.pending.popleft()
            try:
                self.filling.append(self.rounds.begin(req, busy))
            except Exception as e:      # noqa: BLE001 - one request's fault fails only that request
                req.emit(Update(finish_reason="error", error=f"{type(e).__name__}: {e}"))

    def _prefill(self):
        """The next prompt pieces of the admitted requests, oldest first, up to prefill_chunk tokens in all (at least
        one piece); a request whose prompt is complete sends its first token and decodes from the next round."""
        used = 0
        for x in list(self.filling):
            n = self.rounds.piece(x)
            if used and used + n > self.prefill_chunk:
                return
            used += n
            try:
                if not self.rounds.fill(x, n):
                    continue
            except Exception as e:      # noqa: BLE001 - one request's fault fails only that request
                self._leave([x])
                x.req.emit(Update(finish_reason="error", error=f"{type(e).__name__}: {e}"))
                continue
            self.filling.remove(x)
            self.live.append(x)
            self._after(x, [x.run.seq.bonus])

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
            self.filling = [x for x in self.filling if x not in done]
            self.rounds.retire(done)


def push(x: Live, tokens):
    """generate.push, then generate's end at a full cache (its still_decoding, against the reference cache size)."""
    gen.push(x.run, tokens, x.stop, x.req.max_tokens)
    if x.run.stop_reason is None and x.run.seq.start >= x.limit:
        x.run.stop_reason = "context"


def settle(tokenizer, x: Live) -> Update:
    """The Update for a sequence's tokens so far. A stop string ends it: the tokens are cut after the one that
    completed it and the text before it. Unfinished, text that may still change is held back: a trailing U+FFFD
    (a character split between tokens) and a tail that could begin a stop string.

    Incremental (x.stream decodes only recent tokens): a stop string is looked for from the last stop length - 1
    characters of the text the previous update had settled on (the earlier text held none) and, when found, the
    tokens that completed it from those that update had not seen (a stop string free of U+FFFD found in the text
    of the first k tokens lies in text the later tokens do not change)."""
    run, stops = x.run, x.req.stop_strings
    s = x.stream = x.stream or TextStream(tokenizer)
    n, longest = len(run.tokens), max(map(len, stops), default=0)
    lo = max(0, len(s.stable) - max(longest - 1, 0))             # text before lo: searched already
    new = s.peek(run.tokens, n)
    cut = first_stop(s.stable[lo:] + new, stops)
    if cut >= 0:
        k = next(k for k in range(x.seen + 1, n + 1) if first_stop(s.stable[lo:] + s.peek(run.tokens, k), stops) >= 0)
        run.tokens[k:], run.stop_reason = [], "stop"
        head, tail, end = s.stable, new, lo + cut               # the text is head + tail; it ends at `end`
    else:
        s.update(run.tokens, new)
        head, tail = s.stable, s.pending
        end = len(head) + len(tail)
    x.seen = len(run.tokens)
    finish = None if run.stop_reason is None else ("length" if run.stop_reason in ("length", "context") else "stop")
    if finish is None:                                           # held back: only the end of the text may go
        last = head[max(0, len(head) - longest):] + tail
        end -= len(last) - len(held(last, stops))
    delta = (head[x.sent:] + tail[max(0, x.sent - len(head)):])[:end - x.sent] if end > x.sent else ""
    x.sent += len(delta)
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

    def fits(self, req, busy) -> bool:
        return True

    def begin(self, req: Request, busy) -> Live:
        """A place for req (checked); its cache is made by fill."""
        e = self.engine
        gen.check_args(req.mode, req.budget, req.max_tokens, req.temperature, e.drafter)
        width = gen.tree_width(req.mode, req.budget, e.drafter)
        return Live(req, stop_set(e, req), limit=min(e.max_context, len(req.ids) + req.max_tokens + width))

    def piece(self, x: Live) -> int:
        """The whole prompt: the host prefills it in one forward, as generate does."""
        return len(x.req.ids)

    def fill(self, x: Live, n) -> bool:
        e, req = self.engine, x.req
        drafter = e.drafter if req.mode != "ar" else None
        seq = gen.prefill(0, req.ids, e.target, drafter, e.target.ops, params(req), x.limit)
        x.run, x.filled = gen.Run(seq, len(req.ids)), len(req.ids)
        return True

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
    """`batch` slots of one DeviceRounds (its graph replayed every round), made for the mode and tree size of the
    request that found the batch empty: requests of that mode with any temperature, seed and a budget up to that
    size share the rounds. A prompt is prefilled in pieces ending at multiples of `chunk` tokens (the same pieces
    whatever else runs, so the output does not depend on the load)."""
    engine: object
    batch: int
    chunk: int = PREFILL_CHUNK
    dev: object = None
    free: list = field(default_factory=list)

    def width(self, req: Request) -> int:
        return gen.tree_width(req.mode, req.budget, self.engine.drafter)

    def fits(self, req, busy) -> bool:
        shape = self.dev.shape if self.dev is not None else None
        return not busy or shape is None or (req.mode == shape.mode and self.width(req) <= shape.budget)

    def begin(self, req: Request, busy) -> Live:
        """A slot for req (checked); rounds made for its shape when none run (or the batch is empty)."""
        from numbaengine.device_round import Shape
        e = self.engine
        gen.check_args(req.mode, req.budget, req.max_tokens, req.temperature, e.drafter)
        shape = Shape(self.batch, req.mode, self.width(req), e.max_context)
        if self.dev is None or (not busy and self.dev.shape != shape):
            self._build(shape)
        limit = min(e.max_context, len(req.ids) + req.max_tokens + self.width(req))   # generate's cache
        return Live(req, stop_set(e, req), self.free.pop(0), limit)

    def piece(self, x: Live) -> int:
        """Prompt tokens of x's next prefill piece: up to the next multiple of chunk."""
        return min(len(x.req.ids), (x.filled // self.chunk + 1) * self.chunk) - x.filled

    def fill(self, x: Live, n) -> bool:
        """Prefill the next n prompt tokens of x; True once the prompt is complete (its first token sampled)."""
        if self.dev is None:
            raise RuntimeError("the device rounds failed while this prompt was being prefilled")
        req, end = x.req, x.filled + n
        if end < len(req.ids):
            self.dev.prefill_part(x.slot, req.ids, x.filled, end)
            x.filled = end
            return False
        budget = self.width(req) if req.mode == "ddtree" else None
        bonus = self.dev.prefill(x.slot, req.ids, 0, float(req.temperature), int(req.seed), budget, x.filled)
        x.run, x.filled = gen.Run(Seq(0, None, None, len(req.ids), bonus), len(req.ids)), end
        return True

    def _build(self, shape):
        from numbaengine.device_round import DeviceRounds, Replicated
        e = self.engine
        self.dev = None
        e.rounds_cache.clear()                       # one resident set of round buffers
        self.dev = DeviceRounds(e.target, e.drafter, shape) if e.ranks is None else Replicated(e.ranks, shape)
        self.free = list(range(shape.batch))         # every slot starts parked

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
