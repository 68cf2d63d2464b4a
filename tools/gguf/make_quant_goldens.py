#!/usr/bin/env python3
"""Golden data for the quant formats and the GGUF reader, made by the reference
implementation (the `gguf` PyPI package that ships with llama.cpp), so the C++ code is
checked against bytes and values it did not produce itself.

Writes, under tests/data/quant/:
  goldens.json          per format: raw block bytes (hex) and their dequantization by
                        gguf.quants.dequantize (float32 values, exact decimal repr)
  reference_writer.gguf a GGUF v3 file written by gguf.GGUFWriter holding every metadata
                        value type (nested and string arrays included) and one tensor per
                        supported ggml type, whose bytes are the golden blocks above

Made with: gguf 0.19.0, numpy (see "generator" in goldens.json).
Run: python3 tools/gguf/make_quant_goldens.py [--out tests/data/quant]
"""
import argparse
import json
import os
from importlib.metadata import version

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

# format -> (number of blocks, byte offsets of the f16 scale fields inside a block)
FORMATS = {
    "Q4_0": (8, [0]),
    "Q4_1": (8, [0, 2]),
    "Q8_0": (8, [0]),
    "Q4_K": (3, [0, 2]),
    "Q5_K": (3, [0, 2]),
    "Q6_K": (3, [208]),
    "F16": (64, None),
    "BF16": (64, None),
    # appended later; listed last so the earlier formats' random bytes stay as committed
    "Q5_0": (8, [0]),
    "Q5_1": (8, [0, 2]),
}


def random_scales(rng, n):
    """Finite f16 scales over many magnitudes, signs, subnormals and zero: random bytes in a
    scale field would often be inf/NaN, which tests nothing useful."""
    mag = 10.0 ** rng.uniform(-7.5, 0.5, n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    vals = (mag * sign).astype(np.float16)
    vals[rng.random(n) < 0.05] = 0
    return vals


def make_blocks(rng, name):
    qtype = T[name]
    n_blocks, scale_offsets = FORMATS[name]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if name == "F16":
        return random_scales(rng, n_blocks).view(np.uint8)
    if name == "BF16":
        f = (rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(-3, 3, n_blocks)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in scale_offsets:
        raw[:, off:off + 2] = random_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "quant"))
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)

    goldens = {"generator": f"tools/gguf/make_quant_goldens.py (gguf {version('gguf')}, numpy {np.__version__}, seed {args.seed})",
               "formats": {}}
    raws = {}
    for name in FORMATS:
        raw = make_blocks(rng, name)
        values = gguf.quants.dequantize(raw, T[name]).astype(np.float32).reshape(-1)
        raws[name] = (raw, values)
        goldens["formats"][name] = {
            "ggml_type": int(T[name]),
            "n": int(values.size),
            "hex": raw.tobytes().hex(),
            # repr of a float32 widened to double is exact; JSON parsers read it back exactly.
            "values": [float(v) for v in values],
        }
    with open(os.path.join(args.out, "goldens.json"), "w") as f:
        json.dump(goldens, f, indent=1)
        f.write("\n")

    w = gguf.GGUFWriter(os.path.join(args.out, "reference_writer.gguf"), arch="testarch")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_float32("t.f32", 0.15625)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo wörld")
    w.add_uint64("t.u64", 18000000000000000000)
    w.add_int64("t.i64", -9000000000000000000)
    w.add_float64("t.f64", -2.5e-300)
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_f32", [0.5, -1.25])
    w.add_array("t.arr_str", ["a", "", "ccc"])
    w.add_key_value("t.arr_u8", [1, 2, 255], V.ARRAY, sub_type=V.UINT8)
    w.add_key_value("t.arr_nested", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)
    w.add_key_value("t.arr_bool", [True, False], V.ARRAY, sub_type=V.BOOL)
    for name, (raw, values) in raws.items():
        qtype = T[name]
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        n = values.size
        # two rows when the blocks divide evenly, to exercise ne1 > 1
        rows = 2 if (n // block_elems) % 2 == 0 else 1
        byte_shape = (rows, raw.size // rows)
        if name == "F16":
            w.add_tensor(f"golden.{name}", raw.view(np.float16).reshape(rows, n // rows))
        elif name == "BF16":
            w.add_tensor(f"golden.{name}", raw.view(np.uint16).reshape(rows, n // rows), raw_dtype=qtype)
        else:
            w.add_tensor(f"golden.{name}", raw.reshape(byte_shape), raw_dtype=qtype)
    w.add_tensor("plain.f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
