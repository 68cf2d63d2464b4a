#!/usr/bin/env python3
"""Writes a random-weight qwen3moe / qwen3 GGUF at a real model's shape, quantized the way
llama-quantize stores it, so turbospark and llama.cpp benchmark the very same file.

The CUDA benches need a Qwen3-30B-A3B-shape GGUF in Q4_0 or Q4_K. Converting a bf16 checkpoint
would need 61 GB of safetensors first (the device machine's disk is 64 GB), so this writes the
quantized blocks directly: random 4-bit codes with small, finite block scales (weights of about
fan-in standard deviation, so activations stay bounded through 48 layers), f32 norms and router.
Random routing is near uniform (codes are drawn symmetric about zero, see random_blocks; files
written before 2026-12-03 routed every token to nearly the same experts), which benchmarks
should say beside their numbers.

Expert and attention blocks of one shape are generated once and written for every layer (each
layer still gets its own tensors and file offsets, so no layer reads another's bytes); routers
differ per layer. The vocabulary is the tiny test tokenizer's (tests/data/tiny_tokenizer, taken
from its GGUF fixture) padded to the model's vocabulary with unused tokens: enough for
llama-bench and `turbospark bench`, which feed token ids, not text.

Needs numpy and llama.cpp's gguf-py (from the llama-cpp-python sdist; see
bench/build_llama_cpp.sh), e.g. on the device machine:
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
    "qwen3-8b": dict(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                     inter=12288, experts=0, top_k=0, moe_inter=0),
}


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--type", default="q4_0", choices=["q4_0", "q4_k", "q8_0"])
    ap.add_argument("--layers", type=int, default=0, help="override the preset's depth")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import gguf

    s = dict(PRESETS[args.preset])
    if args.layers:
        s["layers"] = args.layers
    qtype = gguf.GGMLQuantizationType[args.type.upper()]
    moe = s["experts"] > 0
    arch = "qwen3moe" if moe else "qwen3"
    rng = np.random.default_rng(args.seed)
    t0 = time.time()

    src = gguf.GGUFReader(VOCAB_SOURCE)
    tokens = [bytes(src.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in src.fields["tokenizer.ggml.tokens"].data]
    merges = [bytes(src.fields["tokenizer.ggml.merges"].parts[i]).decode()
              for i in src.fields["tokenizer.ggml.merges"].data]
    eos = int(src.fields["tokenizer.ggml.eos_token_id"].contents())
    n_real = len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(s["vocab"] - n_real)]
    types = [int(gguf.TokenType.NORMAL)] * n_real + [int(gguf.TokenType.UNUSED)] * (s["vocab"] - n_real)

    w = gguf.GGUFWriter(args.out, arch)
    w.add_name(f"random {args.preset} {args.type}")
    w.add_block_count(s["layers"])
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
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[args.type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)

    h, hd, nh, nkv = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"]
    ones = lambda n: np.ones(n, dtype=np.float32)
    w.add_tensor("token_embd.weight", random_blocks(gguf, qtype, s["vocab"], h, rng), raw_dtype=qtype)
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
            router = rng.standard_normal((s["experts"], h), dtype=np.float32) / np.float32(np.sqrt(h))
            w.add_tensor(p + "ffn_gate_inp.weight", router)
        for name, data in shared.items():
            w.add_tensor(p + name + ".weight", data, raw_dtype=qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    size = os.path.getsize(args.out)
    print(f"make_random_gguf: wrote {args.out} ({size / 2**30:.2f} GiB, {arch}, {s['layers']} layers, "
          f"{args.type}) in {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
