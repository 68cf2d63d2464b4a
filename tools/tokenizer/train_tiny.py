#!/usr/bin/env python3
"""Train the tiny byte-level BPE tokenizers used as test fixtures, with the `tokenizers` library.

  tests/data/tiny_tokenizer/tokenizer.json (+ tokenizer_config.json)
      Qwen2/Qwen3 layout: NFC normalizer, Split(Qwen's regex, Isolated) then ByteLevel
      (add_prefix_space=false, use_regex=false), BPE, ByteLevel decoder and post-processor.
      Vocabulary of exactly 512 ids: 0..255 are the 256 byte characters, 256..508 are merges,
      and the special tokens come last, as in Qwen: 509 <|endoftext|>, 510 <|im_start|>,
      511 <|im_end|>. tokenizer_config.json names eos_token <|im_end|> and pad_token
      <|endoftext|>. It ships with the tiny random test checkpoints of vocab 512.

  tests/data/tokenizer/gpt2_style/tokenizer.json
      GPT-2 layout: no normalizer, ByteLevel pre-tokenizer with add_prefix_space=true and
      use_regex=true, merges written in the legacy "a b" string form. Beyond GPT-2 it sets
      ignore_merges (as Llama 3 does), has a TemplateProcessing post-processor that prepends
      <|endoftext|> (as Llama 3 prepends its BOS), and added tokens that exercise lstrip
      (<mask>), rstrip ([rs]) and single_word + normalized (hello).

Both are trained on the English part of the corpus (tests/data/tokenizer/corpus.jsonl lines that
are pure ASCII). Training is deterministic (single-threaded, fixed input order); run twice and
compare to check. Usage, from the repository root, with tokenizers==0.23.3:
  python3 tools/tokenizer/train_tiny.py
then regenerate the expected ids: python3 tools/tokenizer/make_expected.py expected
"""
import json
import os
import sys
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # set before the library starts its thread pool
os.environ["RAYON_NUM_THREADS"] = "1"

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "data" / "tokenizer" / "corpus.jsonl"
TINY = ROOT / "tests" / "data" / "tiny_tokenizer"
GPT2_STYLE = ROOT / "tests" / "data" / "tokenizer" / "gpt2_style"

# Qwen2/Qwen3's pre-tokenizer pattern, as in their tokenizer.json.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 512


def english_texts() -> list:
    with open(CORPUS, encoding="utf-8") as f:
        texts = [json.loads(line) for line in f if not line.startswith("#")]
    return [t for t in texts if t and all(ord(c) < 0x80 for c in t)]


def save(tok: Tokenizer, path: Path, patch=None) -> dict:
    data = json.loads(tok.to_str())
    if patch:
        patch(data)
    text = json.dumps(data, ensure_ascii=False, indent=2) + "\n"
    Tokenizer.from_str(text)  # the patched file must still load
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)} ({len(text)} bytes)")
    return data


def train_tiny(texts: list) -> None:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - len(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != TINY_VOCAB - len(SPECIALS):
        sys.exit(f"training gave {tok.get_vocab_size()} tokens, expected {TINY_VOCAB - len(SPECIALS)}")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    if tok.get_vocab_size() != TINY_VOCAB:
        sys.exit(f"vocab size {tok.get_vocab_size()}, expected {TINY_VOCAB}")

    def patch(data):
        # Spell the ByteLevel decoder and post-processor exactly as Qwen's tokenizer.json does.
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        data["decoder"] = dict(byte_level)
        data["post_processor"] = dict(byte_level)

    data = save(tok, TINY / "tokenizer.json", patch)
    ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    assert [ids[s] for s in SPECIALS] == [509, 510, 511], ids
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for s in SPECIALS
        },
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    path = TINY / "tokenizer_config.json"
    path.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)}")


def train_gpt2_style(texts: list) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B",
                                      special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))]),
    ])
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True, normalized=False)])
    tok.add_tokens([AddedToken("[rs]", rstrip=True, special=False, normalized=False),
                    AddedToken("hello", single_word=True, special=False, normalized=True)])

    def patch(data):
        model = data["model"]
        model["ignore_merges"] = True
        model["merges"] = [f"{a} {b}" for a, b in model["merges"]]

    save(tok, GPT2_STYLE / "tokenizer.json", patch)


def main() -> None:
    texts = english_texts()
    print(f"training on {len(texts)} ASCII texts")
    train_tiny(texts)
    train_gpt2_style(texts)


if __name__ == "__main__":
    main()
