"""Front isolation: do huge prompts slow down everyone else? Wall-clock, one LLM service.

Setup: one LLM service (``mmserve llm``, the tiny MiMo, front + engine-core processes) on this
machine. Load: ``--clients`` closed-loop clients sending small chats (a short prompt, 8 output
tokens) and a ``/readyz`` probe every 50 ms. Two phases, alternated (quiet, big, quiet, big, ...
``--repeats`` times):

* quiet: just that load;
* big: the same, plus an 8 MB text prompt (far over ``max_model_len``, so it must be refused
  with 400) every ``--big-every`` seconds, sent from another process (so the client's own GIL
  does not enter the measurement).

Reported: p50/p99 latency of the small requests and of ``/readyz`` in each phase, the ratio
big/quiet of the p99s (target <= 1.2x), and how long the 8 MB prompt took to be refused.
``--quick``: 2 pairs of 8 s phases (about a minute with start-up). Last line: a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks import _results
from benchmarks._stats import percentile, scaled

from shared.schemas import GenerateRequest, PromptMessage, PromptText, SamplingParams
from shared.wire import pack


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _body(rid: str, text: str, max_tokens: int) -> bytes:
    req = GenerateRequest(request_id=rid, messages=[PromptMessage(role="user", content=[PromptText(text=text)])],
                          sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return pack({}, req)


# the 8 MB sender: its own process (so building and sending 8 MB never takes the measuring
# process's GIL), importing only httpx, started and ready before the phase begins
_SENDER = """
import sys, time, json, httpx
url, path, every, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
body = open(path, "rb").read()
c = httpx.Client(timeout=120)
print("ready", flush=True)
sys.stdin.readline()
end = time.monotonic() + seconds
time.sleep(every / 2)
out = []
while time.monotonic() < end:
    t = time.monotonic()
    r = c.post(url + "/v1/generate", content=body)
    out.append((r.status_code, time.monotonic() - t))
    time.sleep(max(0.0, every - (time.monotonic() - t)))
print(json.dumps(out), flush=True)
"""


class Phase:
    def __init__(self, url: str, clients: int, seconds: float, big_every: float | None, big_body: str):
        self.url, self.clients, self.seconds = url, clients, seconds
        self.big_every, self.big_body = big_every, big_body
        self.small: list[float] = []
        self.ready: list[float] = []
        self.big: list[tuple[int, float]] = []
        self.errors = 0
        self._n = 0
        self._lock = threading.Lock()

    def _rid(self) -> str:
        with self._lock:
            self._n += 1
            return f"iso-{os.getpid()}-{time.monotonic_ns()}-{self._n}"

    def _small_loop(self, end: float) -> None:
        with httpx.Client(timeout=60) as c:
            while time.monotonic() < end:
                t = time.monotonic()
                r = c.post(self.url + "/v1/generate", content=_body(self._rid(), "hello there, how are you", 8))
                dt = time.monotonic() - t
                if r.status_code == 200:
                    self.small.append(dt)
                else:
                    self.errors += 1

    def _ready_loop(self, end: float) -> None:
        with httpx.Client(timeout=30) as c:
            while time.monotonic() < end:
                t = time.monotonic()
                r = c.get(self.url + "/readyz")
                self.ready.append(time.monotonic() - t)
                if r.status_code != 200:
                    self.errors += 1
                time.sleep(max(0.0, 0.05 - (time.monotonic() - t)))

    def _start_sender(self) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", _SENDER, self.url, self.big_body, str(self.big_every),
                              str(self.seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        return p

    def run(self) -> "Phase":
        sender = self._start_sender() if self.big_every else None
        end = time.monotonic() + self.seconds
        threads = [threading.Thread(target=self._small_loop, args=(end,)) for _ in range(self.clients)]
        threads.append(threading.Thread(target=self._ready_loop, args=(end,)))
        if sender is not None:
            sender.stdin.write("go\n")
            sender.stdin.flush()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if sender is not None:
            self.big.extend(tuple(x) for x in json.loads(sender.stdout.readline()))
            sender.wait(30)
        return self


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default=None, help="bundle dir (default: the tiny MiMo, written once)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--big-every", type=float, default=2.0)
    ap.add_argument("--big-mb", type=float, default=8.0)
    ap.add_argument("--vocab", type=int, default=0,
                    help="the tiny MiMo with a real-size byte-level BPE of this many tokens trained here "
                         "(mmserve.testing.real_bpe; 0: its own 640-token vocabulary)")
    ap.add_argument("--big-text", choices=("words", "runs"), default="words",
                    help="the 8 MB prompt: words, or runs of '-', ' ', '=' (a real vocabulary's longest tokens)")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    if args.smoke:  # one short phase each, a big prompt every 0.5 s
        args.seconds, args.repeats, args.big_every = 1.5, 1, 0.5
    seconds = args.seconds or (8.0 if args.quick else 20.0)
    repeats = args.repeats or (2 if args.quick else 3)

    model = args.model
    if model is None:
        from mmserve.tiny_model import write_tiny_model

        from shared.cache_dir import cache_path

        cache = cache_path("bench-tiny-mimo")
        if not (cache / "mmserve_bundle.json").exists():
            write_tiny_model(cache, arch="mimo")
        model = str(cache)
        if args.vocab:
            from mmserve.testing.real_bpe import bundle_with_tokenizer, train_real_size_bpe

            real = cache.with_name(f"bench-tiny-mimo-bpe{args.vocab}")
            if not (real / "mmserve_bundle.json").exists():
                tmp = Path(tempfile.mkdtemp(prefix="mmserve-bpe-", dir=cache.parent)) / "b"
                bundle_with_tokenizer(cache, tmp, train_real_size_bpe(args.vocab))
                tmp.rename(real)
                tmp.parent.rmdir()  # the now-empty temporary folder (the rename is atomic, not the folder's removal)
            model = str(real)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mmserve.cli", "llm", "--model", model, "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the LLM service did not start")
            time.sleep(0.2)
        if args.big_text == "runs":  # runs of 1-700 bytes: where a bytes-per-token bound is weakest
            import random

            rng = random.Random(0)
            big_text = "".join(rng.choice("- =") * rng.randint(1, 700) for _ in range(3000))
        else:
            big_text = " ".join(("lorem ipsum dolor sit amet consectetur adipiscing elit " * 1000).split())
        big_text = (big_text * (int(args.big_mb * 1e6) // len(big_text) + 1))[: int(args.big_mb * 1e6)]
        big_file = tempfile.NamedTemporaryFile(prefix="mmserve-big-", suffix=".bin", delete=False)
        big_file.write(_body("big", big_text, 8))
        big_file.close()
        big_body = big_file.name  # the sender process reads it
        Phase(url, args.clients, min(3.0, seconds), None, big_body).run()  # warm-up
        quiet, big = [], []
        for _ in range(repeats):
            quiet.append(Phase(url, args.clients, seconds, None, big_body).run())
            big.append(Phase(url, args.clients, seconds, args.big_every, big_body).run())
    finally:
        if "big_body" in locals():
            os.unlink(big_body)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    def agg(phases: list[Phase], attr: str) -> list[float]:
        return [x for p in phases for x in getattr(p, attr)]

    res = {}
    for name, phases in (("quiet", quiet), ("big", big)):
        res[name] = {
            "small_n": len(agg(phases, "small")),
            "small_p50_ms": scaled(percentile(agg(phases, "small"), 50), 1000, None),
            "small_p99_ms": scaled(percentile(agg(phases, "small"), 99), 1000, None),
            "readyz_n": len(agg(phases, "ready")),
            "readyz_p50_ms": scaled(percentile(agg(phases, "ready"), 50), 1000, None),
            "readyz_p99_ms": scaled(percentile(agg(phases, "ready"), 99), 1000, None),
            "errors": sum(p.errors for p in phases),
            # per repeat, for the spread
            "small_p99_ms_each": [scaled(percentile(p.small, 99), 1000) for p in phases],
            "readyz_p99_ms_each": [scaled(percentile(p.ready, 99), 1000) for p in phases],
        }
    bigs = [b for p in big for b in p.big]
    res["big_prompts"] = {
        "n": len(bigs), "statuses": sorted({s for s, _ in bigs}),
        "refused_in_ms_median": 1000 * statistics.median([t for _, t in bigs]) if bigs else None,
        "refused_in_ms_max": 1000 * max((t for _, t in bigs), default=0.0),
        "size_mb": args.big_mb,
    }
    for key in ("small", "readyz"):
        b, q = res["big"][f"{key}_p99_ms"], res["quiet"][f"{key}_p99_ms"]
        res[f"ratio_{key}_p99"] = b / q if b is not None and q else None
    res["target"] = "<= 1.2x"
    res["config"] = {"clients": args.clients, "seconds": seconds, "repeats": repeats, "big_every_s": args.big_every,
                     "order": "quiet,big alternated", "kind": "wall-clock",
                     "vocabulary": f"real-size byte-level BPE, {args.vocab} tokens" if args.vocab else "tiny (640)",
                     "big_text": args.big_text}
    print(f"{'phase':8} {'small p50':>10} {'small p99':>10} {'readyz p50':>11} {'readyz p99':>11} {'n':>6} {'err':>4}")
    for name in ("quiet", "big"):
        r = res[name]
        print(f"{name:8} {r['small_p50_ms']:9.1f}ms {r['small_p99_ms']:9.1f}ms {r['readyz_p50_ms']:10.1f}ms "
              f"{r['readyz_p99_ms']:10.1f}ms {r['small_n']:6d} {r['errors']:4d}")
    bp = res["big_prompts"]
    print(f"8 MB prompts: {bp['n']} sent, statuses {bp['statuses']}, refused in {bp['refused_in_ms_median']:.0f} ms "
          f"(median), {bp['refused_in_ms_max']:.0f} ms (max)")
    print(f"p99 big/quiet: small requests {res['ratio_small_p99']:.2f}x, /readyz {res['ratio_readyz_p99']:.2f}x "
          f"(target <= 1.2x)")
    _results.record("front_isolation", ap, args, res, kind="wall-clock", baseline="the same load without big prompts",
                    summary=f"small {res['ratio_small_p99']:.2f}x, `/readyz` {res['ratio_readyz_p99']:.2f}x; "
                            f"{args.big_mb:g} MB of {args.big_text} refused ({bp['statuses']}) in ~{bp['refused_in_ms_median'] or 0:.0f} ms "
                            f"median, {bp['refused_in_ms_max']:.0f} ms max; vocabulary "
                            f"{args.vocab or 640}")


if __name__ == "__main__":
    _results.run(main)
