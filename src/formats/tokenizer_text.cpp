// Unicode NFC normalization and Oniguruma-compatible regexes on PCRE2 for the tokenizer.json
// tokenizer (tokenizer.cpp); see tokenizer_text.h.
#include "formats/tokenizer_text.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "formats/tokenizer_detail.h"

namespace turbospark::tokenizer_detail {
namespace {

using Json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// NFC

struct NfcCccRange {
  char32_t first, last;
  uint8_t ccc;
};
struct NfcDecomposition {
  char32_t code_point, first, second;
  uint8_t composes;
};

#include "formats/tokenizer_nfc.inc"

constexpr char32_t kHangulSBase = 0xAC00, kHangulLBase = 0x1100, kHangulVBase = 0x1161,
                   kHangulTBase = 0x11A7;
constexpr char32_t kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28;
constexpr char32_t kHangulNCount = kHangulVCount * kHangulTCount;
constexpr char32_t kHangulSCount = kHangulLCount * kHangulNCount;

class Nfc {
 public:
  static const Nfc& tables() {
    static const Nfc instance;  // immutable after construction
    return instance;
  }

  // Returns the NFC form of valid UTF-8 text.
  std::string normalize(std::string_view text) const {
    // Below U+0300 nothing decomposes, combines or composes, and U+0300 starts with byte 0xCC:
    // most Latin text never leaves this path.
    if (std::all_of(text.begin(), text.end(),
                    [](char c) { return static_cast<unsigned char>(c) < 0xCC; })) {
      return std::string(text);
    }
    std::vector<char32_t> decomposed;
    decomposed.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
      const Utf8Step step = utf8_step(text, i);
      decompose(step.code_point, decomposed);
      i += step.length;
    }
    // Canonical ordering: stable sort each run of non-starters by combining class.
    for (size_t i = 1; i < decomposed.size(); ++i) {
      const uint8_t c = ccc(decomposed[i]);
      if (c == 0) continue;
      size_t j = i;
      while (j > 0) {
        const uint8_t p = ccc(decomposed[j - 1]);
        if (p == 0 || p <= c) break;
        std::swap(decomposed[j - 1], decomposed[j]);
        --j;
      }
    }
    // Canonical composition.
    std::vector<char32_t> composed;
    composed.reserve(decomposed.size());
    ptrdiff_t starter = -1;
    uint8_t last_ccc = 0;
    for (const char32_t cp : decomposed) {
      const uint8_t c = ccc(cp);
      if (starter >= 0) {
        const bool adjacent = static_cast<size_t>(starter) + 1 == composed.size();
        const bool blocked = !adjacent && (last_ccc == 0 || last_ccc >= c);
        if (!blocked) {
          if (const char32_t pair = compose(composed[starter], cp)) {
            composed[starter] = pair;
            continue;
          }
        }
      }
      if (c == 0) starter = static_cast<ptrdiff_t>(composed.size());
      composed.push_back(cp);
      last_ccc = c;
    }
    std::string out;
    out.reserve(text.size());
    for (const char32_t cp : composed) append_utf8(out, cp);
    return out;
  }

 private:
  Nfc() {
    for (const NfcDecomposition& d : kNfcDecompositions) {
      if (d.composes) compositions_.emplace(pair_key(d.first, d.second), d.code_point);
    }
  }

  static uint64_t pair_key(char32_t a, char32_t b) { return (uint64_t{a} << 32) | b; }

  static uint8_t ccc(char32_t cp) {
    if (cp < 0x300) return 0;
    const auto* end = std::end(kNfcCcc);
    const auto* it = std::lower_bound(std::begin(kNfcCcc), end, cp,
                                      [](const NfcCccRange& r, char32_t v) { return r.last < v; });
    return (it != end && it->first <= cp) ? it->ccc : 0;
  }

  static void decompose(char32_t cp, std::vector<char32_t>& out) {
    if (cp >= kHangulSBase && cp < kHangulSBase + kHangulSCount) {
      const char32_t s = cp - kHangulSBase;
      out.push_back(kHangulLBase + s / kHangulNCount);
      out.push_back(kHangulVBase + (s % kHangulNCount) / kHangulTCount);
      if (s % kHangulTCount) out.push_back(kHangulTBase + s % kHangulTCount);
      return;
    }
    if (cp >= 0xC0) {
      const auto* end = std::end(kNfcDecompositions);
      const auto* it = std::lower_bound(
          std::begin(kNfcDecompositions), end, cp,
          [](const NfcDecomposition& d, char32_t v) { return d.code_point < v; });
      if (it != end && it->code_point == cp) {
        decompose(it->first, out);
        if (it->second) decompose(it->second, out);
        return;
      }
    }
    out.push_back(cp);
  }

  char32_t compose(char32_t a, char32_t b) const {
    if (a >= kHangulLBase && a < kHangulLBase + kHangulLCount && b >= kHangulVBase &&
        b < kHangulVBase + kHangulVCount) {
      return kHangulSBase + ((a - kHangulLBase) * kHangulVCount + (b - kHangulVBase)) * kHangulTCount;
    }
    if (a >= kHangulSBase && a < kHangulSBase + kHangulSCount && (a - kHangulSBase) % kHangulTCount == 0 &&
        b > kHangulTBase && b < kHangulTBase + kHangulTCount) {
      return a + (b - kHangulTBase);
    }
    const auto it = compositions_.find(pair_key(a, b));
    return it == compositions_.end() ? 0 : it->second;
  }

  std::unordered_map<uint64_t, char32_t> compositions_;  // (first, second) -> primary composite
};

// ---------------------------------------------------------------------------------------------
// PCRE2

// Match data and JIT stack are per thread: a compiled pattern may be shared, these may not.
struct MatchScratch {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;

  MatchScratch() {
    // One pair is enough: only the whole match is read, and PCRE2 fills pair 0 even when the
    // pattern has more groups (it then returns 0).
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    // The default 32 KiB JIT stack can overflow on long whitespace runs with `\s+(?!\S)`.
    jit_stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
    if (!data || !context || !jit_stack) fail("tokenizer: out of memory allocating PCRE2 match data");
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  MatchScratch(const MatchScratch&) = delete;
  MatchScratch& operator=(const MatchScratch&) = delete;
};

MatchScratch& match_scratch() {
  thread_local MatchScratch scratch;
  return scratch;
}

// The library compiles patterns with Oniguruma; PCRE2 (with UTF + UCP) reads a few escapes
// differently, so they are rewritten into what Oniguruma means:
//   \s \S  Oniguruma: the White_Space property. PCRE2 also counts U+180E.
//   \w \W  Oniguruma: Alphabetic | Mark | Decimal_Number | Connector_Punctuation, plus (outside
//         a class only) the Latin-1 digits-like ¹ ² ³ ¼ ½ ¾. PCRE2 10.42: L | N | '_'.
//   \h \H  Oniguruma: a hex digit. PCRE2: horizontal whitespace.
//   \v     Oniguruma: the VT character. PCRE2: vertical whitespace.
// \W and \H inside a class, and nested classes (Oniguruma's set operations), cannot be
// rewritten and are refused; `where` names the file and field. (\b and \B keep PCRE2's idea of
// a word; no tokenizer pattern seen uses them.)
std::string rewrite_oniguruma_escapes(std::string_view pattern, const std::string& where) {
  static constexpr std::string_view kWordItems = R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc})";
  static constexpr std::string_view kLatin1WordItems = R"(\x{B2}\x{B3}\x{B9}\x{BC}-\x{BE})";
  std::string out;
  out.reserve(pattern.size() + 32);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      const auto refuse_in_class = [&] {
        if (in_class) fail("{}: \\{} inside a character class is not supported in {}", where, e, Json(std::string(pattern)).dump());
      };
      switch (e) {
        case 's': out += R"(\p{White_Space})"; break;
        case 'S': out += R"(\P{White_Space})"; break;
        case 'w': out += in_class ? std::string(kWordItems) : fmt::format("[{}{}]", kWordItems, kLatin1WordItems); break;
        case 'W': refuse_in_class(); out += fmt::format("[^{}{}]", kWordItems, kLatin1WordItems); break;
        case 'h': out += in_class ? "0-9a-fA-F" : "[0-9a-fA-F]"; break;
        case 'H': refuse_in_class(); out += "[^0-9a-fA-F]"; break;
        case 'v': out += R"(\x{0B})"; break;
        default:
          out += '\\';
          out += e;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' first in the class (after an optional '^') is a literal, as in both engines.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == '[' && in_class) {
      const size_t close = pattern.find(":]", i);
      if (i + 1 < pattern.size() && pattern[i + 1] == ':' && close != std::string_view::npos) {
        out += pattern.substr(i, close + 2 - i);  // POSIX class such as [:alpha:]
        i = close + 1;
        continue;
      }
      fail("{}: nested character classes (Oniguruma set operations) are not supported in {}", where,
           Json(std::string(pattern)).dump());
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

size_t utf8_char_length(std::string_view s, size_t i) { return utf8_step(s, i).length; }

std::string nfc_normalize(std::string_view text) { return Nfc::tables().normalize(text); }

Regex::Regex(std::string_view pattern, const std::string& where) {
  const std::string translated = rewrite_oniguruma_escapes(pattern, where);
  // Oniguruma's ^ and $ are line anchors and its lines end at LF only: MULTILINE with LF.
  pcre2_compile_context* context = pcre2_compile_context_create(nullptr);
  if (!context) fail("tokenizer: out of memory compiling a regex");
  pcre2_set_newline(context, PCRE2_NEWLINE_LF);
  int error = 0;
  PCRE2_SIZE offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                        PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &error, &offset, context);
  pcre2_compile_context_free(context);
  if (!code_) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    fail("{}: cannot compile regex {}: {} (at offset {})", where, Json(std::string(pattern)).dump(),
         reinterpret_cast<const char*>(message), offset);
  }
  // Without a JIT (unsupported CPU), PCRE2 falls back to its interpreter: slower, same result.
  pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
}

Regex::~Regex() { pcre2_code_free(code_); }

bool Regex::find(std::string_view subject, size_t from, size_t& start, size_t& end, uint32_t options) const {
  MatchScratch& scratch = match_scratch();
  const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), from,
                             options | PCRE2_NO_UTF_CHECK, scratch.data, scratch.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(rc, message, sizeof(message));
    fail("tokenizer: regex match failed on a {}-byte piece: {}", subject.size(),
         reinterpret_cast<const char*>(message));
  }
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(scratch.data);
  start = ovector[0];
  end = ovector[1];
  return true;
}

bool Regex::matches_at(std::string_view subject, size_t at) const {
  size_t start = 0, end = 0;
  return find(subject, at, start, end, PCRE2_ANCHORED);
}

std::string regex_escape(std::string_view literal) {
  std::string out;
  for (const char c : literal) {
    const auto b = static_cast<unsigned char>(c);
    if (b < 0x80 && !std::isalnum(b)) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace turbospark::tokenizer_detail
