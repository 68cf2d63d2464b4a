// model.safetensors.index.json: the input is written as the index of a folder holding the
// sharded MoE fixture's nine shards (linked) and its config, and the folder is opened as a
// checkpoint, so the index's JSON, its weight_map and the shard names it points at are all
// fed from here.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "formats/safetensors.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace turbospark;
  namespace fs = std::filesystem;
  static const fuzz::ScratchDir scratch("turbospark-fuzz-index");
  static const fs::path dir = [] {
    const fs::path& d = scratch.path();
    const fs::path fixture = TS_SOURCE_DIR "/tests/data/fixtures/qwen3_moe_tiny";
    for (const auto& e : fs::directory_iterator(fixture)) {
      const std::string name = e.path().filename().string();
      if (name.ends_with(".safetensors") || name == "config.json") fs::create_symlink(e.path(), d / name);
    }
    return d;
  }();
  {
    std::ofstream out(dir / "model.safetensors.index.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  }
  fuzz::refusals_only([&] {
    Checkpoint ck(dir.string());
    for (const auto& [name, t] : ck.all()) (void)name.size(), (void)t->nbytes;
  });
  return 0;
}
