"""Generation: the one decoding loop. `decode` prefills sequences and runs rounds (DDTree, DFlash or
autoregressive) until each output is complete, through a rounds object (numbaengine/rounds.py: HostRounds, the
reference round on the host; DeviceSlots, the batched round on the device). Engine.generate / generate_batch on
every backend and the server's scheduler (numbaengine/scheduler.py) all decode through it.

Output rules (push): max_new_tokens is exact (a round that accepts more is cut); a stop token ends the output and is
included; a sequence ends when its cache rows are full; tokens are never filtered by value (the drafter's mask id is a
valid output token).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter

import numpy as np

from numbaengine.budget import AUTO, reference_costs
from numbaengine.ddtree import MAX_BUDGET, MODES, Params
from numbaengine.phases import span
from numbaengine.rounds import HostRounds, Run
from numbaengine.tokenizer import IdTokenizer


@dataclass
class Result:
    tokens: list             # generated token ids, the stop token included when one ended generation
    text: str                # tokenizer.decode(tokens)
    stats: dict              # see `stats_of`


class Timer:
    """Wall time per phase, summed over rounds (and over the sequences of a batch); phases may nest. `phases` start
    at 0 (others appear when first timed)."""

    def __init__(self, phases=HostRounds.PHASES):
        self.seconds = dict.fromkeys(phases, 0.0)

    def add(self, phase, seconds):
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @contextmanager
    def __call__(self, phase):
        t0 = perf_counter()
        yield
        self.add(phase, perf_counter() - t0)


# --- the loop ---------------------------------------------------------------------------------------------------------

def decode(rounds, runs, report, timer: Timer, admit=None, chunk=None, on_round=None):
    """Decode `runs` (each given its place by rounds.begin) to completion, and the runs admit() adds.

    Each pass: admit(waiting, live) returns the runs that join (begun; None ends the loop; it may block while there
    is nothing to do, and end runs by setting their stop_reason); the waiting runs are prefilled, oldest first, at
    most `chunk` prompt tokens a pass (None: all; at least one piece); then one round of every decoding run. New
    tokens go through push (the stop rules), then report(run, out): out is None after the prefill (the first token),
    the round's RoundOut, or the exception the run failed with. report may end a run (stop_reason) or raise to end
    the loop. Finished runs leave and give their places back (rounds.retire). timer: "prefill" and "decode" wall
    time, and the round's phases. on_round(outs, seconds): after each round."""
    waiting, live = list(runs), []
    while True:
        if admit is not None:
            new = admit(waiting, live)
            if new is None:
                return
            waiting, live = leave(rounds, waiting + new), leave(rounds, live)
        elif not waiting and not live:
            return
        if waiting:
            with span("prefill"), timer("prefill"):
                filled = prefill(rounds, waiting, chunk, report)
            waiting, live = leave(rounds, [r for r in waiting if r not in filled]), leave(rounds, live + filled)
        if live:
            t0 = perf_counter()
            with span("decode"), timer("decode"):
                outs = step(rounds, live, report, timer)
            live = leave(rounds, live)
            if on_round is not None:
                on_round(outs, perf_counter() - t0)


def prefill(rounds, waiting, chunk, report) -> list:
    """The next prompt pieces of the waiting runs, oldest first, up to chunk tokens in all (at least one piece).
    Returns the runs whose prompt is complete: their first token is pushed and reported."""
    used, filled = 0, []
    for run in waiting:
        n = rounds.piece(run)
        if chunk is not None and used and used + n > chunk:
            break
        used += n
        try:
            done = rounds.fill(run, n)
        except Exception as e:          # noqa: BLE001 - one sequence's fault ends only that sequence
            run.stop_reason = "error"
            report(run, e)
            continue
        if done:
            filled.append(run)
            push(run, [run.seq.bonus])
            report(run, None)
    return filled


def step(rounds, live, report, timer) -> dict:
    """One round of every live run: its tokens pushed and reported. Returns id(run) -> RoundOut | exception (a run
    may have none: it joined after the round, launched ahead, that the rounds read now; DeviceSlots.overlap)."""
    try:
        outs = rounds.step(live, timer)
    except Exception as e:              # noqa: BLE001 - a shared round failed: every sequence in it fails
        outs = {id(r): e for r in live}
    for r in live:
        out = outs.get(id(r))
        if out is None:
            continue
        if isinstance(out, Exception):
            r.stop_reason = "error"
        else:
            r.taus.append(out.tau)
            push(r, out.tokens)
        report(r, out)
    return outs


def leave(rounds, runs) -> list:
    """The runs still going; the finished ones give their places back."""
    done = [r for r in runs if r.stop_reason is not None]
    if done:
        rounds.retire(done)
    return [r for r in runs if r.stop_reason is None]


def push(run: Run, new):
    """Append new tokens, ending the output at the first stop token (kept) or at exactly max_new tokens; then a
    sequence whose cache rows are full (no row for the next bonus) ends too."""
    if new and type(new[0]) is not int:        # numpy ints (host rounds); a device round's are Python ints
        new = [int(t) for t in new]
    if len(run.tokens) + len(new) < run.max_new and run.stop.isdisjoint(new):    # most rounds: all of it
        run.tokens += new
        new = ()
    for t in new:
        run.tokens.append(t)
        if t in run.stop:
            run.stop_reason = "stop"
            return
        if len(run.tokens) >= run.max_new:
            run.stop_reason = "length"
            return
    if run.stop_reason is None and run.seq.start >= run.limit:
        run.stop_reason = "context"


# --- a batch of prompts -----------------------------------------------------------------------------------------------

def generate_on(rounds, tokenizer, prompts, max_new_tokens, mode="ddtree", budget=16, temperature=0.0, seed=0,
                stop=None, on_round=None, drain=True) -> list:
    """Decode several prompts together through `rounds` (a HostRounds or DeviceSlots), each with its own cache,
    tree and noise stream (its batch index).

    mode: ddtree (tree of `budget` drafted nodes), dflash (the drafter's argmax chain) or ar (no drafter).
    budget "auto" (ddtree): each round the size with the soonest expected end of the batch (drain: these prompts
    are all of it, budget.pick), else the most expected tokens per second, by the rounds' cost table; the output
    equals ar's for the same seed.
    stop: token ids that end a sequence; None = the target config's eos ids, [] = none.
    on_round(index, round_out | None, tokens): called after the prefill (None) and after every round."""
    cfg, tokenizer = rounds.target.cfg, tokenizer if tokenizer is not None else IdTokenizer()
    check_args(mode, budget, max_new_tokens, temperature, rounds.drafter)
    ids = [prompt_ids(p, tokenizer, cfg.vocab_size, rounds.max_context) for p in prompts]
    stop = set(cfg.eos_ids if stop is None else (int(t) for t in stop))
    p = Params(mode, float(temperature), int(seed))
    runs = []
    for i, prompt in enumerate(ids):
        runs.append(Run(prompt, max_new_tokens, stop, p, budget, index=i))
        rounds.begin(runs[-1], runs[:-1])

    def report(run, out):
        if isinstance(out, Exception):
            raise out
        if on_round is not None:
            on_round(run.index, out, list(run.tokens))
    timer = Timer(("prefill", "decode") + rounds.PHASES)
    was, rounds.drain = rounds.drain, drain
    try:
        decode(rounds, runs, report, timer)
    finally:
        rounds.drain = was
    return [Result(r.tokens, tokenizer.decode(r.tokens), stats_of(r, timer, rounds.PHASES)) for r in runs]


def generate(target, drafter, tokenizer, prompt, max_new_tokens, mode="ddtree", budget=16, temperature=0.0,
             seed=0, stop=None, ops=None, max_context=4096, on_round=None, cost_table=None) -> Result:
    """Decode one prompt (text, or a list of token ids) on the host; see generate_batch."""
    return generate_batch(target, drafter, tokenizer, [prompt], max_new_tokens, mode, budget, temperature, seed,
                          stop, ops, max_context, on_round, cost_table)[0]


def generate_batch(target, drafter, tokenizer, prompts, max_new_tokens, mode="ddtree", budget=16,
                   temperature=0.0, seed=0, stop=None, ops=None, max_context=4096, on_round=None,
                   cost_table=None) -> list:
    """generate_on over the reference round on the host (HostRounds) of these model pieces. max_context: rows of the
    target cache; the prompt plus at least one new token must fit. budget "auto": cost_table, or None: the reference
    round timed on this CPU (budget.reference_costs)."""
    ops = ops if ops is not None else target.ops
    table = None
    if budget == AUTO and mode == "ddtree" and drafter is not None:
        table = cost_table if cost_table is not None else reference_costs(target, drafter, ops)
    return generate_on(HostRounds(target, drafter, max_context, ops, table), tokenizer, prompts, max_new_tokens,
                       mode, budget, temperature, seed, stop, on_round)


# --- arguments and stats ----------------------------------------------------------------------------------------------

def check_args(mode, budget, max_new_tokens, temperature, drafter):
    """One-line ValueErrors for arguments out of range."""
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {', '.join(MODES)}")
    if budget != AUTO and (not isinstance(budget, (int, np.integer)) or not 0 <= budget <= MAX_BUDGET):
        raise ValueError(f"budget: {budget!r} is not an integer in 0..{MAX_BUDGET} (drafted tree nodes per round) "
                         "or 'auto'")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature: must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if mode != "ar" and drafter is None:
        raise ValueError(f"mode {mode!r} needs a draft model (none is loaded); use mode 'ar' without one")


def prompt_ids(prompt, tokenizer, vocab, max_context):
    """Token ids of a prompt given as text or as ids, checked against the vocabulary and the context."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise ValueError("prompt: empty (no tokens)")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if len(ids) >= max_context:
        raise ValueError(f"prompt: {len(ids)} tokens do not fit the context of {max_context} tokens "
                         "(it must leave room for at least one new token)")
    return ids


def stats_of(run: Run, timer: Timer, phases) -> dict:
    """Acceptance and timing of one sequence. Times (prefill, decode, phases) are of the whole batch. Budget "auto"
    adds budget_hist, nodes_mean, expected_tau, calibrated_tau and calibration (budget.Picks.stats)."""
    taus, s = run.taus, timer.seconds
    hist = [0] * (max(taus, default=0) + 1)     # hist[tau] = rounds that committed tau tokens
    for t in taus:
        hist[t] += 1
    decode_s = s["decode"]
    out = dict(mode=run.p.mode, budget=run.budget if run.p.mode == "ddtree" else None,     # (unused by ar, dflash)
               temperature=run.p.temperature, seed=run.p.seed,
               prompt_tokens=len(run.ids), new_tokens=len(run.tokens), stop_reason=run.stop_reason,
               rounds=len(taus), tau_mean=float(np.mean(taus)) if taus else 0.0, tau_hist=hist,
               prefill_s=s["prefill"], decode_s=decode_s,
               tokens_per_s=(len(run.tokens) - 1) / decode_s if decode_s > 0 else 0.0,
               phase_s={k: s[k] for k in phases})
    return {**out, **run.picks.stats()} if run.picks is not None else out
