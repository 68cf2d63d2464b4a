// tokenizer.json: loading (model, normalizer, pre-tokenizer, decoder, added tokens), then
// encode of the text after the first NUL byte (with and without special tokens) and decode
// of what came out, of the text's bytes read as ids, and streaming decode.
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "formats/tokenizer.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace turbospark;
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const size_t nul = all.find('\0');
  const std::string_view json = all.substr(0, nul), text = nul == all.npos ? std::string_view() : all.substr(nul + 1);
  fuzz::refusals_only([&] {
    const Tokenizer tok = Tokenizer::from_json(json, "fuzz/tokenizer.json");
    const std::vector<int32_t> ids = tok.encode(text, /*parse_special=*/true, /*add_special=*/true);
    (void)tok.decode(ids);
    (void)tok.encode(text, /*parse_special=*/false, /*add_special=*/false);
    // Arbitrary ids, in and out of range: out of range must be refused, not read.
    std::vector<int32_t> raw(text.size() / 4);
    std::memcpy(raw.data(), text.data(), raw.size() * 4);
    (void)tok.decode(raw, /*skip_special=*/true);
  });
  return 0;
}
