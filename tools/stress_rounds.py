"""Hunt for nondeterminism in the cuda engine: test_device_round's greedy CASES over and over in random orders
(new shapes, new DeviceRounds and graphs each time), every output checked against the numpy reference like the
test does (equal, or different only after a near-tie). Options perturb what could hide a race:

  --delay     a random host pause (up to 3 ms) before 10% of the kernel launches: a missing stream dependency
              (ops.branch(), uploads) then shows in the eager rounds and prompt forwards
  --eager     no CUDA graphs: every round launched eagerly
  --no-pool   CuPy's memory pool off (each array its own cudaMalloc): run under compute-sanitizer, memcheck then
              sees exact array bounds and initcheck every read of never-written memory

  python -m tools.stress_rounds --seconds 300 --seed 1 --delay --out stress.json
  compute-sanitizer --tool initcheck python -m tools.stress_rounds --no-pool --once
Exit status 1 when any output failed the check (the JSON lists every run: case, seconds, failures)."""
import argparse
import json
import random
import sys
import time
from pathlib import Path

from tools.gpu import require_gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def perturb_launches(seed):
    """kernels.launch.launch asks current_stream() for every launch: pause there now and then."""
    import numbaengine.kernels.launch as launch
    real, rng = launch.current_stream, random.Random(seed)

    def slow():
        if rng.random() < 0.1:
            time.sleep(rng.random() * 3e-3)
        return real()
    launch.current_stream = slow


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120, help="keep going this long (whole passes over the cases)")
    ap.add_argument("--once", action="store_true", help="one pass over the cases, then stop")
    ap.add_argument("--seed", type=int, default=0, help="case order and launch pauses")
    ap.add_argument("--delay", action="store_true")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--no-pool", action="store_true")
    ap.add_argument("--out", default=None, help="JSON log of every run")
    a = ap.parse_args(argv)
    require_gpu("python -m tools.stress_rounds")
    if a.no_pool:
        import cupy
        cupy.cuda.set_allocator(None)
    if a.delay:
        perturb_launches(a.seed + 1)
    from test_device_round import CASES, PROMPTS, assert_reference_tokens, engines
    ref, dev = engines()
    rng, want, log = random.Random(a.seed), {}, []
    until = time.time() + a.seconds
    while not log or (not a.once and time.time() < until):
        for case in rng.sample(CASES, len(CASES)):
            mode, budget, batch = case
            prompts = (PROMPTS * 3)[:batch]
            t = time.time()
            got = [r.tokens for r in dev.generate_batch(prompts, 24, mode=mode, budget=budget, stop=[],
                                                        graphs=not a.eager)]
            if case not in want:
                want[case] = [r.tokens for r in ref.generate_batch(prompts, 24, mode=mode, budget=budget, stop=[])]
            bad = []
            for p, g, w in zip(prompts, got, want[case]):
                try:
                    if g != w:
                        assert_reference_tokens(ref, p, g, w, str(case))
                except AssertionError as e:
                    bad.append({"prompt": p, "error": str(e), "got": g, "reference": w})
                    print("FAIL", case, e, flush=True)
            log.append({"case": case, "s": round(time.time() - t, 3), "bad": bad})
        if a.out:
            Path(a.out).write_text(json.dumps(log))
    fails = sum(bool(r["bad"]) for r in log)
    print(f"{len(log)} runs ({len(log) // len(CASES)} passes over {len(CASES)} cases), {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
