// safetensors: the 8-byte header length, the JSON header (dtypes, shapes, offsets, overlaps,
// bounds, __metadata__) and every tensor's view of the data.
#include <cstdint>

#include "formats/safetensors.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace turbospark;
  fuzz::MemFile f(data, size);
  fuzz::refusals_only([&] {
    SafetensorsFile s(f.path());
    for (const auto& [name, t] : s.tensors()) (void)name.size(), (void)t.numel();
  });
  return 0;
}
