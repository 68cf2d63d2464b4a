// The BPE pre-tokenizers of llama.cpp (llm_tokenizer_bpe's regex_exprs and unicode.cpp's
// unicode_regex_split) for the tokenizer.ggml.pre values of GGUF files.
//
// llama.cpp does not run its patterns through one regex engine. The common ones (GPT-2,
// Llama 3, Qwen2, Qwen3.5, newline runs) are hand-written matchers over its own Unicode
// category table, and the rest run through std::regex on a "collapsed" copy of the text in
// which every non-ASCII code point is replaced by one byte naming its category. Both disagree
// with the patterns as a real regex engine reads them (the hand-written \s+(?!\S) for one), so
// matching llama.cpp's ids means doing what it does: the matchers below follow its control
// flow, the categories come from the same Unicode version (15.1, tokenizer_llama_unicode.inc),
// and the few std::regex patterns needed are single character-class runs whose collapsed
// meaning is spelled out. Pre-tokenizers whose patterns need more of std::regex are refused
// by name.
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "core/error.h"
#include "formats/tokenizer_detail.h"

namespace turbospark::tokenizer_detail {

namespace {

// llama.cpp's unicode_cpt_flags: one category bit per code point, plus White_Space.
constexpr uint16_t kUndefined = 0x01;
constexpr uint16_t kNumber = 0x02;
constexpr uint16_t kLetter = 0x04;
constexpr uint16_t kSeparator = 0x08;
constexpr uint16_t kMark = 0x10;
constexpr uint16_t kPunctuation = 0x20;
constexpr uint16_t kSymbol = 0x40;
constexpr uint16_t kControl = 0x80;
constexpr uint16_t kWhitespace = 0x100;

struct LlamaCategoryRun {
  char32_t first;
  uint8_t category;
};

#include "formats/tokenizer_llama_unicode.inc"

// Unicode's White_Space property, which is what llama.cpp's \s means.
bool is_white_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

uint16_t code_point_flags(char32_t cp) {
  const auto* end = std::end(kLlamaCategoryRuns);
  const auto* run = std::upper_bound(std::begin(kLlamaCategoryRuns), end, cp,
                                     [](char32_t v, const LlamaCategoryRun& r) { return v < r.first; });
  const uint16_t category = run == std::begin(kLlamaCategoryRuns) ? kUndefined : (run - 1)->category;
  return category | (is_white_space(cp) ? kWhitespace : 0);
}

// llama.cpp's unicode_tolower, for the contraction checks only. Its lowercase table maps to
// the letters s t m d r e v l only from their ASCII capitals (checked against Unicode 15.1), so
// folding ASCII gives the same answers.
char32_t fold_ascii(char32_t cp) { return (cp >= 'A' && cp <= 'Z') ? cp + ('a' - 'A') : cp; }

constexpr char32_t kOutOfRange = 0xFFFFFFFF;

// One stretch of code points being split, with llama.cpp's out-of-range conventions: reading
// before or past it gives no code point and no flags (so "as_uint() != 0" means "in range").
class Stretch {
 public:
  Stretch(const std::vector<char32_t>& cps, const std::vector<uint16_t>& flags, size_t begin, size_t end,
          std::vector<size_t>& lengths)
      : cps_(cps), flags_(flags), begin_(begin), end_(end), lengths_(lengths), previous_end_(begin) {}

  size_t begin() const { return begin_; }
  size_t end() const { return end_; }
  char32_t cp(size_t pos) const { return pos >= begin_ && pos < end_ ? cps_[pos] : kOutOfRange; }
  uint16_t flags(size_t pos) const { return pos >= begin_ && pos < end_ ? flags_[pos] : 0; }
  // Ends the current word at `end` (nothing for an empty word).
  void end_word(size_t end) {
    if (end > previous_end_) lengths_.push_back(end - previous_end_);
    previous_end_ = end;
  }

 private:
  const std::vector<char32_t>& cps_;
  const std::vector<uint16_t>& flags_;
  size_t begin_, end_;
  std::vector<size_t>& lengths_;
  size_t previous_end_;
};

bool is_r_or_n(char32_t cp) { return cp == '\r' || cp == '\n'; }

// 's 't 'm 'd 're 've 'll at pos (case-insensitive unless `exact_case`); returns its length or 0.
size_t contraction_at(const Stretch& s, size_t pos, bool exact_case) {
  if (s.cp(pos) != '\'' || pos + 1 >= s.end()) return 0;
  const auto fold = [&](char32_t cp) { return exact_case ? cp : fold_ascii(cp); };
  const char32_t next = fold(s.cp(pos + 1));
  if (next == 's' || next == 't' || next == 'm' || next == 'd') return 2;
  if (pos + 2 >= s.end()) return 0;
  const char32_t after = fold(s.cp(pos + 2));
  if ((next == 'r' && after == 'e') || (next == 'v' && after == 'e') || (next == 'l' && after == 'l')) return 3;
  return 0;
}

// The whitespace alternatives shared by the matchers. With `newline_runs`, first
// \s*[\r\n]+ (up to the last CR/LF of the run). Then \s+(?!\S) as llama.cpp writes it: a run
// of two or more that does not reach the end gives back its last character; then \s+. With no
// whitespace at pos, one character alone.
void match_whitespace(Stretch& s, size_t pos, bool newline_runs, size_t& next) {
  size_t count = 0;
  size_t after_last_newline = 0;
  while (s.flags(pos + count) & kWhitespace) {
    if (is_r_or_n(s.cp(pos + count))) after_last_newline = pos + count + 1;
    ++count;
  }
  if (newline_runs && after_last_newline > 0) {
    next = after_last_newline;
  } else if (count > 1 && s.cp(pos + count) != kOutOfRange) {
    next = pos + count - 1;
  } else if (count > 0) {
    next = pos + count;
  } else {
    next = pos + 1;
  }
  s.end_word(next);
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
void split_gpt2(Stretch& s) {
  for (size_t pos = s.begin(); pos < s.end();) {
    const char32_t cp = s.cp(pos);
    if (const size_t n = contraction_at(s, pos, /*exact_case=*/true)) {
      pos += n;
      s.end_word(pos);
      continue;
    }
    // After an optional space, a run of letters, of numbers, or of anything else but space.
    uint16_t f = cp == ' ' ? s.flags(pos + 1) : s.flags(pos);
    const auto run = [&](auto&& in_class) {
      pos += cp == ' ';
      while (in_class(f)) f = s.flags(++pos);
      s.end_word(pos);
    };
    const auto letter = [](uint16_t x) { return (x & kLetter) != 0; };
    const auto number = [](uint16_t x) { return (x & kNumber) != 0; };
    const auto other = [](uint16_t x) { return !(x & (kWhitespace | kLetter | kNumber)) && x != 0; };
    if (letter(f)) {
      run(letter);
    } else if (number(f)) {
      run(number);
    } else if (other(f)) {
      run(other);
    } else {
      match_whitespace(s, pos, /*newline_runs=*/false, pos);
    }
  }
}

enum class LetterStyle { kLlama3, kQwen2, kQwen35 };

// Llama 3 (numbers in threes), Qwen2 (numbers one by one) and Qwen3.5 (Qwen2 with marks
// counted as letters):
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
// \s*[\r\n]+|\s+(?!\S)|\s+
void split_llama3_family(Stretch& s, LetterStyle style) {
  const uint16_t letters = style == LetterStyle::kQwen35 ? (kLetter | kMark) : kLetter;
  for (size_t pos = s.begin(); pos < s.end();) {
    const char32_t cp = s.cp(pos);
    const uint16_t f = s.flags(pos);
    if (const size_t n = contraction_at(s, pos, /*exact_case=*/false)) {
      pos += n;
      s.end_word(pos);
      continue;
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+ : this character (letter or not) and the letters after it.
    if (!is_r_or_n(cp) && !(f & kNumber) && ((f & letters) || (s.flags(pos + 1) & letters))) {
      ++pos;
      while (s.flags(pos) & letters) ++pos;
      s.end_word(pos);
      continue;
    }
    if (f & kNumber) {
      if (style == LetterStyle::kLlama3) {
        size_t group_start = pos;
        while (s.flags(pos) & kNumber) {
          if (++pos - group_start >= 3) {
            s.end_word(pos);
            group_start = pos;
          }
        }
        s.end_word(pos);
      } else {
        s.end_word(++pos);
      }
      continue;
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`; llama.cpp tests the first character's own flags for being in
    // range, not the one after the space.
    uint16_t f2 = cp == ' ' ? s.flags(pos + 1) : f;
    const auto other = [&](uint16_t x) { return !(x & (kWhitespace | letters | kNumber)); };
    if (other(f2) && f != 0) {
      pos += cp == ' ';
      while (other(f2) && f2 != 0) f2 = s.flags(++pos);
      while (is_r_or_n(s.cp(pos))) ++pos;
      s.end_word(pos);
      continue;
    }
    match_whitespace(s, pos, /*newline_runs=*/true, pos);
  }
}

// GPT-4o's pattern (tokenizer.ggml.pre "gpt-4o", "llama4", ...) as llama.cpp runs it: through
// std::regex (ECMAScript: leftmost, alternatives in order, greedy with backtracking) on the
// collapsed text, in its lookahead form
//   [^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?
//  |[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:...)?
//  |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
// Collapsed, every non-ASCII letter is one byte outside [a-z] and [A-Z], so it counts as both
// an "upper" letter (a letter not in a-z) and a "lower" one (a letter not in A-Z), and marks are
// not letters. Every position starts a match, so the words tile the text.
void split_gpt4o(Stretch& s) {
  const auto in = [&](size_t pos) { return pos >= s.begin() && pos < s.end(); };
  const auto flags_of = [&](size_t pos) { return s.flags(pos) & ~kWhitespace; };
  const auto space = [&](size_t pos) { return in(pos) && (s.flags(pos) & kWhitespace); };
  const auto wide_letter = [&](size_t pos) {
    return in(pos) && s.cp(pos) >= 0x80 && !space(pos) && (flags_of(pos) & kLetter);
  };
  const auto upper = [&](size_t pos) { return (in(pos) && s.cp(pos) >= 'A' && s.cp(pos) <= 'Z') || wide_letter(pos); };
  const auto lower = [&](size_t pos) { return (in(pos) && s.cp(pos) >= 'a' && s.cp(pos) <= 'z') || wide_letter(pos); };
  const auto letter = [&](size_t pos) { return upper(pos) || lower(pos); };
  const auto number = [&](size_t pos) {
    if (!in(pos)) return false;
    const char32_t cp = s.cp(pos);
    return cp < 0x80 ? (cp >= '0' && cp <= '9') : (!space(pos) && (flags_of(pos) & kNumber));
  };
  // [^\r\n\p{L}\p{N}] and [^\s\p{L}\p{N}]
  const auto prefix = [&](size_t pos) { return in(pos) && !is_r_or_n(s.cp(pos)) && !letter(pos) && !number(pos); };
  const auto other = [&](size_t pos) { return in(pos) && !space(pos) && !letter(pos) && !number(pos); };
  const auto contraction = [&](size_t pos) { return in(pos) ? contraction_at(s, pos, /*exact_case=*/false) : 0; };
  for (size_t pos = s.begin(); pos < s.end();) {
    const size_t start = prefix(pos) && letter(pos + 1) ? pos + 1 : pos;  // the optional prefix, taken when it helps
    if (letter(start)) {
      // First alternative: upper* then lower+, backing off the upper run one at a time.
      size_t u = 0;
      while (upper(start + u)) ++u;
      size_t end = 0;
      for (size_t k = u + 1; k-- > 0;) {
        if (lower(start + k)) {
          end = start + k;
          while (lower(end)) ++end;
          break;
        }
      }
      if (end == 0) {
        // Second alternative: upper+ then lower* (the upper run is not empty: a letter that is
        // not lower is upper).
        end = start + u;
        while (lower(end)) ++end;
      }
      end += contraction(end);
      s.end_word(pos = end);
      continue;
    }
    if (number(pos)) {
      size_t n = 1;
      while (n < 3 && number(pos + n)) ++n;
      s.end_word(pos += n);
      continue;
    }
    const size_t o = s.cp(pos) == ' ' && other(pos + 1) ? pos + 1 : pos;
    if (other(o)) {
      size_t end = o;
      while (other(end)) ++end;
      while (in(end) && (is_r_or_n(s.cp(end)) || s.cp(end) == '/')) ++end;
      s.end_word(pos = end);
      continue;
    }
    match_whitespace(s, pos, /*newline_runs=*/true, pos);
  }
}

// [^\n]+|[\n]+
void split_newline_runs(Stretch& s) {
  for (size_t pos = s.begin(); pos < s.end();) {
    const bool newline = s.cp(pos) == '\n';
    while (pos < s.end() && (s.cp(pos) == '\n') == newline) ++pos;
    s.end_word(pos);
  }
}

// The std::regex patterns llama.cpp runs on the collapsed text that are needed here: all are
// one character class repeated {min,max}. A non-ASCII code point is in \p{N} or \p{P} when its
// collapsed byte is that category's (whitespace collapses to \v first, so never); an ASCII one
// when the pattern's ASCII set for the category has it.
enum class CharClass {
  kNumber,             // \p{N}: 0-9 and non-ASCII numbers
  kPunctuation,        // [\p{P}\$\+<=>\^~\|]: llama.cpp's ASCII \p{P} plus $+<=>^~|
  kPunctuationFalcon,  // [\p{P}\$\+<=>\^~\|`]
  kAsciiDigit,         // [0-9] (a pattern with no \p, run on the code points)
};

bool in_class(CharClass c, char32_t cp, uint16_t flags) {
  // The ASCII characters llama.cpp's collapsed \p{P} stands for: !-#%-*,-/:-;?-@\[-\]_\{\}
  static constexpr std::string_view kAsciiPunctuation = "!\"#%&'()*,-./:;?@[\\]_{}";
  switch (c) {
    case CharClass::kNumber:
      return cp < 0x80 ? (cp >= '0' && cp <= '9') : (flags & (kNumber | kWhitespace)) == kNumber;
    case CharClass::kPunctuation:
    case CharClass::kPunctuationFalcon:
      if (cp < 0x80) {
        const char ch = static_cast<char>(cp);
        return kAsciiPunctuation.find(ch) != std::string_view::npos ||
               std::string_view("$+<=>^~|").find(ch) != std::string_view::npos ||
               (c == CharClass::kPunctuationFalcon && ch == '`');
      }
      return (flags & (kPunctuation | kWhitespace)) == kPunctuation;
    case CharClass::kAsciiDigit:
      return cp >= '0' && cp <= '9';
  }
  return false;
}

// std::regex_iterator over `class{min,max}` (max 0: unbounded): leftmost greedy matches, the
// text between them kept as words too.
void split_class_runs(Stretch& s, CharClass c, size_t min, size_t max) {
  size_t pos = s.begin();
  while (pos < s.end()) {
    size_t run = 0;
    while (pos + run < s.end() && in_class(c, s.cp(pos + run), s.flags(pos + run))) ++run;
    if (run == 0) {
      ++pos;
      continue;
    }
    // A run too short to match cannot match from any later start inside it either.
    while (run >= min) {
      const size_t take = max ? std::min(run, max) : run;
      s.end_word(pos);  // the text before the match
      pos += take;
      run -= take;
      s.end_word(pos);
    }
    pos += run;
  }
  s.end_word(s.end());
}

enum class Split {
  kGpt2,
  kLlama3,
  kQwen2,
  kQwen35,
  kGpt4o,
  kNewlineRuns,
  kNumbersEach,        // \p{N}
  kNumbersRun,         // \p{N}+
  kPunctuationRun,     // [\p{P}\$\+<=>\^~\|]+
  kPunctuationFalcon,  // [\p{P}\$\+<=>\^~\|`]+
  kAsciiDigitTriples,  // [0-9][0-9][0-9]
};

void apply_split(Split split, Stretch& s) {
  switch (split) {
    case Split::kGpt2: return split_gpt2(s);
    case Split::kLlama3: return split_llama3_family(s, LetterStyle::kLlama3);
    case Split::kQwen2: return split_llama3_family(s, LetterStyle::kQwen2);
    case Split::kQwen35: return split_llama3_family(s, LetterStyle::kQwen35);
    case Split::kGpt4o: return split_gpt4o(s);
    case Split::kNewlineRuns: return split_newline_runs(s);
    case Split::kNumbersEach: return split_class_runs(s, CharClass::kNumber, 1, 1);
    case Split::kNumbersRun: return split_class_runs(s, CharClass::kNumber, 1, 0);
    case Split::kPunctuationRun: return split_class_runs(s, CharClass::kPunctuation, 1, 0);
    case Split::kPunctuationFalcon: return split_class_runs(s, CharClass::kPunctuationFalcon, 1, 0);
    case Split::kAsciiDigitTriples: return split_class_runs(s, CharClass::kAsciiDigit, 3, 3);
  }
}

// llama.cpp's regex_exprs lists, by the LLAMA_VOCAB_PRE_TYPE they belong to.
struct SplitterSet {
  std::string_view name;
  std::vector<Split> splits;
};

const std::vector<SplitterSet>& splitter_sets() {
  static const std::vector<SplitterSet> sets = {
      {"default", {Split::kPunctuationRun, Split::kGpt2, Split::kNumbersRun, Split::kAsciiDigitTriples}},  // 0
      {"gpt2", {Split::kGpt2}},                                                                          // 1
      {"llama3", {Split::kLlama3}},                                                                      // 2
      {"qwen2", {Split::kQwen2}},                                                                        // 3
      {"qwen35", {Split::kQwen35}},                                                                      // 4
      {"starcoder", {Split::kNumbersEach, Split::kGpt2}},                                                // 5
      {"falcon", {Split::kPunctuationFalcon, Split::kGpt2, Split::kAsciiDigitTriples}},                  // 6
      {"gpt4o", {Split::kGpt4o}},                                                                        // 7
  };
  return sets;
}

struct PreEntry {
  std::vector<std::string_view> names;  // tokenizer.ggml.pre values
  GgufPreTokenizer pre;
};

// llama_vocab::impl::load's tokenizer_pre branches, for the pattern sets above.
const std::vector<PreEntry>& pre_entries() {
  const auto entry = [](std::vector<std::string_view> names, int set, bool clean_spaces, bool ignore_merges = false,
                        bool add_bos = false, bool no_default_bos = false) {
    GgufPreTokenizer pre;
    pre.name = splitter_sets()[set].name;
    pre.index = set;
    pre.clean_spaces = clean_spaces;
    pre.ignore_merges = ignore_merges;
    pre.add_bos = add_bos;
    pre.no_default_bos = no_default_bos;
    return PreEntry{std::move(names), pre};
  };
  static const std::vector<PreEntry> entries = {
      entry({"", "default"}, 0, true),
      entry({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
             "jina-v5-nano"},
            2, true, /*ignore_merges=*/true, /*add_bos=*/true),
      entry({"dbrx", "smaug-bpe"}, 2, true),
      entry({"chatglm-bpe"}, 2, true, false, false, /*no_default_bos=*/true),
      entry({"glm4", "glm5"}, 2, true, /*ignore_merges=*/true, false, /*no_default_bos=*/true),
      entry({"falcon"}, 6, true),
      entry({"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
             "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "exaone4"},
            1, true),
      entry({"trillion", "granite-docling"}, 1, false),
      entry({"starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"}, 5, true),
      entry({"command-r", "smollm"}, 5, false),
      entry({"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2"}, 3, false),
      entry({"stablelm2", "megrez"}, 3, true),
      entry({"qwen35"}, 4, false),
      entry({"gpt-4o", "llama4", "kanana2", "talkie"}, 7, false),
  };
  return entries;
}

// tokenizer.ggml.pre values llama.cpp knows whose patterns are not implemented here.
constexpr std::string_view kKnownUnsupported[] = {
    "minicpm5", "deepseek-llm", "deepseek-coder", "deepseek-v3", "spark2_5", "youtu", "jais-2", "gemma4",
    "granite-embed-multi-311m", "sarvam-moe", "whitespace", "poro-chat", "viking", "tekken", "bloom",
    "gpt3-finnish", "exaone-moe", "chameleon", "granite-embed-multi-97m",
    "tiny_aya", "cohere2moe", "superbpe", "bailingmoe", "bailingmoe2", "llada-moe", "seed-coder", "hunyuan-dense",
    "hy_v4", "joyai-llm", "kimi-k2", "ufakzeka", "afmoe", "laguna", "minimax-m2"};

}  // namespace

const GgufPreTokenizer& find_gguf_pre_tokenizer(std::string_view pre, std::string_view source) {
  for (const PreEntry& e : pre_entries()) {
    if (std::find(e.names.begin(), e.names.end(), pre) != e.names.end()) return e.pre;
  }
  const bool known = std::find(std::begin(kKnownUnsupported), std::end(kKnownUnsupported), pre) !=
                     std::end(kKnownUnsupported);
  fail("{}: tokenizer.ggml.pre \"{}\" is {}; supported: default, gpt-2, llama3/llama-bpe, qwen2, qwen35, smollm, "
       "starcoder, falcon, stablelm2, command-r, olmo, mpt, dbrx, chatglm-bpe, glm4, gpt-4o and their aliases",
       source, pre,
       known ? "a llama.cpp pre-tokenizer whose patterns turbospark does not implement"
             : "not a pre-tokenizer llama.cpp knows");
}

void gguf_pre_tokenize(const GgufPreTokenizer& pre, std::string_view text, std::vector<std::string>& words) {
  std::vector<char32_t> cps;
  std::vector<uint32_t> byte_offsets;  // [cps.size() + 1] start of each code point in `text`
  cps.reserve(text.size());
  byte_offsets.reserve(text.size() + 1);
  for (size_t i = 0; i < text.size();) {
    const Utf8Step step = utf8_step(text, i);
    cps.push_back(step.code_point);
    byte_offsets.push_back(static_cast<uint32_t>(i));
    i += step.length;
  }
  byte_offsets.push_back(static_cast<uint32_t>(text.size()));
  std::vector<uint16_t> flags(cps.size());
  for (size_t i = 0; i < cps.size(); ++i) flags[i] = code_point_flags(cps[i]);

  // Word lengths in code points; each split refines every word of the previous one.
  std::vector<size_t> lengths{cps.size()}, next;
  for (const Split split : splitter_sets()[pre.index].splits) {
    next.clear();
    size_t start = 0;
    for (const size_t length : lengths) {
      Stretch stretch(cps, flags, start, start + length, next);
      apply_split(split, stretch);
      start += length;
    }
    lengths.swap(next);
  }
  size_t start = 0;
  for (const size_t length : lengths) {
    std::string& word = words.emplace_back();
    for (uint32_t b = byte_offsets[start]; b < byte_offsets[start + length]; ++b) {
      word += gpt2_char_of_byte(static_cast<uint8_t>(text[b]));
    }
    start += length;
  }
}

}  // namespace turbospark::tokenizer_detail
