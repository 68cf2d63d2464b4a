#!/usr/bin/env python3
"""Writes a random-weight qwen3moe / qwen3 / gpt-oss / qwen4exp GGUF at a real model's shape,
quantized the way llama-quantize stores it, so turbospark and llama.cpp benchmark the very same
file.

The CUDA benches need a Qwen3-30B-A3B-shape GGUF in Q4_0 or Q4_K. Converting a bf16 checkpoint
would need 61 GB of safetensors first (the device machine's disk is 64 GB), so this writes the
quantized blocks directly: random 4-bit codes with small, finite block scales (weights of about
fan-in standard deviation, so activations stay bounded through 48 layers), f32 norms and router.
Routing (MoE) is by token, near uniform by default: the routers read only dims [32, 96) of the
hidden state, which hold each token's own random embedding values (no layer writes to them:
those rows of attn_output and ffn_down_exps are zero), so a token's experts do not depend on its
context or depth, and random tokens spread evenly over the experts: an expert cache's worst
case. (Routers over the whole hidden state followed the part that a context's tokens share,
which attention builds up: at 8 layers and 256 random tokens, 121 of 128 experts were picked at
layer 0 but 28 at layer 7, `logits --router-stats`; files written earlier route that
way (before 2026-12-04), and those before 2026-12-03 sent every token to nearly the same experts.)
--router-skew S (q4_0 / q8_0) adds a popularity skew on top: dims [0, 32) hold one constant
(ANCHOR_VALUE) for every token, and layer L's router gives expert e a logit bias S * sigma * g_e
along them, sigma the spread of the token part of the logits and g_e standard-normal quantiles
in a random order per layer (each layer its own favourites). RMSNorm scales both parts alike,
so the skew is the same at every depth. Random tokens have no temporal reuse beyond that
popularity. Measure what a file gives with `turbospark logits --router-stats` and report it
beside cache hit rates.

Expert and attention blocks of one shape are generated once and written for every layer (each
layer still gets its own tensors and file offsets, so no layer reads another's bytes); routers
differ per layer. The vocabulary is the tiny test tokenizer's (tests/data/tiny_tokenizer, taken
from its GGUF fixture) padded to the model's vocabulary with tokens " fill<i>": enough for
llama-bench and `turbospark bench`, which feed token ids, not text.

--preset gpt-oss-20b writes llama.cpp's gpt-oss layout: MXFP4 expert stacks (random codes, one
block exponent), --type for attention, embeddings and the output (q8_0 is what published files
use), f32 norms, sinks, biases and routers (random rows: MXFP4 and Q8_0 codes are symmetric).

--preset qwen4exp-flash-next writes llama.cpp's qwen4exp layout at Qwen3.8-Flash-Next widths
(GatedDeltaNet and QSA layers, hyper-connections, the n-gram PLE table, 512 experts top-10 with a
gated shared expert) in q8_0, as llama.cpp's converter quantizes it: see write_qwen4exp.

Needs numpy and gguf-py: the `gguf` package from PyPI (scripts/setup.sh installs it) or
llama.cpp's own copy (from the llama-cpp-python sdist; see bench/build_llama_cpp.sh), e.g. on
the device machine, which has no network:
    PYTHONPATH=/path/to/gguf-py python3 tools/make_random_gguf.py \
        --preset qwen3-30b-a3b --type q4_0 --out /tmp/qwen3-30b-a3b-q4_0.gguf
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VOCAB_SOURCE = os.path.join(ROOT, "tests/data/fixtures/qwen3_moe_gguf_tiny/qwen3_moe_gguf_tiny-q8_0.gguf")

# vocab, hidden, layers, heads, kv_heads, head_dim, dense inter, experts, top_k, expert inter
PRESETS = {
    "qwen3-30b-a3b": dict(vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
                          inter=6144, experts=128, top_k=8, moe_inter=768),
    # For tests (tests/cli/test_random_gguf.py): the tokenizer's own 512 tokens, 4 layers.
    "tiny-moe": dict(vocab=512, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32,
                     inter=256, experts=16, top_k=4, moe_inter=64),
    "qwen3-8b": dict(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                     inter=12288, experts=0, top_k=0, moe_inter=0),
    # gpt-oss-20b (arch gpt-oss): MXFP4 experts as ggml stores them, --type for everything else
    # (the published GGUFs keep attention and embeddings at 8 bits or more). See write_gpt_oss.
    "gpt-oss-20b": dict(vocab=201088, hidden=2880, layers=24, heads=64, kv_heads=8, head_dim=64,
                        inter=2880, experts=32, top_k=4, moe_inter=2880, arch="gpt-oss"),
    # For tests: gpt-oss's layout on the tiny tokenizer.
    "tiny-gpt-oss": dict(vocab=512, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                         inter=64, experts=16, top_k=4, moe_inter=64, arch="gpt-oss"),
    # Qwen4-Exp at Flash-Next widths (arch qwen4exp, llama.cpp's layout; see write_qwen4exp):
    # GatedDeltaNet layers with a QSA layer every third, hyper-connections, one n-gram PLE layer,
    # 512 experts top-10 with a gated shared expert. Reduced depth by default (8: 6 + 2).
    "qwen4exp-flash-next": dict(vocab=248320, hidden=2048, layers=8, heads=16, kv_heads=2, head_dim=256,
                                inter=512, experts=512, top_k=10, moe_inter=512, arch="qwen4exp",
                                hc=4, hc_rank=320, gdn_k_heads=16, gdn_v_heads=32, gdn_dim=128, conv=4,
                                index_heads=8, index_dim=128, index_budget=2048, index_ratio=16,
                                ngram=3, heads_per_ngram=8, ngram_base=200000, rope_dims=64),
    # For tests: the same layout on the tiny tokenizer (3 layers: GDN, GDN, QSA).
    "tiny-qwen4exp": dict(vocab=512, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=32,
                          inter=32, experts=16, top_k=4, moe_inter=32, arch="qwen4exp",
                          hc=2, hc_rank=32, gdn_k_heads=2, gdn_v_heads=4, gdn_dim=32, conv=4,
                          index_heads=2, index_dim=32, index_budget=64, index_ratio=4,
                          ngram=3, heads_per_ngram=2, ngram_base=97, rope_dims=8),
}


def tiny_vocab(gguf):
    """The tiny test tokenizer's tokens, merges and EOS id (512 tokens), from VOCAB_SOURCE."""
    src = gguf.GGUFReader(VOCAB_SOURCE)
    tokens = [bytes(src.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in src.fields["tokenizer.ggml.tokens"].data]
    merges = [bytes(src.fields["tokenizer.ggml.merges"].parts[i]).decode()
              for i in src.fields["tokenizer.ggml.merges"].data]
    return tokens, merges, int(src.fields["tokenizer.ggml.eos_token_id"].contents())


def random_blocks(gguf, qtype, rows, cols, rng, extra=()):
    """uint8 array [*extra, rows, bytes per row] of `qtype` blocks with fan-in scaled values."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        sys.exit(f"make_random_gguf: {cols} columns are not a multiple of {qtype.name}'s block {block}")
    nblk = int(np.prod(extra, dtype=np.int64)) * rows * (cols // block)
    data = rng.integers(0, 256, size=(nblk, nbytes), dtype=np.uint8)
    std = 1.0 / np.sqrt(cols)
    q = gguf.GGMLQuantizationType
    # Codes are drawn symmetric about the format's zero: uniform bytes give Q4_0 weights a mean of
    # -d/2 (codes 0..15 minus 8) and Q8_0 one of -d/2 too, and that shared offset, summed over a
    # row, grows into a hidden-state direction common to every token that the routers then
    # follow: every token chose (nearly) the same experts (seen with `logits --router-out`).
    if qtype == q.Q4_0:  # f16 d, then 16 bytes of codes in [1, 16) - 8: std(code) ~ 4.3
        lo = rng.integers(1, 16, size=(nblk, 16), dtype=np.uint8)
        hi = rng.integers(1, 16, size=(nblk, 16), dtype=np.uint8)
        data[:, 2:18] = lo | (hi << 4)
        data[:, 0:2] = np.full((nblk, 1), std / 4.3, dtype=np.float16).view(np.uint8)
    elif qtype == q.Q8_0:  # f16 d, 32 int8 codes in [-127, 127]: std ~ 73
        data[:, 2:34] = rng.integers(-127, 128, size=(nblk, 32), dtype=np.int16).astype(np.int8).view(np.uint8)
        data[:, 0:2] = np.full((nblk, 1), std / 73.0, dtype=np.float16).view(np.uint8)
    elif qtype == q.Q4_K:  # f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of codes
        # value = d * sc * code - dmin * m with sc, m in [0, 64), code in [0, 16): centre it by
        # giving mins about half the scale's reach.
        data[:, 0:2] = np.full((nblk, 1), std / (4.6 * 32), dtype=np.float16).view(np.uint8)
        data[:, 2:4] = np.full((nblk, 1), std * 7.5 / (4.6 * 32), dtype=np.float16).view(np.uint8)
    else:
        sys.exit(f"make_random_gguf: --type {qtype.name} is not supported (q4_0, q4_k, q8_0)")
    return data.reshape(*extra, rows, (cols // block) * nbytes)


# ggml's MXFP4 codes (kvalues_mxfp4: twice the e2m1 values) and their root mean square.
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float64)
MXFP4_RMS = float(np.sqrt(np.mean(MXFP4_VALUES ** 2)))


def random_mxfp4(rows, cols, rng, extra=()):
    """uint8 [*extra, rows, cols / 32 * 17] of ggml MXFP4 blocks ({ e8m0 exponent, 16 bytes of
    nibbles }; a weight is kvalue[code] * 2^(e - 128)): uniform codes (symmetric about zero), one
    exponent giving weights of about fan-in standard deviation."""
    if cols % 32:
        sys.exit(f"make_random_gguf: {cols} columns are not a multiple of MXFP4's block 32")
    nblk = int(np.prod(extra, dtype=np.int64)) * rows * (cols // 32)
    data = np.empty((nblk, 17), dtype=np.uint8)
    data[:, 1:] = rng.integers(0, 256, size=(nblk, 16), dtype=np.uint8)
    data[:, 0] = 128 + int(round(np.log2(1.0 / np.sqrt(cols) / MXFP4_RMS)))
    return data.reshape(*extra, rows, (cols // 32) * 17)


# Routed MoE: the routers read dims [ANCHOR_DIMS, CODE_END) (each token's own embedding values)
# and, with --router-skew, dims [0, ANCHOR_DIMS), which hold ANCHOR_VALUE for every token.
ANCHOR_DIMS = 32
CODE_END = 96
ANCHOR_VALUE = 0.25


def set_anchor(gguf, qtype, data, value):
    """Block 0 (dims 0..31) of every row of a q4_0 / q8_0 array to `value` exactly."""
    if qtype == gguf.GGMLQuantizationType.Q4_0:  # codes 15 - 8 = 7: d = value / 7
        data[..., 0:2] = np.full(1, value / 7.0, dtype=np.float16).view(np.uint8)
        data[..., 2:18] = 0xFF
    else:  # Q8_0: codes 127
        data[..., 0:2] = np.full(1, value / 127.0, dtype=np.float16).view(np.uint8)
        data[..., 2:34] = 127


def zero_rows(gguf, qtype, data, rows):
    """Rows [0, rows) of a block array [..., out rows, bytes] to zero: every block's scales 0
    (Q4_0 / Q8_0: d; Q4_K: d and dmin)."""
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    scale_bytes = 4 if qtype == gguf.GGMLQuantizationType.Q4_K else 2
    for b in range(0, data.shape[-1], block_bytes):
        data[..., :rows, b:b + scale_bytes] = 0


def normal_quantiles(n):
    """The n standard-normal quantiles at (i + 0.5) / n (numpy has no erfinv): bisection."""
    from math import erf, sqrt
    out = np.empty(n)
    for i in range(n):
        target, lo, hi = (i + 0.5) / n, -10.0, 10.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if 0.5 * (1 + erf(mid / sqrt(2))) < target else (lo, mid)
        out[i] = 0.5 * (lo + hi)
    return out


def router_weights(n_experts, h, skew, rng):
    """[n_experts, h] f32: random rows of length sqrt(code dims) on the token-code dims, the skew's bias on the anchor dims
    (see the module doc), zero elsewhere. The token part of a logit then has standard deviation
    sigma = sqrt(CODE_END - ANCHOR_DIMS) / sqrt(h) before the norm's common scale (random_blocks
    draws values of standard deviation 1 / sqrt(h))."""
    r = np.zeros((n_experts, h), dtype=np.float32)
    code = rng.standard_normal((n_experts, CODE_END - ANCHOR_DIMS))
    # Rows of one length: a longer row would win more often for every token.
    code *= np.sqrt(CODE_END - ANCHOR_DIMS) / np.linalg.norm(code, axis=1, keepdims=True)
    r[:, ANCHOR_DIMS:CODE_END] = code
    if skew > 0:
        sigma = np.sqrt(CODE_END - ANCHOR_DIMS) * (1.0 / np.sqrt(h))
        g = normal_quantiles(n_experts)[rng.permutation(n_experts)]
        r[:, :ANCHOR_DIMS] = (skew * sigma * g / (ANCHOR_DIMS * ANCHOR_VALUE))[:, None]
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--type", default="q4_0", choices=["q4_0", "q4_k", "q8_0"])
    ap.add_argument("--layers", type=int, default=0, help="override the preset's depth")
    ap.add_argument("--hidden", type=int, default=0,
                    help="override the preset's hidden size (a multiple of 32; qwen4exp-flash-next: 2048, the "
                         "reference config's; 2560 is the width the CUDA issue names)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--router-skew", type=float, default=0.0,
                    help="MoE: skew expert popularity by S logit spreads (default 0: near uniform; see above)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import gguf

    s = dict(PRESETS[args.preset])
    if args.layers:
        s["layers"] = args.layers
    if args.hidden:
        if args.hidden <= 0 or args.hidden % 32:
            sys.exit(f"make_random_gguf: --hidden must be a positive multiple of 32, got {args.hidden}")
        s["hidden"] = args.hidden
    qtype = gguf.GGMLQuantizationType[args.type.upper()]
    moe = s["experts"] > 0
    skew = args.router_skew
    if not np.isfinite(skew) or skew < 0:
        sys.exit(f"make_random_gguf: --router-skew must be a finite number >= 0, got {skew}")
    if skew > 0 and not moe:
        sys.exit(f"make_random_gguf: --router-skew needs a MoE preset ({args.preset} has no routed experts)")
    if skew > 0 and args.type not in ("q4_0", "q8_0"):
        sys.exit(f"make_random_gguf: --router-skew needs --type q4_0 or q8_0 (an exact 32-dim anchor), got {args.type}")
    arch = s.get("arch") or ("qwen3moe" if moe else "qwen3")
    if arch in ("gpt-oss", "qwen4exp") and skew > 0:
        sys.exit(f"make_random_gguf: --router-skew is not supported for {arch} presets ({args.preset})")
    if arch == "qwen4exp" and args.type != "q8_0":
        sys.exit(f"make_random_gguf: {args.preset} is written in q8_0 (what llama.cpp's converter gives it), "
                 f"not {args.type}")
    rng = np.random.default_rng(args.seed)
    t0 = time.time()

    tokens, merges, eos = tiny_vocab(gguf)
    n_real = len(tokens)
    # Normal tokens with text (" fill<i>" in GPT-2's byte alphabet): random weights mostly pick
    # them, and a serving benchmark counts streamed chunks that carry text.
    tokens += [f"\u0120fill{i}" for i in range(s["vocab"] - n_real)]
    types = [int(gguf.TokenType.NORMAL)] * s["vocab"]

    w = gguf.GGUFWriter(args.out, arch)
    w.add_name(f"random {args.preset} {args.type}")
    w.add_block_count(s["layers"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    if arch == "gpt-oss":
        write_gpt_oss(gguf, w, s, qtype, rng)
    elif arch == "qwen4exp":
        write_qwen4exp(gguf, w, s, qtype, rng, eos)
    else:
        write_qwen3(gguf, w, s, qtype, rng, skew, moe, args.type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    size = os.path.getsize(args.out)
    print(f"make_random_gguf: wrote {args.out} ({size / 2**30:.2f} GiB, {arch}, {s['layers']} layers, "
          f"{args.type}) in {time.time() - t0:.0f} s", file=sys.stderr)


def write_qwen3(gguf, w, s, qtype, rng, skew, moe, type_name):
    w.add_context_length(40960)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if moe:
        w.add_expert_count(s["experts"])
        w.add_expert_used_count(s["top_k"])
        w.add_expert_feed_forward_length(s["moe_inter"])
    w.add_file_type({"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[type_name])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    h, hd, nh, nkv = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"]
    ones = lambda n: np.ones(n, dtype=np.float32)
    embd = random_blocks(gguf, qtype, s["vocab"], h, rng)
    if skew > 0:
        set_anchor(gguf, qtype, embd, ANCHOR_VALUE)
    w.add_tensor("token_embd.weight", embd, raw_dtype=qtype)
    w.add_tensor("output_norm.weight", ones(h))
    w.add_tensor("output.weight", random_blocks(gguf, qtype, s["vocab"], h, rng), raw_dtype=qtype)
    shared = {
        "attn_q": random_blocks(gguf, qtype, nh * hd, h, rng),
        "attn_k": random_blocks(gguf, qtype, nkv * hd, h, rng),
        "attn_v": random_blocks(gguf, qtype, nkv * hd, h, rng),
        "attn_output": random_blocks(gguf, qtype, h, nh * hd, rng),
    }
    if moe:
        e, mi = s["experts"], s["moe_inter"]
        shared["ffn_gate_exps"] = random_blocks(gguf, qtype, mi, h, rng, (e,))
        shared["ffn_up_exps"] = random_blocks(gguf, qtype, mi, h, rng, (e,))
        shared["ffn_down_exps"] = random_blocks(gguf, qtype, h, mi, rng, (e,))
        # No layer writes the dims the routers read (anchor and token code).
        zero_rows(gguf, qtype, shared["attn_output"], CODE_END)
        zero_rows(gguf, qtype, shared["ffn_down_exps"], CODE_END)
    else:
        shared["ffn_gate"] = random_blocks(gguf, qtype, s["inter"], h, rng)
        shared["ffn_up"] = random_blocks(gguf, qtype, s["inter"], h, rng)
        shared["ffn_down"] = random_blocks(gguf, qtype, h, s["inter"], rng)
    for layer in range(s["layers"]):
        p = f"blk.{layer}."
        w.add_tensor(p + "attn_norm.weight", ones(h))
        w.add_tensor(p + "attn_q_norm.weight", ones(hd))
        w.add_tensor(p + "attn_k_norm.weight", ones(hd))
        w.add_tensor(p + "ffn_norm.weight", ones(h))
        if moe:
            w.add_tensor(p + "ffn_gate_inp.weight", router_weights(s["experts"], h, skew, rng))
        for name, data in shared.items():
            w.add_tensor(p + name + ".weight", data, raw_dtype=qtype)


def write_gpt_oss(gguf, w, s, qtype, rng):
    """gpt-oss as llama.cpp's converter writes it (its metadata keys, q/k/v/o with biases, sinks,
    a router with a bias, gate/up/down expert stacks in MXFP4 with biases), gpt-oss-20b's
    attention (sliding window 128 on even layers, YaRN 32 over 4096 positions, theta 150000).
    Routing: random router rows over the whole hidden state (the codes are symmetric, so no
    common direction builds up; measure it with `turbospark logits --router-stats`)."""
    h, hd, nh, nkv, e, mi = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"], s["experts"], s["moe_inter"]
    w.add_context_length(131072)
    w.add_embedding_length(h)
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_sliding_window(128)
    w.add_expert_count(e)
    w.add_expert_used_count(s["top_k"])
    w.add_expert_feed_forward_length(mi)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    ones = lambda n: np.ones(n, dtype=np.float32)
    small = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)
    w.add_tensor("token_embd.weight", random_blocks(gguf, qtype, s["vocab"], h, rng), raw_dtype=qtype)
    w.add_tensor("output_norm.weight", ones(h))
    w.add_tensor("output.weight", random_blocks(gguf, qtype, s["vocab"], h, rng), raw_dtype=qtype)
    mx = gguf.GGMLQuantizationType.MXFP4
    shared = {
        "attn_q.weight": (random_blocks(gguf, qtype, nh * hd, h, rng), qtype),
        "attn_k.weight": (random_blocks(gguf, qtype, nkv * hd, h, rng), qtype),
        "attn_v.weight": (random_blocks(gguf, qtype, nkv * hd, h, rng), qtype),
        "attn_output.weight": (random_blocks(gguf, qtype, h, nh * hd, rng), qtype),
        "ffn_gate_exps.weight": (random_mxfp4(mi, h, rng, (e,)), mx),
        "ffn_up_exps.weight": (random_mxfp4(mi, h, rng, (e,)), mx),
        "ffn_down_exps.weight": (random_mxfp4(h, mi, rng, (e,)), mx),
        "attn_q.bias": (small(nh * hd), None),
        "attn_k.bias": (small(nkv * hd), None),
        "attn_v.bias": (small(nkv * hd), None),
        "attn_output.bias": (small(h), None),
        "ffn_gate_exps.bias": (small(e, mi), None),
        "ffn_up_exps.bias": (small(e, mi), None),
        "ffn_down_exps.bias": (small(e, h), None),
    }
    for layer in range(s["layers"]):
        p = f"blk.{layer}."
        w.add_tensor(p + "attn_norm.weight", ones(h))
        w.add_tensor(p + "post_attention_norm.weight", ones(h))
        w.add_tensor(p + "attn_sinks.weight", small(nh))
        w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((e, h)) / np.sqrt(h)).astype(np.float32))
        w.add_tensor(p + "ffn_gate_inp.bias", small(e))
        for name, (data, raw) in shared.items():
            if raw is None:
                w.add_tensor(p + name, data)
            else:
                w.add_tensor(p + name, data, raw_dtype=raw)


def primes_from(start, n):
    """The first n primes >= start."""
    out, v = [], start
    while len(out) < n:
        if v > 1 and all(v % d for d in range(2, int(v ** 0.5) + 1)):
            out.append(v)
        v += 1
    return out


def write_qwen4exp(gguf, w, s, qtype, rng, eos):
    """Qwen4-Exp as llama.cpp's converter writes it (conversion/qwen4exp.py; its metadata keys and
    tensor names, which turbospark's GGUF loader maps back to transformers' model): layers
    (i + 1) % 3 == 0 are QSA attention (q with its output gate, q/k norms, the indexer's q and k
    projections), the others GatedDeltaNet (fused q|k|v, z gate, alpha, beta, A stored as
    -exp(A_log), causal conv), every layer hyper-connections for attention and FFN, layer 0 the
    n-gram PLE (its table of 16 heads over primes from ngram_base, f16), every layer a routed MoE
    (experts in --type) with a sigmoid-gated shared expert. Weights are --type (q8_0) where the
    converter quantizes; norms, routers, conv kernels and the GatedDeltaNet's A and dt in f32, as
    it keeps them. The (1 + w) norms are stored as 1 + w, here 1. Random routers over the whole
    hidden state (symmetric codes: no shared direction; measure with `logits --router-stats`).
    llama.cpp needs the PLE width to equal the hidden size (16 heads x 128 at Flash-Next widths)
    and mRoPE sections within the rotary dims (both hold here)."""
    h, hd, nh, nkv, e, mi = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"], s["experts"], s["moe_inter"]
    hc, rank = s["hc"], s["hc_rank"]
    ch = hc * h
    nk, nv, dd, conv = s["gdn_k_heads"], s["gdn_v_heads"], s["gdn_dim"], s["conv"]
    conv_dim = 2 * nk * dd + nv * dd
    ih, idim = s["index_heads"], s["index_dim"]
    ngram, per = s["ngram"], s["heads_per_ngram"]
    ple_heads = (ngram - 1) * per
    if h % ple_heads:
        sys.exit(f"make_random_gguf: hidden {h} is not a multiple of the {ple_heads} PLE heads")
    ple_row = h // ple_heads
    layers = s["layers"]
    recurrent = [(i + 1) % 3 != 0 for i in range(layers)]
    if all(recurrent):
        recurrent[-1] = False  # at least one QSA layer
    a = "qwen4exp."
    T = gguf.GGUFValueType
    w.add_context_length(32768)
    w.add_embedding_length(h)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(10000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(e)
    w.add_expert_used_count(s["top_k"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_uint32(a + "expert_feed_forward_length", mi)
    w.add_uint32(a + "expert_shared_feed_forward_length", s["inter"])
    w.add_uint32(a + "ssm.conv_kernel", conv)
    w.add_uint32(a + "ssm.state_size", dd)
    w.add_uint32(a + "ssm.group_count", nk)
    w.add_uint32(a + "ssm.time_step_rank", nv)
    w.add_uint32(a + "ssm.inner_size", nv * dd)
    w.add_key_value(a + "attention.recurrent_layers", recurrent, T.ARRAY, sub_type=T.BOOL)
    w.add_uint32(a + "full_attention_interval", 3)
    w.add_uint32(a + "rope.dimension_count", s["rope_dims"])
    half = s["rope_dims"] // 2
    sections = [half - 2 * (half // 3), half // 3, half // 3, 0]
    w.add_key_value(a + "rope.dimension_sections", sections, T.ARRAY, sub_type=T.INT32)
    w.add_uint32(a + "hyper_connection.count", hc)
    w.add_uint32(a + "hyper_connection.low_rank", rank)
    w.add_uint32(a + "attention.indexer.head_count", ih)
    w.add_uint32(a + "attention.indexer.key_length", idim)
    w.add_uint32(a + "attention.indexer.top_k", s["index_budget"])
    w.add_key_value(a + "attention.compress_ratios", [0 if r else s["index_ratio"] for r in recurrent], T.ARRAY,
                    sub_type=T.INT32)
    sizes = primes_from(s["ngram_base"], ple_heads)
    offsets = [int(sum(sizes[:i])) for i in range(ple_heads)]
    ple_rows = (sum(sizes) + 127) // 128 * 128
    w.add_key_value(a + "ple.layers", [0], T.ARRAY, sub_type=T.INT32)
    w.add_uint32(a + "ple.ngram_size", ngram)
    w.add_uint32(a + "ple.heads_per_ngram", per)
    w.add_uint32(a + "ple.conv_kernel", 4)
    w.add_uint32(a + "ple.eos_token_id", eos)
    w.add_uint32(a + "ple.image_token_id", s["vocab"] - 1)
    w.add_uint32(a + "embedding_length_per_layer_input", ple_row)
    multipliers = [int(v) | 1 for v in rng.integers(1 << 40, 1 << 52, size=ngram, dtype=np.int64)]
    w.add_key_value(a + "ple.layer_multipliers", multipliers, T.ARRAY, sub_type=T.UINT64)
    w.add_key_value(a + "ple.head_offsets", offsets, T.ARRAY, sub_type=T.UINT64)
    w.add_key_value(a + "ple.head_vocab_sizes", sizes, T.ARRAY, sub_type=T.UINT64)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    ones = lambda n: np.ones(n, dtype=np.float32)
    f32 = lambda *shape, scale: (scale * rng.standard_normal(shape)).astype(np.float32)
    blocks = lambda rows, cols, extra=(): random_blocks(gguf, qtype, rows, cols, rng, extra)

    def put(name, data):
        if data.dtype == np.uint8:
            w.add_tensor(name, data, raw_dtype=qtype)
        else:
            w.add_tensor(name, data)

    put("token_embd.weight", blocks(s["vocab"], h))
    put("output.weight", blocks(s["vocab"], h))
    put("output_hc_norm.weight", ones(ch))
    put("output_hc_down.weight", blocks(rank, ch))
    put("output_hc_up.weight", blocks(ch, rank))
    # Blocks of one shape are drawn once and written for every layer that has them.
    shared = {
        "hc": {"down": blocks(rank, ch), "up": blocks(ch, rank), "inject": blocks(hc, ch)},
        "gdn": {"attn_qkv.weight": blocks(conv_dim, h), "attn_gate.weight": blocks(nv * dd, h),
                "ssm_alpha.weight": blocks(nv, h), "ssm_beta.weight": blocks(nv, h),
                "ssm_out.weight": blocks(h, nv * dd)},
        "qsa": {"attn_q.weight": blocks(2 * nh * hd, h), "attn_k.weight": blocks(nkv * hd, h),
                "attn_v.weight": blocks(nkv * hd, h), "attn_output.weight": blocks(h, nh * hd),
                "indexer.q_proj.weight": blocks(ih * idim, h), "indexer.k_proj.weight": blocks(idim, h)},
        "moe": {"ffn_gate_exps.weight": blocks(mi, h, (e,)), "ffn_up_exps.weight": blocks(mi, h, (e,)),
                "ffn_down_exps.weight": blocks(h, mi, (e,)), "ffn_gate_shexp.weight": blocks(s["inter"], h),
                "ffn_up_shexp.weight": blocks(s["inter"], h), "ffn_down_shexp.weight": blocks(h, s["inter"])},
    }
    conv_w = f32(conv_dim, conv, scale=0.5)
    for layer in range(layers):
        p = f"blk.{layer}."
        for part in ("attn", "ffn"):
            put(p + f"hc_{part}_norm.weight", ones(ch))
            put(p + f"hc_{part}_down.weight", shared["hc"]["down"])
            put(p + f"hc_{part}_up.weight", shared["hc"]["up"])
            put(p + f"hc_{part}_inject.weight", shared["hc"]["inject"])
        if recurrent[layer]:
            put(p + "ssm_a", -np.exp(rng.uniform(0.0, np.log(16.0), nv)).astype(np.float32))
            put(p + "ssm_conv1d.weight", conv_w)
            put(p + "ssm_dt.bias", f32(nv, scale=0.5))
            put(p + "ssm_norm.weight", ones(dd))
            for name, data in shared["gdn"].items():
                put(p + name, data)
        else:
            put(p + "attn_q_norm.weight", ones(hd))
            put(p + "attn_k_norm.weight", ones(hd))
            put(p + "indexer.q_norm.weight", ones(idim))
            put(p + "indexer.k_norm.weight", ones(idim))
            for name, data in shared["qsa"].items():
                put(p + name, data)
        if layer == 0:
            put(p + "ple_key.weight", blocks(ch, h))
            put(p + "ple_value.weight", blocks(h, h))
            for n in ("ple_norm_key", "ple_norm_query", "ple_norm_conv"):
                put(p + n + ".weight", ones(ch))
            put(p + "ple_conv1d.weight", f32(ch, 4, scale=0.5).astype(np.float16))
        put(p + "ffn_gate_inp.weight", f32(e, h, scale=1.0 / np.sqrt(h)))
        put(p + "ffn_gate_inp_shexp.weight", f32(1, h, scale=1.0 / np.sqrt(h)))
        for name, data in shared["moe"].items():
            put(p + name, data)
    table = (rng.standard_normal((ple_rows, ple_row)) / np.sqrt(ple_row)).astype(np.float16)
    put("per_layer_token_embd.weight", table)


if __name__ == "__main__":
    main()
