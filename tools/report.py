"""Markdown tables from benchmark JSON, with the open goals they decide.

    python -m tools.report bench.json [--serve serve.json]

bench.json (tools.bench): tokens/s per batch (rows) and case (columns: ar, dflash, ddtree-B, auto), each against
AR, and where budget auto ran, auto against the best fixed case of its batch (AR included). Auto becomes the default
on cuda when that ratio is >= AUTO_FLOOR at every batch measured (issue 48).
serve.json (tools.bench_serve): served tokens/s per concurrency against the bench's tokens/s of the same mode and
budget at that batch, TTFT / TPOT p50 and p99 (issue 50: >= SERVE_SHARE of the bench at concurrency 32, TTFT p50 at
concurrency 1 <= TTFT_MS).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

AUTO_FLOOR = 0.97      # auto's tokens/s over the best fixed case's, at every batch, to become the default
SERVE_SHARE = 0.85     # served tokens/s over the bench's at concurrency 32
TTFT_MS = 30.0         # TTFT p50 at concurrency 1


def case_name(row) -> str:
    mode, budget = row["mode"], row["budget"]
    if mode == "ddtree":
        return "auto" if budget == "auto" else f"ddtree-{budget}"
    return mode


def throughput(result) -> dict:
    """{case: {batch: tokens/s}} of the prompt rows (rows of a fixed context, --contexts, are left out)."""
    out = {}
    for r in result["rows"]:
        if "context" not in r:
            out.setdefault(case_name(r), {})[r["batch"]] = r["tokens_per_s"]
    return out


def _order(name):
    return (0, 0) if name == "ar" else (1, 0) if name == "dflash" else (3, 0) if name == "auto" \
        else (2, int(name.split("-")[1]))


def auto_ratios(tps) -> dict:
    """{batch: auto tokens/s / the best fixed case's} for the batches where auto and a fixed case ran."""
    fixed = {k: v for k, v in tps.items() if k != "auto"}
    out = {}
    for batch, auto in sorted(tps.get("auto", {}).items()):
        best = max((v[batch] for v in fixed.values() if batch in v), default=None)
        if best:
            out[batch] = auto / best
    return out


def bench_table(result) -> str:
    tps = throughput(result)
    names = sorted(tps, key=_order)
    batches = sorted({b for v in tps.values() for b in v})
    ratios = auto_ratios(tps)
    head = ["batch"] + names + (["auto / best fixed"] if ratios else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in batches:
        ar = tps.get("ar", {}).get(b)
        cells = [str(b)]
        for n in names:
            v = tps[n].get(b)
            cells.append("-" if v is None else f"{v:,.0f}" + (f" ({v / ar:.2f}x)" if ar and n != "ar" else ""))
        if ratios:
            cells.append(f"{ratios[b]:.3f}" if b in ratios else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\n{result.get('gpu', '?')}, {result.get('model', '?')}, {result.get('date', '?')}; tokens/s "
                 "(x AR)")
    if ratios:
        ok = all(r >= AUTO_FLOOR for r in ratios.values())
        worst = min(ratios, key=ratios.get)
        lines.append(f"budget auto >= {AUTO_FLOOR} x the best fixed case at every batch: {'yes' if ok else 'no'} "
                     f"(lowest {ratios[worst]:.3f} at batch {worst})")
    return "\n".join(lines)


def serve_table(serve, result) -> str:
    """Served levels against the bench rows of the same case at batch = concurrency."""
    tps = throughput(result) if result is not None else {}
    budget = serve.get("budget")
    name = case_name(dict(mode=serve.get("mode", "ddtree"), budget=budget))
    lines = ["| concurrency | served tok/s | bench tok/s | share | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
             "|---|---|---|---|---|---|"]
    goals = []
    for lv in serve["levels"]:
        c, got = lv["concurrency"], lv["tokens_per_s"]
        bench = tps.get(name, {}).get(c)
        share = got / bench if bench else None
        ttft, tpot = lv["ttft_ms"], lv["tpot_ms"]
        lines.append(f"| {c} | {got:,.0f} | {'-' if bench is None else f'{bench:,.0f}'} | "
                     f"{'-' if share is None else f'{share:.2f}'} | {ttft.get('p50', float('nan')):.1f} / "
                     f"{ttft.get('p99', float('nan')):.1f} | {tpot.get('p50', float('nan')):.2f} / "
                     f"{tpot.get('p99', float('nan')):.2f} |")
        if c == 32 and share is not None:
            goals.append(f"served >= {SERVE_SHARE} x bench at concurrency 32: {'yes' if share >= SERVE_SHARE else 'no'}"
                         f" ({share:.2f})")
        if c == 1 and "p50" in ttft:
            goals.append(f"TTFT p50 at concurrency 1 <= {TTFT_MS:.0f} ms: {'yes' if ttft['p50'] <= TTFT_MS else 'no'}"
                         f" ({ttft['p50']:.1f} ms)")
    return "\n".join(lines + [""] + goals)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", help="tools.bench --out JSON")
    ap.add_argument("--serve", help="tools.bench_serve --out JSON (compared with the bench at the same batch)")
    args = ap.parse_args(argv)
    try:
        result = json.loads(Path(args.bench).read_text())
        serve = json.loads(Path(args.serve).read_text()) if args.serve else None
        print(bench_table(result))
        if serve is not None:
            print("\n" + serve_table(serve, result))
    except (OSError, ValueError, KeyError) as e:
        ap.exit(2, f"error: {e.__class__.__name__}: {e}\n")


if __name__ == "__main__":
    main()
