#!/usr/bin/env python3
"""Serving benchmark: request throughput, output tok/s, time to first token and time per output
token (median and p99) at several concurrencies, against `turbospark serve` and, when given,
llama.cpp's llama-server on the same GGUF, started the same way (same slots, context per slot,
threads), one engine at a time, in one run.

    python3 bench/serve_bench.py --model M.gguf --turbospark build/turbospark \
        [--llama-server $(LLAMA_WITH_SERVER=1 bench/build_llama_cpp.sh)/llama-server] \
        [--concurrency 1,4,16] [--prompt-words 64] [--max-tokens 64] [--parallel 16] \
        [--threads 2] [--out results.json] [--device cuda --llama-extra "-ngl 99 -fa on"]

Each request is a streamed OpenAI /v1/completions call at temperature 0 with its own prompt
(the same length for all, different text so no request reuses another's cache); the client is
the standard library (http.client), one thread per request in flight. A token is a streamed
chunk with text (both servers send one per token); TTFT is the time to the first one, TPOT
the mean gap after it. Output tok/s = all tokens / wall time of the level.
"""
import argparse
import collections
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

WORDS = ("river stone lantern maple orbit copper violet harbor meadow quartz signal thunder "
         "canvas pepper glacier falcon marble ember willow comet").split()


def prompt_for(i, words):
    body = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words))
    return f"Request {i}. Continue this list of words with more words: {body}"


def start(cmd, port_re, name):
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = []
    deadline = time.time() + 600
    port = None
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(port_re, line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        proc.kill()
        sys.exit(f"serve_bench: {name} did not start:\n{''.join(lines[-20:])}")
    # Keep draining stderr so the server never blocks on a full pipe; its last lines say why,
    # should it die mid-run.
    proc.tail = collections.deque(lines[-20:], maxlen=40)
    threading.Thread(target=lambda: [proc.tail.append(line) for line in proc.stderr], daemon=True).start()
    return proc, port


def wait_healthy(port, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"serve_bench: no healthy server on port {port}")


def model_id(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/v1/models")
    return json.loads(c.getresponse().read())["data"][0]["id"]


def one_request(port, i, args):
    body = {"model": args.model_id, "prompt": prompt_for(i, args.prompt_words), "max_tokens": args.max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    times = []
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        choices = ev.get("choices") or []
        if choices and choices[0].get("text"):
            times.append(time.perf_counter())
    c.close()
    if not times:
        raise RuntimeError("no tokens streamed")
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return len(times), ttft, tpot


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_level(port, conc, args, base):
    n = max(args.requests_per_level, 2 * conc)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as pool:
        res = list(pool.map(lambda i: one_request(port, base + i, args), range(n)))
    wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in res)
    ttft = [r[1] for r in res]
    tpot = [r[2] for r in res if r[0] > 1]
    return {"concurrency": conc, "requests": n, "wall_s": round(wall, 3), "req_per_s": round(n / wall, 3),
            "output_tok_per_s": round(tokens / wall, 2), "tokens": tokens,
            "ttft_median_s": round(statistics.median(ttft), 4), "ttft_p99_s": round(pct(ttft, 0.99), 4),
            "tpot_median_s": round(statistics.median(tpot), 4) if tpot else None,
            "tpot_p99_s": round(pct(tpot, 0.99), 4) if tpot else None}


def bench_engine(name, cmd, port_re, args):
    proc, port = start(cmd, port_re, name)
    try:
        return bench_levels(name, proc, port, args)
    except Exception as e:
        time.sleep(1)
        state = "running" if proc.poll() is None else f"exited with {proc.returncode}"
        sys.exit(f"serve_bench: {name} failed ({type(e).__name__}: {e}); the server {state}; its last lines:\n"
                 + "".join(proc.tail))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench_levels(name, proc, port, args):
    wait_healthy(port)
    args.model_id = model_id(port)
    one_request(port, 10_000, args)  # warm up
    out = []
    for k, conc in enumerate(args.concurrency):
        r = run_level(port, conc, args, base=1000 * (k + 1))
        r["engine"] = name
        print(f"{name:>12}  c={conc:<3} {r['req_per_s']:7.3f} req/s  {r['output_tok_per_s']:8.2f} out tok/s  "
              f"TTFT {r['ttft_median_s']:.3f} / {r['ttft_p99_s']:.3f} s  "
              f"TPOT {r['tpot_median_s']:.4f} / {r['tpot_p99_s']:.4f} s (median / p99)", flush=True)
        out.append(r)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--turbospark", action="append", default=[],
                    help="turbospark binary (repeatable: NAME=PATH compares builds)")
    ap.add_argument("--llama-server", default="")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-level", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=16, help="sequence slots of each server")
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="", help="turbospark serve --device (default: its own default)")
    ap.add_argument("--llama-extra", default="", help="more llama-server flags, e.g. \"-ngl 99 -fa on\" on a GPU")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if not args.turbospark and not args.llama_server:
        args.turbospark = ["build/turbospark"]
    results = []
    for spec in args.turbospark:
        name, _, path = spec.rpartition("=")
        cmd = [path, "serve", "--model", args.model, "--port", "0", "--parallel", str(args.parallel), "--ctx",
               str(args.ctx), "--threads", str(args.threads), "-q"] + (["--device", args.device] if args.device else [])
        results += bench_engine(name or "turbospark", cmd, r"listening on http://[^:]+:(\d+)", args)
    if args.llama_server:
        # llama-server's -c is the whole context, split among its -np slots.
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        cmd = [args.llama_server, "-m", args.model, "--port", str(port), "-np", str(args.parallel), "-c",
               str(args.ctx * args.parallel), "-t", str(args.threads), "--no-webui"] + args.llama_extra.split()
        proc_re = rf"(?:listening on|server is listening on).*:({port})"
        results += bench_engine("llama-server", cmd, proc_re, args)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
