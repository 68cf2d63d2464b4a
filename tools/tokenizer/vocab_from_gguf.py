#!/usr/bin/env python3
"""Dump the vocabulary of a GGUF file as a VocabSpec JSON (the fields of turbospark::VocabSpec
in src/formats/tokenizer.h), which tests load instead of the multi-megabyte model.

  pip install gguf==0.19.0   # (any version that reads the file)
  python3 tools/tokenizer/vocab_from_gguf.py MODEL.gguf OUT.json [--source NAME]

JSON fields: model, pre ("" if absent), tokens, scores (omitted if absent), token_types
(omitted if absent), merges (omitted if absent), bos/eos/unk/pad/eot/eom (-1 if absent),
add_bos/add_eos/add_space_prefix (null if absent), name and architecture (general.name and
general.architecture, "" if absent), source (the file name, for messages).
The reverse, a vocabulary-only GGUF from such a JSON, is write_vocab_gguf() below (used by
make_vocab_expected.py to let llama.cpp tokenize hand-made vocabularies).
"""
import argparse
import json
import os
import sys

ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
}
FLAG_KEYS = {
    "add_bos": "tokenizer.ggml.add_bos_token",
    "add_eos": "tokenizer.ggml.add_eos_token",
    "add_space_prefix": "tokenizer.ggml.add_space_prefix",
}


def _contents(fields, key):
    field = fields.get(key)
    return None if field is None else field.contents()


def vocab_from_gguf(path, source=None):
    import gguf

    reader = gguf.GGUFReader(path)
    fields = reader.fields
    spec = {
        "model": _contents(fields, "tokenizer.ggml.model"),
        "pre": _contents(fields, "tokenizer.ggml.pre") or "",
        "tokens": _contents(fields, "tokenizer.ggml.tokens"),
    }
    if spec["model"] is None or spec["tokens"] is None:
        sys.exit(f"{path}: no tokenizer.ggml.model / tokenizer.ggml.tokens")
    for name, key in (("scores", "tokenizer.ggml.scores"), ("token_types", "tokenizer.ggml.token_type"),
                      ("merges", "tokenizer.ggml.merges")):
        value = _contents(fields, key)
        if value is not None:
            spec[name] = value
    if "scores" in spec:
        # Scores are float32 in the file; print them as such (the shortest repr that round-trips).
        import numpy as np
        spec["scores"] = [float(np.float32(s)) for s in spec["scores"]]
    for name, key in ID_KEYS.items():
        value = _contents(fields, key)
        spec[name] = -1 if value is None else int(value)
    for name, key in FLAG_KEYS.items():
        value = _contents(fields, key)
        spec[name] = None if value is None else bool(value)
    spec["name"] = _contents(fields, "general.name") or ""
    spec["architecture"] = _contents(fields, "general.architecture") or ""
    spec["source"] = source or os.path.basename(path)
    return spec


def write_vocab_gguf(spec, path):
    """A GGUF with only general.architecture and the tokenizer keys: enough for llama.cpp to
    load it with vocab_only (as llama-tokenize does)."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")  # vocab_only loading reads no hyperparameters
    if spec.get("name"):
        writer.add_name(spec["name"])
    writer.add_tokenizer_model(spec["model"])
    if spec.get("pre"):
        writer.add_tokenizer_pre(spec["pre"])
    writer.add_token_list(spec["tokens"])
    if "scores" in spec:
        writer.add_token_scores(spec["scores"])
    if "token_types" in spec:
        writer.add_token_types(spec["token_types"])
    if "merges" in spec:
        writer.add_token_merges(spec["merges"])
    for name, key in ID_KEYS.items():
        if spec.get(name, -1) >= 0:
            writer.add_uint32(key, spec[name])
    for name, key in FLAG_KEYS.items():
        if spec.get(name) is not None:
            writer.add_bool(key, spec[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf")
    parser.add_argument("out")
    parser.add_argument("--source", help="name recorded as the source (default: the file's base name)")
    args = parser.parse_args()
    spec = vocab_from_gguf(args.gguf, args.source)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
