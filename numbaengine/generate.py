"""Generation: prefill each prompt, then decoding rounds (DDTree, DFlash or autoregressive) until max_new_tokens,
a stop token, or a full context. Plain functions over the engine's pieces: target, drafter, tokenizer, ops.

Output rules: max_new_tokens is exact (a round that accepts more is cut); a stop token ends the output and is
included; tokens are never filtered by value (the drafter's mask id is a valid output token).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from numbaengine.budget import AUTO, AUTO_MISSING, Calibration, Picks, auto_round, reference_costs
from numbaengine.ddtree import MAX_BUDGET, MODES, Params, Seq, decode_round, sample
from numbaengine.phases import span
from numbaengine.tokenizer import IdTokenizer

PHASES = ("draft", "build", "verify", "walk", "commit")


@dataclass
class Result:
    tokens: list             # generated token ids, the stop token included when one ended generation
    text: str                # tokenizer.decode(tokens)
    stats: dict              # see `stats_of`


@dataclass
class Run:
    """One sequence's generation state beside its round state."""
    seq: Seq
    prompt_len: int
    tokens: list = field(default_factory=list)
    taus: list = field(default_factory=list)
    stop_reason: str | None = None     # "stop" | "length" | "context" once finished
    picks: Picks | None = None         # budget "auto": the sizes chosen for it


class Timer:
    """Wall time per phase, summed over rounds (and over the sequences of a batch)."""

    def __init__(self, phases=PHASES):
        self.seconds = dict.fromkeys(phases, 0.0)

    @contextmanager
    def __call__(self, phase):
        t0 = perf_counter()
        yield
        self.seconds[phase] += perf_counter() - t0


def generate(target, drafter, tokenizer, prompt, max_new_tokens, mode="ddtree", budget=16, temperature=0.0,
             seed=0, stop=None, ops=None, max_context=4096, on_round=None, cost_table=None) -> Result:
    """Decode one prompt (text, or a list of token ids); see generate_batch."""
    return generate_batch(target, drafter, tokenizer, [prompt], max_new_tokens, mode, budget, temperature, seed,
                          stop, ops, max_context, on_round, cost_table)[0]


def generate_batch(target, drafter, tokenizer, prompts, max_new_tokens, mode="ddtree", budget=16,
                   temperature=0.0, seed=0, stop=None, ops=None, max_context=4096, on_round=None,
                   cost_table=None) -> list:
    """Decode several prompts together, each with its own tree, caches and noise stream (its batch index).

    mode: ddtree (tree of `budget` drafted nodes), dflash (the drafter's argmax chain) or ar (no drafter).
    budget "auto" (ddtree): each round the size with the most expected tokens per second of `cost_table`
    (numbaengine/budget.py; None: the reference round timed on this CPU), shared over the batch by path
    probability; the output equals ar's for the same seed, as with any fixed budget.
    stop: token ids that end a sequence; None = the target config's eos ids, [] = none.
    max_context: rows of the target cache; the prompt plus at least one new token must fit.
    on_round(index, round_out | None, tokens): called after the prefill (None) and after every round.
    """
    ops = ops if ops is not None else target.ops
    tokenizer = tokenizer if tokenizer is not None else IdTokenizer()
    check_args(mode, budget, max_new_tokens, temperature, drafter, auto=True)
    ids = [prompt_ids(p, tokenizer, target.cfg.vocab_size, max_context) for p in prompts]
    stop = set(target.cfg.eos_ids if stop is None else (int(t) for t in stop))
    table = None
    if budget == AUTO and mode == "ddtree":
        table = cost_table if cost_table is not None else reference_costs(target, drafter, ops)
    p, cal = Params(mode, float(temperature), int(seed)), Calibration()
    width = max(table.sizes) if table is not None else tree_width(mode, budget, drafter)
    drafter = drafter if mode != "ar" else None
    report = on_round if on_round is not None else (lambda index, out, tokens: None)
    t0 = perf_counter()
    runs = []
    with span("prefill"):
        for i, prompt in enumerate(ids):     # cache rows: prompt + output + one round's tree (capped by the context)
            rows = min(max_context, len(prompt) + max_new_tokens + width)
            runs.append(Run(prefill(i, prompt, target, drafter, ops, p, rows), len(prompt),
                            picks=Picks() if table is not None else None))
            push(runs[-1], [runs[-1].seq.bonus], stop, max_new_tokens)
            report(i, None, list(runs[-1].tokens))
    prefill_s, t1, timer = perf_counter() - t0, perf_counter(), Timer()
    with span("decode"):
        while live := [r for r in runs if still_decoding(r)]:
            budgets = [min(width, r.seq.cache.max_len - r.seq.start - 1) for r in live]     # shrink near a full cache
            seqs = [r.seq for r in live]
            if table is None:
                outs = decode_round(seqs, budgets, target, drafter, ops, p, timer)
            else:
                choice, outs, cal = auto_round(seqs, budgets, target, drafter, ops, p, timer, table, cal)
                for i, r in enumerate(live):
                    r.picks.add(choice, i)
            for r, out in zip(live, outs):
                r.taus.append(out.tau)
                push(r, out.tokens, stop, max_new_tokens)
                report(r.seq.index, out, list(r.tokens))
    decode_s = perf_counter() - t1
    return [Result(r.tokens, tokenizer.decode(r.tokens), stats_of(r, p, budget, prefill_s, decode_s, timer, cal))
            for r in runs]


def check_args(mode, budget, max_new_tokens, temperature, drafter, auto=False):
    """One-line ValueErrors for arguments out of range. auto: budget "auto" is allowed (the reference loop);
    elsewhere it raises NotImplementedError naming what is missing."""
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {', '.join(MODES)}")
    if budget == AUTO and not auto:
        raise NotImplementedError(AUTO_MISSING)
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


def tree_width(mode, budget, drafter):
    """Drafted nodes per round: the budget (ddtree), the chain Lb-1 (dflash), none (ar)."""
    return {"ddtree": budget, "dflash": drafter.block_size - 1 if drafter is not None else 0, "ar": 0}[mode]


def prefill(index, ids, target, drafter, ops, p: Params, max_len) -> Seq:
    """Target over the prompt (MLA in ops.prefill_form); the drafter context gets the prompt features; bonus = sample
    at the last position."""
    tokens, positions = np.asarray(ids, np.int32), np.arange(len(ids), dtype=np.int32)
    cache = target.new_cache(max_len)
    layers = drafter.layer_ids if drafter is not None else ()
    logits, hidden = target.forward(tokens, positions, cache, None, hidden_layers=layers, form=ops.prefill_form)
    cache.commit(positions)
    ctx = None
    if drafter is not None:
        ctx = drafter.new_context(max_len)
        drafter.append(ctx, hidden, positions)
    bonus = sample(ops, logits[-1:], p.temperature, p.seed, index, positions[-1:])[0]
    return Seq(index, cache, ctx, len(ids), int(bonus))


def still_decoding(run: Run) -> bool:
    """Not finished, and a free cache row for the bonus token; a full context finishes the sequence."""
    if run.stop_reason is None and run.seq.start >= run.seq.cache.max_len:
        run.stop_reason = "context"
    return run.stop_reason is None


def push(run: Run, new, stop, max_new_tokens):
    """Append new tokens, ending the output at the first stop token (kept) or at exactly max_new_tokens."""
    for t in map(int, new):
        run.tokens.append(t)
        if t in stop:
            run.stop_reason = "stop"
            return
        if len(run.tokens) >= max_new_tokens:
            run.stop_reason = "length"
            return


def stats_of(run: Run, p: Params, budget, prefill_s, decode_s, timer: Timer, cal=None) -> dict:
    """Acceptance and timing of one sequence. Times (prefill, decode, phases) are of the whole batch. Budget "auto"
    adds budget_hist, nodes_mean, expected_tau, calibrated_tau and calibration (budget.Picks.stats)."""
    taus = run.taus
    hist = [0] * (max(taus, default=0) + 1)     # hist[tau] = rounds that committed tau tokens
    for t in taus:
        hist[t] += 1
    out = dict(mode=p.mode, budget=budget, temperature=p.temperature, seed=p.seed,
               prompt_tokens=run.prompt_len, new_tokens=len(run.tokens), stop_reason=run.stop_reason,
               rounds=len(taus), tau_mean=float(np.mean(taus)) if taus else 0.0, tau_hist=hist,
               prefill_s=prefill_s, decode_s=decode_s,
               tokens_per_s=(len(run.tokens) - 1) / decode_s if decode_s > 0 else 0.0,
               phase_s=dict(timer.seconds))
    return {**out, **run.picks.stats(cal)} if run.picks is not None else out
