#!/usr/bin/env python3
"""`turbospark serve` end to end, driven by the official openai and anthropic clients (PyPI).

Run by ctest (label cli); by hand:
    TS_BIN=build/turbospark TS_DEFAULT_GGUF=~/.local/share/turbospark/default-model.gguf \
        python3 tests/server/test_serve.py -v

The reference for every reply is the CLI on the same model: `turbospark run --temperature 0`
gives the greedy answer and `--verbose-prompt` the prompt's token count, so the server must
reproduce the engine (template, tokens, stop ids), not merely answer something.
"""
import json
import math
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

import anthropic
import openai

BIN = os.environ.get("TS_BIN", "build/turbospark")
MODEL = os.environ.get("TS_DEFAULT_GGUF", "")
# Seconds a request may take (scripts/tsan.sh raises it: ThreadSanitizer slows the server ~10x).
HTTP_TIMEOUT = float(os.environ.get("TS_HTTP_TIMEOUT", "300"))
# How much ServeLoad's 200 requests may grow the server's resident memory.
RSS_GROWTH_MIB = int(os.environ.get("TS_RSS_GROWTH_MIB", "256"))
QUESTION = "What is the capital of France?"
MAX = 12


def start_server(*extra, model=None, parallel=2, ctx=1024):
    proc = subprocess.Popen(
        [BIN, "serve", "--model", model or MODEL, "--port", "0", "--parallel", str(parallel), "--ctx", str(ctx),
         "--threads", "2", *extra],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    port = None
    lines = []
    deadline = time.time() + 300
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        proc.kill()
        raise RuntimeError("server did not start:\n" + "".join(lines))
    # Keep draining stderr so the server never blocks on a full pipe.
    def drain():
        for _ in proc.stderr:
            pass
        proc.stderr.close()
    threading.Thread(target=drain, daemon=True).start()
    return proc, f"http://127.0.0.1:{port}"


def cli(*args):
    r = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{args}: {r.stderr}")
    return r


def read_npy_last_row(path):
    """The last row of a 2-D little-endian float32 .npy (no numpy needed)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:6] == b"\x93NUMPY", path
    hlen = struct.unpack("<H", data[8:10])[0]
    header = data[10:10 + hlen].decode()
    assert "'<f4'" in header and "False" in header, header
    rows, cols = map(int, re.search(r"\((\d+), (\d+)\)", header).groups())
    start = 10 + hlen + (rows - 1) * cols * 4
    return list(struct.unpack(f"<{cols}f", data[start:start + cols * 4]))


def http(method, url, body=None, headers=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@unittest.skipUnless(MODEL and os.path.exists(MODEL), "TS_DEFAULT_GGUF not set")
class Serve(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        run = cli("run", "--model", MODEL, "--temperature", "0", "--max-tokens", str(MAX), "--threads", "2",
                  "--verbose-prompt", QUESTION)
        cls.greedy = run.stdout.rstrip("\n")
        cls.prompt_tokens = int(re.search(r"prompt \((\d+) tokens\)", run.stderr).group(1))
        cls.prompt_ids = re.search(r"^\[([0-9, ]+)\]$", run.stderr, re.M).group(1).replace(" ", "")
        cls.tmp = tempfile.mkdtemp()
        cls.proc, cls.base = start_server()
        cls.model_id = json.loads(http("GET", cls.base + "/v1/models")[1])["data"][0]["id"]
        cls.oa = openai.OpenAI(base_url=cls.base + "/v1", api_key="unused", max_retries=0)
        cls.an = anthropic.Anthropic(base_url=cls.base, api_key="unused", max_retries=0)

    @classmethod
    def tearDownClass(cls):
        cls.proc.send_signal(signal.SIGTERM)
        cls.proc.wait(timeout=15)

    def chat(self, **kw):
        args = dict(model=self.model_id, messages=[{"role": "user", "content": QUESTION}], temperature=0,
                    max_tokens=MAX)
        args.update(kw)
        return self.oa.chat.completions.create(**args)

    def test_chat_greedy_equals_the_cli(self):
        r = self.chat()
        self.assertEqual(r.choices[0].message.content, self.greedy)
        self.assertIn("Paris", r.choices[0].message.content)
        self.assertEqual(r.usage.prompt_tokens, self.prompt_tokens)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)
        self.assertIn(r.choices[0].finish_reason, ("stop", "length"))
        self.assertEqual(r.model, self.model_id)

    def test_chat_stream_equals_non_stream(self):
        text, finish, usage, first_role = "", None, None, None
        for chunk in self.chat(stream=True, stream_options={"include_usage": True}):
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.role and first_role is None:
                    first_role = c.delta.role
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        self.assertEqual(first_role, "assistant")
        self.assertEqual(text, self.greedy)
        self.assertIn(finish, ("stop", "length"))
        self.assertEqual(usage.prompt_tokens, self.prompt_tokens)

    def test_max_tokens_ends_with_length(self):
        r = self.chat(max_tokens=3)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 3)
        self.assertTrue(self.greedy.startswith(r.choices[0].message.content))

    def test_stop_string_cuts_before_it(self):
        word = "Paris"
        self.assertIn(word, self.greedy)
        r = self.chat(stop=[word])
        self.assertEqual(r.choices[0].message.content, self.greedy[: self.greedy.index(word)])
        self.assertEqual(r.choices[0].finish_reason, "stop")
        text = "".join(c.choices[0].delta.content or "" for c in self.chat(stop=word, stream=True) if c.choices)
        self.assertEqual(text, self.greedy[: self.greedy.index(word)])

    def test_logprobs_are_the_models_log_softmax(self):
        r = self.chat(logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), r.usage.completion_tokens)
        self.assertEqual("".join(t.token for t in content), r.choices[0].message.content)
        for t in content:  # greedy: the chosen token is the best, alternatives best first
            self.assertEqual(len(t.top_logprobs), 3)
            self.assertAlmostEqual(t.top_logprobs[0].logprob, t.logprob, places=6)
            lps = [a.logprob for a in t.top_logprobs]
            self.assertEqual(lps, sorted(lps, reverse=True))
            self.assertLessEqual(sum(math.exp(x) for x in lps), 1 + 1e-5)
            self.assertEqual(bytes(t.bytes).decode("utf-8", "replace"), t.token)
        # The first token's against the logits the CLI writes for the same prompt ids.
        out = os.path.join(self.tmp, "logits.npy")
        cli("logits", "--model", MODEL, "--tokens", self.prompt_ids, "--threads", "2", "--out", out)
        row = read_npy_last_row(out)
        m = max(row)
        log_z = m + math.log(sum(math.exp(x - m) for x in row))
        # Within 5e-3: earlier requests left this prompt's first blocks cached, so the server
        # computes only its tail, in a forward of a few rows, where quantized matmuls take their
        # row kernel instead of the tiled one the CLI's 36-row forward takes (measured 1.2e-3
        # apart on this Q4_K_M model; 0 when nothing is cached).
        self.assertAlmostEqual(content[0].logprob, m - log_z, delta=5e-3)
        streamed = [t for c in self.chat(logprobs=True, stream=True) if c.choices and c.choices[0].logprobs
                    for t in c.choices[0].logprobs.content]
        self.assertEqual([t.token for t in streamed], [t.token for t in content])
        c = self.oa.completions.create(model=self.model_id, prompt="The capital of France is", max_tokens=3,
                                       temperature=0, logprobs=2)
        self.assertEqual(len(c.choices[0].logprobs.token_logprobs), 3)
        self.assertEqual("".join(c.choices[0].logprobs.tokens), c.choices[0].text)

    TOOLS = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name"}},
                       "required": ["location"]}}}]
    WEATHER = "What is the weather like in Paris today?"

    def test_tool_calls_round_trip_and_stream(self):
        msgs = [{"role": "user", "content": self.WEATHER}]
        r = self.chat(messages=msgs, tools=self.TOOLS, max_tokens=64)
        self.assertEqual(r.choices[0].finish_reason, "tool_calls", r.choices[0].message)
        call = r.choices[0].message.tool_calls[0]
        self.assertEqual(call.function.name, "get_weather")
        self.assertIn("Paris", json.loads(call.function.arguments)["location"])
        # The same call streamed: deltas carry it whole, finish_reason tool_calls.
        streamed, finish = [], None
        for c in self.chat(messages=msgs, tools=self.TOOLS, max_tokens=64, stream=True):
            if c.choices:
                streamed += c.choices[0].delta.tool_calls or []
                finish = c.choices[0].finish_reason or finish
        self.assertEqual(finish, "tool_calls")
        self.assertEqual([(t.function.name, t.function.arguments) for t in streamed],
                         [(call.function.name, call.function.arguments)])
        # The result goes back as a tool message: the template renders the call and the result.
        msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 22})}]
        r2 = self.chat(messages=msgs, tools=self.TOOLS, max_tokens=24)
        self.assertGreater(r2.usage.prompt_tokens, r.usage.prompt_tokens)
        self.assertIn(r2.choices[0].finish_reason, ("stop", "length", "tool_calls"))
        # tool_choice none: the tools are not offered, the reply is text.
        r3 = self.chat(messages=msgs[:1], tools=self.TOOLS, tool_choice="none", max_tokens=8)
        self.assertIsNone(r3.choices[0].message.tool_calls)
        self.assertEqual(r3.usage.prompt_tokens, self.chat(messages=msgs[:1], max_tokens=1).usage.prompt_tokens)

    def test_completions_stream_and_not(self):
        r = self.oa.completions.create(model=self.model_id, prompt="The capital of France is", max_tokens=6,
                                       temperature=0)
        s = "".join(c.choices[0].text for c in self.oa.completions.create(
            model=self.model_id, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True)
            if c.choices)
        self.assertEqual(s, r.choices[0].text)
        self.assertEqual(r.usage.completion_tokens, 6)
        self.assertEqual(r.choices[0].finish_reason, "length")

    def test_anthropic_messages(self):
        # temperature through extra_body: recent clients dropped the keyword for some models.
        greedy = {"extra_body": {"temperature": 0}}
        m = self.an.messages.create(model=self.model_id, max_tokens=MAX, messages=[{"role": "user", "content": QUESTION}],
                                    **greedy)
        self.assertEqual(m.content[0].text, self.greedy)
        self.assertEqual(m.usage.input_tokens, self.prompt_tokens)
        self.assertIn(m.stop_reason, ("end_turn", "max_tokens"))
        with self.an.messages.stream(model=self.model_id, max_tokens=MAX,
                                     messages=[{"role": "user", "content": QUESTION}], **greedy) as st:
            text = "".join(st.text_stream)
            final = st.get_final_message()
        self.assertEqual(text, self.greedy)
        self.assertEqual(final.stop_reason, m.stop_reason)
        s = self.an.messages.create(model=self.model_id, max_tokens=MAX, stop_sequences=["Paris"],
                                    messages=[{"role": "user", "content": QUESTION}], **greedy)
        self.assertEqual(s.stop_reason, "stop_sequence")
        self.assertEqual(s.stop_sequence, "Paris")

    def test_concurrent_requests_give_the_same_greedy_replies(self):
        results = [None] * 6
        def one(i):
            results[i] = "".join(c.choices[0].delta.content or "" for c in self.chat(stream=True) if c.choices)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(results, [self.greedy] * len(results))

    def test_bad_input_is_a_400_naming_the_field(self):
        url = self.base + "/v1/chat/completions"
        msgs = [{"role": "user", "content": "hi"}]
        cases = [
            ({"messages": msgs, "temperature": "hot"}, "temperature"),
            ({"messages": msgs, "temperature": -1}, "temperature"),
            ({"messages": msgs, "top_p": 2}, "top_p"),
            ({"messages": msgs, "max_tokens": 0}, "max_tokens"),
            ({"messages": msgs, "max_tokens": 1.5}, "max_tokens"),
            ({"messages": msgs, "n": 2}, "n"),
            ({"messages": msgs, "tools": [{"type": "web"}]}, "tools"),
            ({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
             "tool_choice"),
            ({"messages": msgs, "top_logprobs": 3}, "top_logprobs"),
            ({"messages": msgs, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
            ({"messages": msgs, "logprobs": "yes"}, "logprobs"),
            ({"messages": msgs, "stop": [1]}, "stop"),
            ({}, "messages"),
            ({"messages": "hi"}, "messages"),
            ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
            ({"messages": [{"role": "user"}]}, "messages[0].content"),
            ({"messages": [{"role": "user", "content": "word " * 3000}]}, "messages"),
        ]
        for body, param in cases:
            status, text = http("POST", url, body)
            self.assertEqual(status, 400, (body, text))
            err = json.loads(text)["error"]
            self.assertEqual(err["param"], param, text)
            self.assertEqual(err["type"], "invalid_request_error")
        for raw in (b"{not json", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', b"[1, 2]"):
            status, text = http("POST", url, raw=raw)
            self.assertEqual(status, 400, text)
            self.assertIn("error", json.loads(text))
        status, text = http("POST", url, {"model": "gpt-4o", "messages": msgs})
        self.assertEqual(status, 404, text)
        with self.assertRaises(openai.BadRequestError):
            self.chat(temperature=5)
        with self.assertRaises(anthropic.BadRequestError):
            self.an.messages.create(model=self.model_id, max_tokens=0, messages=msgs)
        status, text = http("POST", self.base + "/v1/messages", {"model": self.model_id, "messages": msgs})
        self.assertEqual(status, 400, text)
        self.assertEqual(json.loads(text)["type"], "error")
        self.assertEqual(http("GET", self.base + "/nope")[0], 404)

    def test_client_gone_mid_stream_frees_its_slot(self):
        s = socket.create_connection(("127.0.0.1", int(self.base.rsplit(":", 1)[1])))
        body = json.dumps({"messages": [{"role": "user", "content": "Count from 1 to 500."}], "stream": True,
                           "max_tokens": 500, "temperature": 0}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"content" not in got:
            got += s.recv(4096)
        s.close()
        deadline = time.time() + 60
        while time.time() < deadline:
            metrics = http("GET", self.base + "/metrics")[1]
            if re.search(r"^turbospark_requests_running 0$", metrics, re.M):
                break
            time.sleep(0.2)
        self.assertRegex(metrics, r"(?m)^turbospark_requests_running 0$")
        self.assertRegex(metrics, r"(?m)^turbospark_requests_cancelled_total [1-9]")
        self.assertEqual(self.chat(max_tokens=2).usage.completion_tokens, 2)  # still serving

    def test_a_shared_system_prompt_is_read_once(self):
        """Prefix caching: conversations with the same long system prompt attach the cached KV
        blocks of the first (the reuse shows in /metrics) and answer as they do uncached."""
        def cached():
            m = http("GET", self.base + "/metrics")[1]
            return float(re.search(r"(?m)^turbospark_prompt_tokens_cached_total (\S+)$", m).group(1))
        system = "You are a terse assistant for a geography quiz. " * 12
        def ask(question):
            before = cached()
            r = self.oa.chat.completions.create(model=self.model_id, max_tokens=6, temperature=0,
                                                messages=[{"role": "system", "content": system},
                                                          {"role": "user", "content": question}])
            return r.choices[0].message.content, r.usage.prompt_tokens, cached() - before
        italy, n, _ = ask("What is the capital of Italy?")  # the system prompt's first reading
        france, _, gained = ask("What is the capital of France?")
        # The system prompt's whole blocks (it is over 100 tokens) come from the cache.
        self.assertGreaterEqual(gained, 96, france)
        self.assertLess(gained, n)
        again, _, gained = ask("What is the capital of Italy?")
        self.assertGreaterEqual(gained, 96)
        # The same answer (exact equality is left to tests/golden/test_batch.cpp on float
        # models: here the uncached tail is a smaller forward, whose quantized matmuls round
        # differently).
        self.assertIn("Rome", italy)
        self.assertIn("Rome", again)

    def test_deeply_nested_json_is_a_400_not_a_crash(self):
        # 300000 nested objects in a tool's parameters (2 MB) overflowed the stack and took the
        # server down; bodies are now refused past 64 levels, and the server keeps serving.
        d = 300000
        raw = (b'{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":'
               b'{"name":"f","parameters":' + b'{"a":' * d + b"1" + b"}" * d + b"}}]}")
        status, text = http("POST", self.base + "/v1/chat/completions", raw=raw)
        self.assertEqual(status, 400, text[:300])
        self.assertIn("nested deeper than 64 levels", text)
        status, text = http("POST", self.base + "/v1/messages",
                            raw=b'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":' + b"[" * d +
                            b"]" * d + b"}]}")
        self.assertEqual(status, 400, text[:300])
        self.assertEqual(http("GET", self.base + "/health")[0], 200)

    def test_health_models_metrics(self):
        self.assertEqual(http("GET", self.base + "/health"), (200, '{"status":"ok"}'))
        models = self.oa.models.list()
        self.assertEqual([m.id for m in models.data], [self.model_id])
        metrics = http("GET", self.base + "/metrics")[1]
        for name in ("requests_total", "prompt_tokens_total", "generation_tokens_total", "requests_queued",
                     "kv_cache_tokens_used", "prefix_cache_hit_rate", "time_to_first_token_seconds_bucket",
                     "time_per_output_token_seconds_count"):
            self.assertIn("turbospark_" + name, metrics)
        status, page = http("GET", self.base + "/")
        self.assertEqual(status, 200)
        self.assertIn("/v1/chat/completions", page)


@unittest.skipUnless(MODEL and os.path.exists(MODEL), "TS_DEFAULT_GGUF not set")
class ServeWithKey(unittest.TestCase):
    def test_api_key_is_required_but_for_health(self):
        proc, base = start_server("--api-key", "s3cret")
        try:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            self.assertEqual(http("POST", base + "/v1/chat/completions", body)[0], 401)
            self.assertEqual(http("POST", base + "/v1/chat/completions", body, {"Authorization": "Bearer nope"})[0], 401)
            self.assertEqual(http("GET", base + "/v1/models")[0], 401)
            self.assertEqual(http("GET", base + "/health")[0], 200)
            oa = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
            self.assertEqual(oa.chat.completions.create(model=oa.models.list().data[0].id, max_tokens=1,
                                                        messages=body["messages"]).usage.completion_tokens, 1)
            an = anthropic.Anthropic(base_url=base, api_key="s3cret", max_retries=0)
            self.assertEqual(an.messages.create(model=oa.models.list().data[0].id, max_tokens=1,
                                                messages=body["messages"]).usage.output_tokens, 1)
            with self.assertRaises(anthropic.AuthenticationError):
                anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
                    model="x", max_tokens=1, messages=body["messages"])
        finally:
            proc.send_signal(signal.SIGTERM)
            self.assertEqual(proc.wait(timeout=15), 0)  # bounded: short socket timeouts

    def test_bad_flags_are_refused_by_name(self):
        for args, want in ((["--port", "70000"], "--port"), (["--parallel", "0"], "--parallel"),
                           (["--ctx", "-5"], "--ctx"), (["--max-body-mb", "nan"], "--max-body-mb")):
            r = subprocess.run([BIN, "serve", "--model", MODEL, *args], capture_output=True, text=True, timeout=120)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn(want, r.stderr)


SMALL = os.environ.get("TS_GEMMA_GGUF", "")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "fixtures", "qwen3_moe_gguf_tiny",
                    "qwen3_moe_gguf_tiny-bf16.gguf")


class ServeExpertCacheMetrics(unittest.TestCase):
    """With expert streaming on (--expert-cache-slots), /metrics reports the expert cache: lookups,
    loads, disk bytes and the hit rate, consistent with one another; without it, none of them."""

    def test_metrics_report_the_expert_cache(self):
        body = {"prompt": "one two three four five six seven", "max_tokens": 12, "temperature": 0}
        proc, base = start_server("--expert-cache-slots", "3", model=TINY, parallel=1, ctx=256)
        try:
            self.assertEqual(http("POST", base + "/v1/completions", body)[0], 200)
            metrics = http("GET", base + "/metrics")[1]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)
        value = lambda name: float(re.search(rf"(?m)^turbospark_{name} (\S+)$", metrics).group(1))
        lookups, loads = value("expert_cache_lookups_total"), value("expert_cache_loads_total")
        # 8 experts, top-2, 3 slots: every step looks up at least 2 experts per layer and some miss.
        self.assertGreater(lookups, 0)
        self.assertGreater(loads, 0)
        self.assertLessEqual(loads, lookups)
        self.assertGreater(value("expert_cache_read_bytes_total"), 0)
        self.assertAlmostEqual(value("expert_cache_hit_rate"), 1 - loads / lookups, places=5)
        proc, base = start_server(model=TINY, parallel=1, ctx=256)
        try:
            self.assertNotIn("turbospark_expert_cache", http("GET", base + "/metrics")[1])
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)


class ServePreemption(unittest.TestCase):
    """A KV pool of one sequence's context (--kv-pool-tokens) for three slots: replies that
    grow find no free block and preempt the newest request, which is recomputed later. Every
    reply must still be the one the request gets alone (a bf16 model: batching and recompute
    round alike), and nothing may be left held."""

    def test_preempted_requests_finish_with_their_alone_replies(self):
        prompts = [f"Request {i}: " + " ".join(str((i * 7 + k) % 50) for k in range(8 + 5 * i)) for i in range(9)]
        body = lambda p: {"prompt": p, "max_tokens": 90, "temperature": 0}
        proc, base = start_server("--no-prefix-cache", model=TINY, parallel=1, ctx=256)
        try:
            alone = [json.loads(http("POST", base + "/v1/completions", body(p))[1])["choices"][0]["text"]
                     for p in prompts]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)
        proc, base = start_server("--kv-pool-tokens", "256", model=TINY, parallel=3, ctx=256)
        try:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(6) as pool:
                got = list(pool.map(lambda p: http("POST", base + "/v1/completions", body(p)), prompts))
            self.assertEqual([g[0] for g in got], [200] * len(prompts), got)
            self.assertEqual([json.loads(g[1])["choices"][0]["text"] for g in got], alone)
            metrics = http("GET", base + "/metrics")[1]
            self.assertRegex(metrics, r"(?m)^turbospark_preemptions_total [1-9]")
            self.assertRegex(metrics, r"(?m)^turbospark_requests_failed_total 0$")
            self.assertRegex(metrics, r"(?m)^turbospark_kv_cache_blocks_used 0$")
            self.assertRegex(metrics, r"(?m)^turbospark_kv_cache_blocks_total 16$")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)
        # A pool smaller than one sequence's context is refused by name.
        r = subprocess.run([BIN, "serve", "--model", TINY, "--port", "0", "--ctx", "256", "--kv-pool-tokens", "100"],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--kv-pool-tokens 100 is less than one sequence's context", r.stderr)


@unittest.skipUnless(SMALL and os.path.exists(SMALL), "TS_GEMMA_GGUF not set")
class ServeBatchInvariance(unittest.TestCase):
    """A quantized model (gemma-3-270m Q4_K_M: Q4_K, Q6_K, Q8_0) served to four clients at
    once gives every request the reply it gets alone: its rows share steps with the others'
    prompt chunks and decode rows, in varying company, and the CPU kernels compute a row the
    same way whatever shares the call. (Before they did, 13-15 of 120 such replies differed.)"""

    def test_concurrent_replies_equal_the_replies_alone(self):
        prompts = [f"Note {i}: " + " ".join(["alpha", "beta", "gamma", "delta", "river", "stone"][(i + k) % 6]
                                             for k in range(3 + 4 * i)) + ". Continue:" for i in range(12)]
        body = lambda p: {"prompt": p, "max_tokens": 24, "temperature": 0}
        proc, base = start_server(model=SMALL, parallel=4)
        try:
            alone = [json.loads(http("POST", base + "/v1/completions", body(p))[1])["choices"][0]["text"]
                     for p in prompts]
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda p: http("POST", base + "/v1/completions", body(p)), prompts))
            self.assertEqual([g[0] for g in got], [200] * len(prompts), got)
            self.assertEqual([json.loads(g[1])["choices"][0]["text"] for g in got], alone)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)


@unittest.skipUnless(SMALL and os.path.exists(SMALL), "TS_GEMMA_GGUF not set")
class ServeLoad(unittest.TestCase):
    """200 requests, 32 at a time, a quarter of them dropped mid-stream by their client."""

    def test_load_with_disconnects(self):
        proc, base = start_server(model=SMALL, parallel=4)
        port = int(base.rsplit(":", 1)[1])
        try:
            self.assertEqual(http("POST", base + "/v1/completions", {"prompt": "warm up", "max_tokens": 2})[0], 200)
            rss0 = rss_kib(proc.pid)
            import random
            from concurrent.futures import ThreadPoolExecutor
            rng = random.Random(7)
            plan = [rng.choice(["chat", "stream", "drop", "completion"]) for _ in range(200)]

            def one(i):
                kind = plan[i]
                body = {"messages": [{"role": "user", "content": f"Say a word about the number {i}."}],
                        "max_tokens": 4, "temperature": 0.7, "seed": i}
                if kind == "drop":
                    body.update(stream=True, max_tokens=64)
                    raw = json.dumps(body).encode()
                    s = socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT)
                    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
                    got = b""
                    while b"data:" not in got:
                        chunk = s.recv(4096)
                        if not chunk:
                            break
                        got += chunk
                    s.close()
                    return kind, b"data:" in got
                if kind == "completion":
                    status, text = http("POST", base + "/v1/completions",
                                        {"prompt": f"Number {i} is", "max_tokens": 4, "seed": i})
                    return kind, status == 200 and json.loads(text)["usage"]["completion_tokens"] >= 1
                if kind == "stream":
                    body["stream"] = True
                    status, text = http("POST", base + "/v1/chat/completions", body)
                    return kind, status == 200 and text.rstrip().endswith("data: [DONE]")
                status, text = http("POST", base + "/v1/chat/completions", body)
                return kind, status == 200 and json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")

            with ThreadPoolExecutor(32) as pool:
                results = list(pool.map(one, range(len(plan))))
            bad = [(i, k) for i, (k, ok) in enumerate(results) if not ok]
            self.assertEqual(bad, [])
            deadline = time.time() + 120
            while time.time() < deadline:
                metrics = http("GET", base + "/metrics")[1]
                if re.search(r"(?m)^turbospark_requests_running 0$", metrics) and \
                        re.search(r"(?m)^turbospark_requests_queued 0$", metrics):
                    break
                time.sleep(0.5)
            # Nothing held once idle: finished requests' blocks are free or cached, none held.
            for gauge in ("requests_running", "requests_queued", "kv_cache_tokens_used", "kv_cache_blocks_used"):
                self.assertRegex(metrics, rf"(?m)^turbospark_{gauge} 0$")
            self.assertRegex(metrics, r"(?m)^turbospark_requests_total 201$")
            # Continuous batching: with 32 clients on 4 slots, steps held several sequences.
            steps = float(re.search(r"(?m)^turbospark_batch_steps_total (\S+)$", metrics).group(1))
            seqs = float(re.search(r"(?m)^turbospark_batch_step_sequences_total (\S+)$", metrics).group(1))
            self.assertGreater(seqs / steps, 2.0, metrics)
            self.assertRegex(metrics, r"(?m)^turbospark_requests_finished_total 201$")
            self.assertRegex(metrics, r"(?m)^turbospark_requests_failed_total 0$")
            # Resident memory bounded: the slots' KV caches exist from the start; 200 requests
            # must not add more than a little (TS_RSS_GROWTH_MIB: scripts/tsan.sh raises it, as
            # ThreadSanitizer's shadow memory grows with what the server touches).
            self.assertLess(rss_kib(proc.pid) - rss0, RSS_GROWTH_MIB * 1024)
            status, text = http("POST", base + "/v1/completions", {"prompt": "still here", "max_tokens": 2})
            self.assertEqual(status, 200, text)
        finally:
            proc.send_signal(signal.SIGTERM)
            self.assertEqual(proc.wait(timeout=15), 0)  # bounded: short socket timeouts


if __name__ == "__main__":
    unittest.main()
