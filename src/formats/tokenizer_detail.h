// Internals shared by the tokenizer's translation units: the interface both tokenizer kinds
// implement (Hugging Face tokenizer.json in tokenizer.cpp, llama.cpp-compatible GGUF
// vocabularies in tokenizer_gguf*.cpp) and the UTF-8 helpers they share. Not for use outside
// src/formats/tokenizer*.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "formats/tokenizer.h"

namespace turbospark {

// Immutable once built; one instance serves many threads.
struct Tokenizer::Impl {
  virtual ~Impl() = default;

  // `text` is valid UTF-8 (Tokenizer::encode checks it).
  virtual std::vector<int32_t> encode(std::string_view text, bool parse_special, bool add_special) const = 0;
  // Appends the bytes `id` stands for; nothing for an id outside the vocabulary or a special
  // token when skip_special. `first`: the id starts the sequence (llama.cpp strips one leading
  // space from the first piece of a vocabulary with add_space_prefix).
  virtual void append_piece(int32_t id, bool skip_special, bool first, std::string& bytes) const = 0;
  // Whether decoded bytes go through llama.cpp's clean_up_tokenization_spaces passes
  // (tokenizer_detail::clean_up_spaces).
  virtual bool cleans_spaces() const { return false; }

  virtual int32_t vocab_size() const = 0;
  virtual std::optional<int32_t> token_id(std::string_view token) const = 0;
  virtual std::string_view token_text(int32_t id) const = 0;
  virtual bool is_special(int32_t id) const = 0;

  std::optional<int32_t> eos_id, bos_id, pad_id, eot_id;
  std::vector<int32_t> end_of_generation_ids;  // sorted
};

namespace tokenizer_detail {

enum class Utf8Kind { kValid, kInvalid, kTruncated };

struct Utf8Step {
  size_t length;  // kInvalid: the maximal invalid subpart that one U+FFFD replaces
  Utf8Kind kind;
  char32_t code_point;
};

// Classifies the sequence at s[i] with the maximal-subpart rule of Rust's
// String::from_utf8_lossy.
Utf8Step utf8_step(std::string_view s, size_t i);
void append_utf8(std::string& out, char32_t cp);
// Byte offset of the first byte that is not valid UTF-8, or npos.
size_t utf8_first_invalid(std::string_view s);

// llama.cpp's detokenize clean-up (clean_spaces, on for most GPT-2-style pre-tokenizers),
// three passes over the bytes: drop a space before ? ! . , ; drop the spaces around a lone
// apostrophe (" ' "); drop the space before 's 'm 're 've. Only ASCII spaces are ever removed.
void clean_up_spaces(std::string& bytes);
// The largest p (0 < p < bytes.size()) at which clean_up_spaces(bytes[0, p)) followed by
// clean_up_spaces(bytes[p, end) + anything) equals clean_up_spaces of the whole, given that the
// bytes before `bytes` were cut the same way; 0 when there is none yet. Lets a stream emit text
// before it knows what follows.
size_t clean_up_spaces_safe_cut(std::string_view bytes);

// A BPE pre-tokenizer as llama.cpp runs it for one tokenizer.ggml.pre value, with the flags
// llama.cpp ties to that value (tokenizer_gguf_split.cpp).
struct GgufPreTokenizer {
  std::string_view name;        // llama.cpp's name for the pattern set ("gpt2", "llama3", ...)
  bool clean_spaces = true;     // detokenize runs clean_up_spaces
  bool ignore_merges = false;   // a word that is a token is taken whole
  bool add_bos = false;         // llama.cpp's add_bos default (the file's key overrides it)
  bool no_default_bos = false;  // no BOS id unless the file names one
  int index = 0;                // into the splitter table
};

// The pre-tokenizer for tokenizer.ggml.pre `pre` ("" = absent, which llama.cpp treats as
// "default"); throws Error naming `source` and the value when llama.cpp does not know it or
// its patterns are not implemented here.
const GgufPreTokenizer& find_gguf_pre_tokenizer(std::string_view pre, std::string_view source);
// Splits valid UTF-8 text into words as llama.cpp's unicode_regex_split does for `pre`, and
// appends each word mapped through GPT-2's byte alphabet (byte_encode).
void gguf_pre_tokenize(const GgufPreTokenizer& pre, std::string_view text, std::vector<std::string>& words);
// GPT-2's byte alphabet (the UTF-8 of the character each byte stands for), and back.
const std::string& gpt2_char_of_byte(uint8_t byte);
// The byte a GPT-2 alphabet character (one code point) stands for, or -1.
int gpt2_byte_of_char(char32_t cp);

}  // namespace tokenizer_detail
}  // namespace turbospark
