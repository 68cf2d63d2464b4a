// GGUF: header, metadata (every value type, nested arrays), tensor infos and their bounds,
// then what the loader reads from a valid-looking file: typed getters, the GGUF vocabulary, and
// the mapping onto transformers' tensor names and config (gguf_model.h).
#include <cstdint>
#include <memory>
#include <vector>
#include <nlohmann/json.hpp>

#include "formats/gguf.h"
#include "formats/gguf_model.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace turbospark;
  fuzz::MemFile f(data, size);
  fuzz::refusals_only([&] {
    GgufFile g(f.path());
    // GGUF strings are bytes (byte-level vocabularies hold tokens that are not UTF-8): JSON
    // output replaces what is not UTF-8, as every consumer of to_json() must.
    for (const auto& [key, value] : g.metadata())
      (void)value.to_json().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    for (const GgufTensor& t : g.tensors()) (void)t.numel(), (void)t.dims_str();
    fuzz::refusals_only([&] { (void)g.get_str_arr("tokenizer.ggml.tokens"); });
    fuzz::refusals_only([&] { (void)g.get_f32_arr("tokenizer.ggml.scores"); });
    fuzz::refusals_only([&] { (void)g.get_int_arr("tokenizer.ggml.token_type"); });
    fuzz::refusals_only([&] { (void)g.get_u32("general.alignment", 32); });
    // The mapping onto transformers' names and config (gpt-oss's MXFP4 repack included).
    fuzz::refusals_only([&] {
      std::vector<std::unique_ptr<uint8_t[]>> owned;
      (void)gguf_hf_tensors(g, owned);
    });
    fuzz::refusals_only([&] { (void)gguf_hf_config(g).dump(); });
  });
  return 0;
}
