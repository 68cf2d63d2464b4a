// Text machinery of the tokenizer.json tokenizer: Unicode NFC normalization and regexes with
// Oniguruma's meaning run on PCRE2 (tokenizer_text.cpp). Not for use outside
// src/formats/tokenizer*.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

struct pcre2_real_code_8;

namespace turbospark::tokenizer_detail {

// Length in bytes of the UTF-8 step at s[i] (an invalid subpart counts as one step).
size_t utf8_char_length(std::string_view s, size_t i);

// The NFC form of valid UTF-8 text (tables from the Unicode data in tokenizer_nfc.inc).
std::string nfc_normalize(std::string_view text);

// A compiled pattern; immutable and shared by threads (match data is per thread).
class Regex {
 public:
  // `where` names the file and field in errors.
  Regex(std::string_view pattern, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // First match at or after `from`; subject must be valid UTF-8 (checked once by encode()).
  // `options` are PCRE2 match options (matches_at passes PCRE2_ANCHORED).
  bool find(std::string_view subject, size_t from, size_t& start, size_t& end, uint32_t options = 0) const;

  // Whether the pattern matches at exactly `at`.
  bool matches_at(std::string_view subject, size_t at) const;

  // Visits matches as the onig crate's find_iter does (the library's SysRegex): an empty match
  // right where the previous match ended is skipped by advancing one character.
  template <typename Visit>
  void for_each_match(std::string_view subject, Visit&& visit) const {
    size_t from = 0;
    bool have_last = false;
    size_t last_match_end = 0;
    while (from <= subject.size()) {
      size_t start = 0, end = 0;
      if (!find(subject, from, start, end)) return;
      if (start == end && have_last && last_match_end == end) {
        if (from >= subject.size()) return;
        from += utf8_char_length(subject, from);
        continue;
      }
      from = end;
      have_last = true;
      last_match_end = end;
      visit(start, end);
    }
  }

 private:
  pcre2_real_code_8* code_ = nullptr;
};

// Escapes a literal for PCRE2: a backslash before any ASCII punctuation is a literal.
std::string regex_escape(std::string_view literal);

}  // namespace turbospark::tokenizer_detail
