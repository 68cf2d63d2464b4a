#!/usr/bin/env python3
"""tools/make_random_gguf.py's routing, measured through turbospark (ctest RandomGgufRouting).

The benchmark files route by token (near uniform: an expert cache's worst case) unless
--router-skew asks for favourites; both claims are checked here on the tiny-moe preset with
`turbospark logits --router-out`: the experts each layer picks over 400 random tokens, how many
take half the routings, and an LRU cache of a quarter of a layer's experts replayed over the
picks. Also: the skew is the same at every depth, the same seed writes the same file, bad
arguments are refused with one line and exit 1, and the gpt-oss layout (tiny-gpt-oss) loads as
gpt-oss with MXFP4 experts and routes over all of them, as does the qwen4exp layout
(tiny-qwen4exp, the Flash-Next benchmark file's at tiny widths) as Qwen4-Exp.
"""
import collections
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "make_random_gguf.py")
TS = os.environ.get("TS_BIN", os.path.join(ROOT, "build", "turbospark"))
TOKENS = 400
TOP_K = 4


def make(out, *extra, preset="tiny-moe", qtype="q4_0"):
    return subprocess.run([sys.executable, TOOL, "--preset", preset, "--type", qtype, "--out", out, *extra],
                          capture_output=True, text=True)


def picks(gguf_path, tmp):
    """[layers, tokens, top_k] expert ids the model routes random tokens to (ties to the lower id)."""
    rng = np.random.default_rng(7)
    ids = ",".join(str(t) for t in rng.integers(0, 512, TOKENS))
    probs = os.path.join(tmp, "router.npy")
    p = subprocess.run([TS, "logits", "-m", gguf_path, "--tokens", ids, "--out", os.path.join(tmp, "l.npy"),
                        "--router-out", probs, "--threads", "2"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    r = np.load(probs)
    return np.argsort(-r, axis=2, kind="stable")[:, :, :TOP_K]


def half_takers(layer_picks, n_experts=16):
    counts = np.sort(np.bincount(layer_picks.ravel(), minlength=n_experts))[::-1]
    return int(np.searchsorted(np.cumsum(counts), counts.sum() / 2) + 1)


def lru_hit_rate(layer_picks, capacity):
    cache, hits, total = collections.OrderedDict(), 0, 0
    for row in layer_picks:
        for e in row:
            total += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = True
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / total


class RandomGgufRouting(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.files = {}
        for skew in ("0", "2"):
            out = os.path.join(cls.tmp.name, f"skew{skew}.gguf")
            p = make(out, "--router-skew", skew)
            if p.returncode != 0:
                raise RuntimeError(p.stderr)
            cls.files[skew] = out
        cls.uniform = picks(cls.files["0"], cls.tmp.name)
        cls.skewed = picks(cls.files["2"], cls.tmp.name)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_default_routes_near_uniformly_at_every_depth(self):
        for layer, lp in enumerate(self.uniform):
            counts = np.bincount(lp.ravel(), minlength=16)
            # 1600 picks over 16 experts: 100 each on average; random tokens stay within ~3 sigma.
            self.assertEqual(int((counts > 0).sum()), 16, f"layer {layer}: {counts}")
            self.assertLess(counts.max(), 140, f"layer {layer}: {counts}")
            self.assertGreaterEqual(half_takers(lp), 7, f"layer {layer}: {counts}")
            # A cache of a quarter of the experts hits about a quarter of the time.
            self.assertLess(lru_hit_rate(lp, 4), 0.35, f"layer {layer}")

    def test_skew_gives_favourites_at_every_depth(self):
        rates = []
        for layer, lp in enumerate(self.skewed):
            counts = np.bincount(lp.ravel(), minlength=16)
            self.assertLessEqual(half_takers(lp), 4, f"layer {layer}: {counts}")
            rates.append(lru_hit_rate(lp, 4))
            self.assertGreater(rates[-1], 0.5, f"layer {layer}: {counts}")
        # The same at every depth: RMSNorm scales the bias and the token part alike.
        self.assertLess(max(rates) - min(rates), 0.2, rates)

    def test_layers_have_their_own_favourites(self):
        tops = [int(np.bincount(lp.ravel(), minlength=16).argmax()) for lp in self.skewed]
        self.assertGreater(len(set(tops)), 1, tops)

    def test_same_seed_same_file(self):
        again = os.path.join(self.tmp.name, "again.gguf")
        self.assertEqual(make(again, "--router-skew", "2").returncode, 0)
        with open(again, "rb") as a, open(self.files["2"], "rb") as b:
            self.assertEqual(a.read(), b.read())

    def test_bad_skew_refused(self):
        out = os.path.join(self.tmp.name, "bad.gguf")
        for bad in ("-1", "nan", "inf"):
            p = make(out, "--router-skew", bad)
            self.assertEqual(p.returncode, 1, bad)
            self.assertIn("--router-skew", p.stderr)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        p = subprocess.run([sys.executable, TOOL, "--preset", "tiny-moe", "--type", "q4_k", "--router-skew", "1",
                            "--out", out], capture_output=True, text=True)
        self.assertEqual(p.returncode, 1)
        self.assertIn("q4_0 or q8_0", p.stderr)
        p = make(out, "--router-skew", "1", preset="tiny-gpt-oss", qtype="q8_0")
        self.assertEqual(p.returncode, 1)
        self.assertIn("gpt-oss", p.stderr)

    def test_gpt_oss_layout_loads_with_mxfp4_experts_and_routes_over_all(self):
        out = os.path.join(self.tmp.name, "gpt_oss.gguf")
        p = make(out, preset="tiny-gpt-oss", qtype="q8_0")
        self.assertEqual(p.returncode, 0, p.stderr)
        import gguf
        types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
        for layer in range(2):
            for proj in ("gate", "up", "down"):
                self.assertEqual(types[f"blk.{layer}.ffn_{proj}_exps.weight"], gguf.GGMLQuantizationType.MXFP4)
        info = subprocess.run([TS, "inspect", "-m", out], capture_output=True, text=True)
        self.assertEqual(info.returncode, 0, info.stderr)
        self.assertIn("model_type gpt_oss", info.stdout)
        self.assertIn("rope       yarn", info.stdout)
        lp = picks(out, self.tmp.name)
        self.assertEqual(lp.shape[0], 2)
        for layer, layer_picks in enumerate(lp):
            counts = np.bincount(layer_picks.ravel(), minlength=16)
            self.assertEqual(int((counts > 0).sum()), 16, f"layer {layer}: {counts}")
            self.assertGreaterEqual(half_takers(layer_picks), 5, f"layer {layer}: {counts}")

    def test_qwen4exp_layout_loads_and_routes_over_all(self):
        # llama.cpp's qwen4exp layout (the Flash-Next benchmark file's, at tiny widths): two
        # GatedDeltaNet layers and a QSA layer, the PLE table on layer 0, Q8_0 weights.
        out = os.path.join(self.tmp.name, "qwen4exp.gguf")
        p = make(out, preset="tiny-qwen4exp", qtype="q8_0")
        self.assertEqual(p.returncode, 0, p.stderr)
        import gguf
        r = gguf.GGUFReader(out)
        types = {t.name: t.tensor_type for t in r.tensors}
        self.assertEqual(types["blk.0.ffn_gate_exps.weight"], gguf.GGMLQuantizationType.Q8_0)
        self.assertIn("blk.0.attn_qkv.weight", types)  # GatedDeltaNet
        self.assertIn("blk.2.indexer.q_proj.weight", types)  # QSA
        self.assertIn("per_layer_token_embd.weight", types)
        self.assertEqual(list(r.fields["qwen4exp.attention.compress_ratios"].contents()), [0, 0, 4])
        info = subprocess.run([TS, "inspect", "-m", out], capture_output=True, text=True)
        self.assertEqual(info.returncode, 0, info.stderr)
        self.assertIn("model_type qwen4_exp_text", info.stdout)
        lp = picks(out, self.tmp.name)
        self.assertEqual(lp.shape[0], 3)
        for layer, layer_picks in enumerate(lp):
            counts = np.bincount(layer_picks.ravel(), minlength=16)
            self.assertEqual(int((counts > 0).sum()), 16, f"layer {layer}: {counts}")
            self.assertGreaterEqual(half_takers(layer_picks), 5, f"layer {layer}: {counts}")
        # --hidden widens the model (the PLE rows with it) and the file still loads and runs.
        wide = os.path.join(self.tmp.name, "qwen4exp_wide.gguf")
        p = make(wide, "--hidden", "96", preset="tiny-qwen4exp", qtype="q8_0")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(gguf.GGUFReader(wide).fields["qwen4exp.embedding_length"].contents(), 96)
        self.assertEqual(picks(wide, self.tmp.name).shape[0], 3)
        bad = make(os.path.join(self.tmp.name, "bad.gguf"), "--hidden", "100", preset="tiny-qwen4exp", qtype="q8_0")
        self.assertEqual(bad.returncode, 1)
        self.assertIn("--hidden", bad.stderr)
        bad = make(os.path.join(self.tmp.name, "bad.gguf"), preset="tiny-qwen4exp", qtype="q4_0")
        self.assertEqual(bad.returncode, 1)
        self.assertEqual(len(bad.stderr.strip().splitlines()), 1, bad.stderr)
        self.assertIn("q8_0", bad.stderr)


if __name__ == "__main__":
    unittest.main()
