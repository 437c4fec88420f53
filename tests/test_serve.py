"""The OpenAI-compatible server (numbaengine/serve.py) in a subprocess on the numpy backend with the shipped pair,
driven with the official openai client: every finished response equals Engine.generate for its prompt and
settings (computed here), whatever else the continuous batch is running; errors are OpenAI error bodies."""
from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="a dev extra: pip install -e '.[dev]'")
openai = pytest.importorskip("openai", reason="a dev extra (the official client): pip install -e '.[dev]'")
pytest.importorskip("fastapi", reason="the serve extra: pip install -e '.[serve]' (or '.[dev]')")

from numbaengine.budget import LADDER, CostTable
from numbaengine.weights import SHIPPED_PAIR

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
CONTEXT = 512
FAIL = "raise in the engine"
PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def push(self, item):",
           "    for i in range(len(items)):\n        if", "def fibonacci(n):\n    if n < 2:"]


@functools.cache
def engine():
    from numbaengine import Engine
    return Engine.load(SHIPPED_PAIR / "target", SHIPPED_PAIR / "draft", backend="numpy", max_context=CONTEXT)


@functools.cache
def offline(prompt, max_tokens, mode="ddtree", budget=16, temperature=0.0, seed=0, stop_ids=None, stops=()):
    """(text, completion tokens, finish reason) of Engine.generate, cut before the first stop string."""
    e = engine()
    r = e.generate(prompt, max_tokens, mode, budget, temperature, seed, list(stop_ids) if stop_ids else None)
    found = [i for i in (r.text.find(s) for s in stops) if i >= 0]
    if not found:
        return r.text, len(r.tokens), "length" if r.stats["stop_reason"] == "length" else "stop"
    k = next(k for k in range(1, len(r.tokens) + 1) if any(s in e.tokenizer.decode(r.tokens[:k]) for s in stops))
    return r.text[:min(found)], k, "stop"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(*args, start_s=60):
    """`python -m numbaengine.serve ARGS` on a free port; yields (base url, process) once /health answers."""
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "numbaengine.serve", "--backend", "numpy", "--port", str(port),
                             "--max-context", str(CONTEXT), *map(str, args)], cwd=ROOT, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + start_s
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.seek(0)
                pytest.fail(f"the server did not start:\n{log.read().decode()[-3000:]}")
            time.sleep(0.1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def client(url, cls=openai.OpenAI):
    return cls(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat_model():
    """The shipped target in a folder of its own, with a chat template (tokenizer_config.json)."""
    with tempfile.TemporaryDirectory() as d:
        shutil.copytree(SHIPPED_PAIR / "target", Path(d) / "target")
        shutil.copy(FIXTURES / "chat_tokenizer_config.json", Path(d) / "target" / "tokenizer_config.json")
        yield Path(d) / "target"


@pytest.fixture(scope="module")
def main(chat_model, tmp_path_factory):
    """The chat model with the shipped drafter; budget auto picks 16 nodes every round (--cost-table), so its
    metrics do not depend on this CPU's timings."""
    table = tmp_path_factory.mktemp("costs") / "table.json"
    CostTable(LADDER, {8: tuple(1.0 if s == 16 else 9.0 for s in LADDER)}).save(table)
    with server("--model", chat_model, "--draft", SHIPPED_PAIR / "draft", "--max-batch", 8,
                "--fail-prompt", FAIL, "--cost-table", table) as (url, _):
        yield url


def test_bad_cost_table_is_one_line(tmp_path, capsys):
    from numbaengine.serve import main as serve_main
    bad = tmp_path / "t.json"
    bad.write_text('{"sizes": [0, 2], "seconds": {"1": [1.0]}}')
    for path in (bad, tmp_path / "missing.json"):
        assert serve_main(["--cost-table", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --cost-table:") and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def small():
    """The shipped pair (no chat template), one sequence at a time and one waiting."""
    with server("--max-batch", 1, "--max-queue", 1, "--max-context", 4096) as (url, _):
        yield url


def health(url):
    return httpx.get(url + "/health").json()


def scrape(url) -> dict:
    """/metrics as {'name{labels}': value}."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}


# --- outputs -----------------------------------------------------------------------------------------------------------

SETTINGS = [("ddtree", 16, 0.0, 0), ("ddtree", 8, 0.8, 3), ("dflash", 0, 0.0, 0), ("ar", 0, 1.0, 7)]


@pytest.mark.parametrize("mode, budget, temperature, seed", SETTINGS)
def test_completion_equals_generate(main, mode, budget, temperature, seed):
    r = client(main).completions.create(model="m", prompt=PROMPTS[0], max_tokens=16, temperature=temperature,
                                        seed=seed, extra_body={"speculative": {"mode": mode, "budget": budget}})
    text, n, finish = offline(PROMPTS[0], 16, mode, budget, temperature, seed)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, finish)
    assert r.usage.prompt_tokens == len(engine().tokenizer.encode(PROMPTS[0]))
    assert r.object == "text_completion" and r.model == "target"


def test_token_id_prompt(main):
    ids = engine().tokenizer.encode(PROMPTS[1])
    r = client(main).completions.create(model="m", prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == offline(PROMPTS[1], 12)[0]


def test_two_concurrent_requests(main):
    """Different prompts and seeds decoded side by side each get Engine.generate's output (noise keyed by
    sequence index 0 and the request's own seed)."""
    cases = [(PROMPTS[2], 16, "ddtree", 16, 0.9, 11), (PROMPTS[3], 16, "ddtree", 16, 0.9, 12)]
    got = {}

    def ask(i, prompt, n, mode, budget, t, seed):
        got[i] = client(main).completions.create(model="m", prompt=prompt, max_tokens=n, temperature=t, seed=seed)

    threads = [threading.Thread(target=ask, args=(i, *c)) for i, c in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, c in enumerate(cases):
        assert got[i].choices[0].text == offline(*c)[0]


def test_chat_template(main):
    messages = [{"role": "system", "content": "complete the code"}, {"role": "user", "content": "def add(a, b):"}]
    r = client(main).chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
    prompt = "# system:\ncomplete the code\n# user:\ndef add(a, b):\n# assistant:\n"
    text, n, finish = offline(prompt, 16)
    assert (r.choices[0].message.content, r.choices[0].message.role, r.choices[0].finish_reason) == \
           (text, "assistant", finish)
    assert r.usage.prompt_tokens == len(engine().tokenizer.encode(prompt)) and r.usage.completion_tokens == n


def test_stream_chunks_join(main):
    chunks = list(client(main).completions.create(model="m", prompt=PROMPTS[4], max_tokens=16, temperature=0.5,
                                                  seed=2, stream=True, stream_options={"include_usage": True}))
    text, n, finish = offline(PROMPTS[4], 16, temperature=0.5, seed=2)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == text and len(pieces) > 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].usage.completion_tokens == n and not chunks[-1].choices


def test_chat_stream(main):
    stream = client(main).chat.completions.create(model="m", messages=[{"role": "user", "content": "import os"}],
                                                  max_tokens=16, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == offline("# user:\nimport os\n# assistant:\n", 16)[0]


def test_stop_strings(main):
    full = offline(PROMPTS[0], 16)[0]
    stop = full.split()[2]                           # a word in the middle of the greedy output
    want = offline(PROMPTS[0], 16, stops=(stop,))
    c = client(main)
    r = c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop, "@@@"])
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == want
    assert len(want[0]) < len(full)
    stream = c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=stop, stream=True)
    assert "".join(x.choices[0].text for x in stream) == want[0]


def test_stop_token_ids(main):
    tokens = engine().generate(PROMPTS[1], 16, temperature=0).tokens
    r = client(main).completions.create(model="m", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                        extra_body={"stop_token_ids": [tokens[5]]})
    text, n, _ = offline(PROMPTS[1], 16, stop_ids=(tokens[5],))
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, "stop")
    assert n == tokens.index(tokens[5]) + 1


# --- budget auto ---------------------------------------------------------------------------------------------------

AUTO = {"speculative": {"budget": "auto"}}


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.8, 5)])
def test_auto_budget_equals_fixed(main, temperature, seed):
    """Any tree gives the autoregressive tokens for the same seed: budget auto's output is budget 16's."""
    r = client(main).completions.create(model="m", prompt=PROMPTS[2], max_tokens=24, temperature=temperature,
                                        seed=seed, extra_body=AUTO)
    want = offline(PROMPTS[2], 24, "ddtree", 16, temperature, seed)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == want


def test_auto_metrics(main):
    """One auto request alone: /metrics counts each of its rounds once under the size chosen (every ladder size
    listed), its accepted drafts are its taus less one each, and its expected drafts are counted."""
    before = scrape(main)
    r = client(main).completions.create(model="m", prompt=PROMPTS[1], max_tokens=32, temperature=0, extra_body=AUTO)
    after = scrape(main)
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)          # noqa: E731
    sizes = {f'numbaengine_auto_size_rounds_total{{size="{s}"}}' for s in LADDER}
    assert sizes <= set(after)
    rounds = delta("numbaengine_round_seconds_count")
    assert 0 < rounds <= r.usage.completion_tokens - 1          # every round commits a token at least
    assert sum(map(delta, sizes)) == rounds == delta("numbaengine_tau_count")
    assert delta("numbaengine_auto_accepted_drafts_total") == delta("numbaengine_tau_sum") - rounds
    assert delta("numbaengine_auto_expected_drafts_total") > 0 and delta("numbaengine_auto_calibrated_drafts_total") > 0


def test_auto_and_fixed_side_by_side(main):
    """Auto requests of other temperatures and seeds and a fixed-budget one at once each get budget 16's output (on
    numpy an auto batch samples with one setting: the scheduler keeps the others out of it)."""
    cases = [(PROMPTS[2], 16, 0.9, 11, "auto"), (PROMPTS[3], 16, 0.0, 0, "auto"), (PROMPTS[4], 16, 0.5, 2, 8)]
    got = {}

    def ask(i, prompt, n, t, seed, budget):
        got[i] = client(main).completions.create(model="m", prompt=prompt, max_tokens=n, temperature=t, seed=seed,
                                                 extra_body={"speculative": {"budget": budget}})

    threads = [threading.Thread(target=ask, args=(i, *c)) for i, c in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (prompt, n, t, seed, _) in enumerate(cases):
        assert got[i].choices[0].text == offline(prompt, n, "ddtree", 16, t, seed)[0], i


def test_auto_round_stats_are_the_picks():
    """In process: the metrics of one auto request's rounds are its run's Picks, entry by entry."""
    from numbaengine.scheduler import Request, Scheduler
    from numbaengine.serve_metrics import Metrics
    e, metrics, done = engine(), Metrics(2, nvml=False), threading.Event()
    sched = Scheduler(e, max_batch=2, on_round=metrics.round)
    begun, begin = [], sched.rounds.begin
    sched.rounds.begin = lambda run, busy: (begin(run, busy), begun.append(run))      # keep the run (its Picks)
    sched.start()
    sched.submit(Request(e.tokenizer.encode(PROMPTS[4]), 24, budget="auto", temperature=0.7, seed=4,
                         emit=lambda u: u.finish_reason and done.set()))
    assert done.wait(60)
    sched.close(10)
    (run,) = begun
    picks = run.picks
    assert sched.rounds.picks == []                                      # retired: the rounds keep no Picks
    value = metrics.registry.get_sample_value
    assert {s: value("numbaengine_auto_size_rounds_total", {"size": str(s)}) for s in LADDER} == \
           {s: picks.sizes.count(s) for s in LADDER}
    assert value("numbaengine_round_seconds_count") == len(picks.sizes) > 0
    assert value("numbaengine_auto_expected_drafts_total") == pytest.approx(sum(picks.expected))
    assert value("numbaengine_auto_calibrated_drafts_total") == pytest.approx(sum(picks.calibrated))
    assert value("numbaengine_auto_accepted_drafts_total") == value("numbaengine_tau_sum") - len(picks.sizes)


def test_queue_limit_holds_a_batch():
    """--max-queue by default queues twice --max-batch (at least 64); given, it is kept."""
    from numbaengine.serve import parser, queue_limit
    given = ([], ["--max-batch", "128"], ["--max-batch", "128", "--max-queue", "5"])
    assert [queue_limit(parser().parse_args(a)) for a in given] == [64, 256, 5]


def test_budget_flags():
    """`--budget auto` parses for the server and tools/bench_serve, which sends the budget given (none: the
    server's); a bad one is a usage error."""
    from numbaengine.serve import parser
    from tools import bench_serve
    assert parser().parse_args(["--budget", "auto"]).budget == "auto" and parser().parse_args([]).budget == 16
    bench = bench_serve.parser()
    assert bench_serve.extension(bench.parse_args(["--budget", "auto"])) == AUTO
    assert bench_serve.extension(bench.parse_args(["--mode", "ddtree", "--budget", "8"])) == \
           {"speculative": {"mode": "ddtree", "budget": 8}}
    assert bench_serve.extension(bench.parse_args([])) == {}
    for ap, bad in [(parser(), "many"), (parser(), "-1"), (bench, "many")]:
        with pytest.raises(SystemExit):
            ap.parse_args(["--budget", bad])


# --- bad input and faults ---------------------------------------------------------------------------------------------

BAD = [  # (path, body, param)
    ("completions", '{"prompt": "x", ', None),
    ("completions", "[1, 2]", None),
    ("completions", {}, "prompt"),
    ("completions", {"prompt": "x", "max_tokens": "16"}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "seed": -3}, "seed"),
    ("completions", {"prompt": "x", "n": 2}, "n"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "x", "stop": ["a", 3]}, "stop"),
    ("completions", {"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    ("completions", {"prompt": "x", "speculative": {"mode": "beam"}}, "speculative.mode"),
    ("completions", {"prompt": "x", "speculative": {"budget": 5000}}, "speculative.budget"),
    ("completions", {"prompt": "x", "speculative": {"budget": "many"}}, "speculative.budget"),
    ("completions", {"prompt": "x", "speculative": {"budget": -1}}, "speculative.budget"),
    ("completions", {"prompt": "x", "speculative": {"width": 3}}, "speculative.width"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": [99999]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": "x", "top_p": 0.5}, "top_p"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
]


@pytest.mark.parametrize("path, body, param", BAD)
def test_bad_request_names_the_field(main, path, body, param):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{main}/v1/{path}", headers={"Content-Type": "application/json"}, timeout=30, **kw)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error" and set(err) >= {"message", "code"}
    assert err["param"] == param, err


def test_bad_request_through_the_client(main):
    with pytest.raises(openai.BadRequestError) as e:
        client(main).completions.create(model="m", prompt="x", max_tokens=4, n=3)
    assert e.value.param == "n" and "n:" in e.value.message


def test_prompt_too_long(main):
    with pytest.raises(openai.BadRequestError) as e:
        client(main).completions.create(model="m", prompt=[5] * CONTEXT, max_tokens=4)
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")


def test_chat_without_template(small):
    with pytest.raises(openai.BadRequestError) as e:
        client(small).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    assert (e.value.param, e.value.code) == ("messages", "no_chat_template")


def test_queue_full_then_disconnect_frees_the_slot(small):
    """One slot, one queue place: a long stream holds the slot (slow rounds: 256-node trees), a second request
    waits, a third gets 429. Closing the stream frees the slot for the waiting request."""
    body = {"prompt": "import os", "max_tokens": 3000, "stream": True, "temperature": 0,
            "speculative": {"mode": "ddtree", "budget": 256}, "stop_token_ids": []}
    waiting = {}
    with httpx.stream("POST", small + "/v1/completions", json=body, timeout=60) as long:
        next(long.iter_lines())
        asker = threading.Thread(target=lambda: waiting.update(r=client(small).completions.create(
            model="m", prompt=PROMPTS[0], max_tokens=8, temperature=0)))
        asker.start()
        deadline = time.time() + 10
        while health(small)["queued"] < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert health(small)["active"] == 1
        with pytest.raises(openai.RateLimitError) as e:
            client(small).completions.create(model="m", prompt="x", max_tokens=4)
        assert e.value.response.headers["retry-after"] and e.value.code == "rate_limit_exceeded"
    t0 = time.time()
    asker.join(30)
    assert time.time() - t0 < 10 and waiting["r"].choices[0].text == offline(PROMPTS[0], 8)[0]
    assert health(small)["active"] == 0


def test_engine_error_fails_only_its_request(main):
    c, got = client(main), {}
    ok = threading.Thread(target=lambda: got.update(ok=c.completions.create(
        model="m", prompt=PROMPTS[3], max_tokens=16, temperature=0)))
    ok.start()
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model="m", prompt=FAIL, max_tokens=16, temperature=0)
    assert e.value.type == "server_error" and "injected fault" in e.value.message
    with pytest.raises(openai.APIError):                 # mid-stream: an error event
        list(c.completions.create(model="m", prompt=FAIL, max_tokens=16, temperature=0, stream=True))
    ok.join()
    assert got["ok"].choices[0].text == offline(PROMPTS[3], 16)[0]
    after = c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert after.choices[0].text == offline(PROMPTS[0], 8)[0]


def test_load(main):
    """40 streamed requests, 8 at a time, greedy and sampled over several modes, every tenth closed after its
    second chunk: each finished stream equals Engine.generate, each closed one is a prefix of it (no token lost
    or repeated), and the batch is empty afterwards."""
    modes = [("ddtree", 16), ("ddtree", 4), ("dflash", 0), ("ar", 0)]
    cases = [(PROMPTS[i % 5], 16, *modes[i % 4], 0.0 if i % 2 else 0.9, i % 3) for i in range(40)]

    async def one(c, gate, i, case):
        prompt, n, mode, budget, t, seed = case
        async with gate:
            stream = await c.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=t, seed=seed,
                                                stream=True, extra_body={"speculative": {"mode": mode,
                                                                                         "budget": budget}})
            pieces = []
            async with stream:
                async for chunk in stream:
                    pieces.append(chunk.choices[0].text)
                    if i % 10 == 9 and len(pieces) == 2:
                        break
            return "".join(pieces), chunk.choices[0].finish_reason

    async def run():
        c, gate = client(main, openai.AsyncOpenAI), asyncio.Semaphore(8)
        return await asyncio.gather(*(one(c, gate, i, case) for i, case in enumerate(cases)))

    results = asyncio.run(run())
    for i, (case, (text, finish)) in enumerate(zip(cases, results)):
        want, _, want_finish = offline(*case)
        if i % 10 == 9 and finish is None:
            assert want.startswith(text), (i, case)
        else:
            assert (text, finish) == (want, want_finish), (i, case)
    deadline = time.time() + 5
    while health(main)["active"] and time.time() < deadline:
        time.sleep(0.05)
    assert health(main)["active"] == 0 and health(main)["queued"] == 0


def test_models_health_metrics(main):
    assert [m.id for m in client(main).models.list()] == ["target"]
    assert health(main)["backend"] == "numpy"
    client(main).completions.create(model="m", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    text = httpx.get(main + "/metrics").text
    for name in ('numbaengine_requests_total{path="/v1/completions",status="200"}', "numbaengine_tau_bucket",
                 "numbaengine_round_seconds_count", "numbaengine_batch_occupancy", "numbaengine_queue_depth",
                 "numbaengine_generation_tokens_total", 'status="400"'):
        assert name in text
    assert "numbaengine_gpu_" not in text                # no NVML on a CPU machine: absent, not zero
    seconds = {p: metric(text, f'numbaengine_phase_seconds_total{{phase="{p}"}}')
               for p in ("load", "compile", "capture", "prefill", "decode")}
    assert seconds["load"] > 0 and seconds["prefill"] > 0 and seconds["decode"] > 0, seconds
    assert seconds["compile"] == seconds["capture"] == 0, seconds          # numpy: nothing compiled or captured
    assert metric(text, 'numbaengine_kernels_total{how="compiled"}') == 0


@pytest.mark.gpu
def test_gpu_server_warms_up_every_bucket():
    """cuda: the server compiles its kernels and captures every bucket's graph before it answers /health, so requests
    at every concurrency up to --max-batch compile and capture nothing (/metrics' phase seconds stay flat), and
    their outputs equal ar's, each prompt alone (greedy)."""
    def complete(url, prompt, mode="ddtree"):
        return client(url).completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0,
                                              extra_body={"speculative": {"mode": mode}}).choices[0].text
    with server("--backend", "cuda", "--max-batch", 4, start_s=300) as (url, _):
        before = httpx.get(url + "/metrics").text
        assert metric(before, 'numbaengine_phase_seconds_total{phase="capture"}') > 0   # captured at startup
        want = [complete(url, p, "ar") for p in PROMPTS[:4]]
        for n in (1, 2, 3, 4):
            with ThreadPoolExecutor(n) as pool:
                got = list(pool.map(lambda p: complete(url, p), PROMPTS[:n]))
            assert got == want[:n], n
        after = httpx.get(url + "/metrics").text
    for name in ('numbaengine_phase_seconds_total{phase="compile"}', 'numbaengine_phase_seconds_total{phase="capture"}',
                 'numbaengine_kernels_total{how="compiled"}'):
        assert metric(after, name) == metric(before, name), name


def metric(text, name) -> float:
    """The value of one sample line of a Prometheus text page."""
    line = next((x for x in text.splitlines() if x.startswith(name + " ")), None)
    assert line is not None, f"{name} missing from /metrics"
    return float(line.split()[-1])


def test_sigterm_drains_in_flight_requests():
    with server("--max-batch", 2) as (url, proc):
        got = {}

        def plain():
            got["plain"] = client(url).completions.create(model="m", prompt=PROMPTS[1], max_tokens=48, temperature=0)

        def streamed():
            got["stream"] = "".join(c.choices[0].text for c in client(url).completions.create(
                model="m", prompt=PROMPTS[2], max_tokens=48, temperature=0, stream=True))

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while health(url)["active"] < 2 and time.time() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert proc.wait(30) == 0
    assert got["plain"].choices[0].text == offline(PROMPTS[1], 48)[0]
    assert got["stream"] == offline(PROMPTS[2], 48)[0]


# --- the scheduler's prefill between rounds (a fake backend: no model) ------------------------------------------------

class PieceRounds:
    """A backend that prefills prompts in pieces of `chunk` tokens and commits one token (5) per sequence a round;
    log: ("fill", first prompt id, tokens) and ("round", sequences) in order."""
    PHASES = ()

    def __init__(self, chunk):
        self.chunk, self.log = chunk, []

    def fits(self, run, busy):
        return True

    def begin(self, run, busy):
        run.limit = 10 ** 6

    def piece(self, run):
        return min(len(run.ids), (run.filled // self.chunk + 1) * self.chunk) - run.filled

    def fill(self, run, n):
        from numbaengine.ddtree import Seq
        run.filled += n
        self.log.append(("fill", run.ids[0], n))
        if run.filled < len(run.ids):
            return False
        run.seq = Seq(0, None, None, len(run.ids), 7)
        return True

    def step(self, runs, timer):
        from numbaengine.ddtree import RoundOut
        self.log.append(("round", len(runs)))
        return {id(r): RoundOut(None, None, [5], 1) for r in runs}

    def retire(self, runs):
        pass


def run_pieces(prompts, max_tokens, chunk, cap):
    """Requests with these prompts (submitted together) on PieceRounds -> (its log, texts)."""
    import contextlib
    import types

    from numbaengine.scheduler import Request, Scheduler
    from numbaengine.tokenizer import IdTokenizer
    engine = types.SimpleNamespace(backend="numpy", tokenizer=IdTokenizer(), blas_threads=contextlib.nullcontext,
                                   cfg=types.SimpleNamespace(eos_ids=[]), drafter=object())
    sched = Scheduler(engine, max_batch=4, prefill_chunk=cap, rounds=PieceRounds(chunk))
    texts, done = {i: "" for i in range(len(prompts))}, threading.Semaphore(0)

    def emit_for(i):
        def emit(u):
            texts[i] += u.text
            if u.finish_reason:
                done.release()
        return emit
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        sched.submit(Request(p, n, emit=emit_for(i)))
    sched.start()
    for _ in prompts:
        assert done.acquire(timeout=10)
    sched.close(10)
    return sched.rounds.log, texts


def test_long_prompt_prefilled_between_rounds():
    """A 9-token prompt in pieces of 2 (at most 2 prompt tokens between rounds) while a short request decodes: a
    round after every piece; both outputs complete (the first token, then a 5 per round)."""
    log, texts = run_pieces([[1], [2] * 9], [12, 3], chunk=2, cap=2)
    fills = [i for i, e in enumerate(log) if e[0] == "fill" and e[1] == 2]
    assert [log[i][2] for i in fills] == [2, 2, 2, 2, 1]
    assert all(log[i + 1][0] == "round" for i in fills[:-1]), log
    assert texts == {0: "7" + " 5" * 11, 1: "7 5 5"}


def test_short_prompts_prefilled_together():
    """Prompts that fit the cap together are prefilled before the next round; a longer one waits for it."""
    log, _ = run_pieces([[1, 1], [2], [3] * 4], [2, 2, 2], chunk=8, cap=4)
    assert log[:4] == [("fill", 1, 2), ("fill", 2, 1), ("round", 2), ("fill", 3, 4)], log


def test_bench_serve_starts_a_server_per_level(tmp_path):
    """tools/bench_serve.py --serve: a numpy server per concurrency level (--max-batch = the level), every request
    answered through the openai client, each server gone after its level."""
    import json

    import httpx

    from tools.bench_serve import main
    url, out = f"http://127.0.0.1:{free_port()}", tmp_path / "serve.json"
    main(["--serve", "--backend numpy", "--url", url, "--concurrency", "1,2", "--requests", "3", "--max-tokens", "4",
          "--prompts", "2", "--processes", "2", "--out", str(out)])
    levels = json.loads(out.read_text())["levels"]
    assert [r["concurrency"] for r in levels] == [1, 2] and all(r["errors"] == 0 and r["tokens"] > 0 for r in levels)
    assert [r["processes"] for r in levels] == [1, 2] and all(r["tokens"] == 3 * 4 for r in levels), levels
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=1)


def events(updates, first, include_usage=False, decode=True, paced=False):
    """The SSE lines serve.stream sends for `first` with `updates` already queued behind it, or (paced) arriving one
    at a time as the stream waits for them (decode False: updates of token ids, made text by a scheduler.Receiver)."""
    from numbaengine.scheduler import Receiver, Request
    from numbaengine.serve import Reply, stream
    from numbaengine.serve_metrics import Metrics
    receiver = Receiver(engine().tokenizer, Request([1], 64, decode=decode))

    async def run():
        q = asyncio.Queue()

        async def feed():
            for u in updates:
                q.put_nowait(u)
                if paced:
                    while not q.empty():
                        await asyncio.sleep(0)
        task = asyncio.create_task(feed())
        if not paced:
            await task
        out = [e async for e in stream(first, q, Reply("completion", "/v1/completions", "m", 3), include_usage,
                                       Metrics(2), receiver)]
        await task
        return out
    return asyncio.run(run())


def test_stream_sends_queued_rounds_as_one_chunk():
    """Rounds a stream is behind on go out as one chunk (text joined, the last count and finish reason); an error
    queued behind text is sent after that text; a stream that keeps up sends a chunk per update."""
    import json

    from numbaengine.scheduler import Update
    parse = lambda lines: [json.loads(e[6:]) for e in lines if e != "data: [DONE]\n\n"]   # noqa: E731
    got = parse(events([Update(" b", 2), Update(" c", 3, "length")], Update("a", 1), include_usage=True))
    assert [c["choices"][0]["text"] if c["choices"] else None for c in got] == ["a b c", None], got
    assert got[0]["choices"][0]["finish_reason"] == "length" and got[1]["usage"]["completion_tokens"] == 3, got
    got = parse(events([Update(" b", 2), Update(tokens=2, finish_reason="error", error="boom"), Update(" c", 3)],
                       Update("a", 1)))
    assert got[0]["choices"][0]["text"] == "a b" and "boom" in got[1]["error"]["message"] and len(got) == 2, got


def test_stream_makes_the_text_of_token_ids():
    """Updates of token ids (a request without stop strings) become text at the receiver: chunks join to the
    decode of every id, characters split between tokens held back until whole, queued updates decoded as one."""
    import json

    from numbaengine.scheduler import Update
    tok = engine().tokenizer
    ids = tok.encode("def f(x):\n    return 'é中😀' + x  # done")
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(len(ids))), "no character split between tokens"
    ups = [Update(tokens=k + 1, ids=[t]) for k, t in enumerate(ids)]        # a token per update
    ups[-1].finish_reason = "length"
    for paced in (True, False):                     # one at a time, or all queued behind the first (one chunk)
        lines = events(ups[1:], ups[0], decode=False, paced=paced)
        chunks = [json.loads(e[6:]) for e in lines if e != "data: [DONE]\n\n"]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert (text, chunks[-1]["choices"][0]["finish_reason"]) == (tok.decode(ids), "length"), (paced, chunks)
        assert "\ufffd" not in text and (len(chunks) > 2 if paced else len(chunks) == 1), (paced, chunks)


def test_mailbox_wakes_the_loop_once_per_burst():
    """Updates posted from another thread while the loop is busy arrive in order on their queues, with one wake-up."""
    from numbaengine.serve import Mailbox

    async def run():
        loop = asyncio.get_running_loop()
        box, queues, wakes = Mailbox(loop), [asyncio.Queue() for _ in range(3)], []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(1), real(*a))
        worker = threading.Thread(target=lambda: [box.post(queues[i % 3], i) for i in range(30)])
        worker.start()
        worker.join()                           # the loop is held meanwhile: one burst
        await asyncio.sleep(0.05)
        return [[q.get_nowait() for _ in range(q.qsize())] for q in queues], len(wakes)
    got, wakes = asyncio.run(run())
    assert got == [list(range(k, 30, 3)) for k in range(3)] and wakes == 1, (got, wakes)


def test_stand_in_rounds_decode_through_device_slots():
    """tools/serve_overhead.py's stand-in: DeviceSlots over it decode every prompt to its length, tau tokens a
    round, none of them an eos id (the stand-in must not end sequences early)."""
    from numbaengine import generate as gen
    from tools.serve_overhead import stand_in_slots
    e = engine()
    slots = stand_in_slots(e, 3, 0.0, 3)
    res = gen.generate_on(slots, e.tokenizer, [e.tokenizer.encode(p) for p in PROMPTS[:3]], 10, "ddtree", 16)
    assert [len(r.tokens) for r in res] == [10] * 3 and all(r.stats["rounds"] == 3 for r in res), res
    assert not {t for r in res for t in r.tokens} & set(e.cfg.eos_ids)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux): elsewhere the tool says n/a")
def test_serve_overhead_counts_server_cpu_per_thread():
    """tools/serve_overhead.py's server CPU: thread_cpu sees CPU spent by this process's main thread and by another
    thread apart; cpu_per_token gives milliseconds per 1,000 tokens, the main thread (the event loop) apart."""
    import os
    import threading
    import time

    from tools.serve_overhead import cpu_per_token, thread_cpu

    def burn(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
    def work(seconds, done, read):
        burn(seconds)
        done.set()
        read.wait()                             # alive at the reading: an ended thread's CPU is not in /proc
    pid, done, read = os.getpid(), threading.Event(), threading.Event()
    before = thread_cpu(pid)
    worker = threading.Thread(target=work, args=(0.3, done, read))
    worker.start()
    done.wait()
    burn(0.2)
    after = thread_cpu(pid)
    read.set()
    worker.join()
    main = after[pid] - before[pid]
    others = sum(after[t] - before.get(t, 0.0) for t in after if t != pid)
    assert 0.15 <= main <= 0.5 and others >= 0.25, (main, others)
    got = cpu_per_token({pid: 1.0, 7: 2.0}, {pid: 1.5, 7: 2.25, 9: 0.1}, pid, 1000)
    assert got == pytest.approx({"event_loop": 500.0, "other": 350.0}) and cpu_per_token(None, after, pid, 10) is None
