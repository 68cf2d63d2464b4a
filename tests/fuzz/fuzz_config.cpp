// config.json through every family's hparams reader: the input is written as the config of a
// model folder whose weights are the tiny fixture of the family the config names (by
// model_type, qwen3's otherwise), and the model is loaded, so the reader, its checks against
// the checkpoint and the model's construction all see it.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "models/registry.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace turbospark;
  namespace fs = std::filesystem;
  static const fuzz::ScratchDir scratch("turbospark-fuzz-config");
  const fs::path& dir = scratch.path();
  const std::string config(reinterpret_cast<const char*>(data), size);
  std::string family = "qwen3";
  try {
    const auto j = nlohmann::json::parse(config);
    if (j.is_object() && j.contains("model_type") && j["model_type"].is_string()) family = j["model_type"];
  } catch (const nlohmann::json::exception&) {
  }
  static const fs::path fixtures = TS_SOURCE_DIR "/tests/data/fixtures";
  fs::path fixture = fixtures / "qwen3_tiny";
  for (const char* suffix : {"_tiny", "_moe_tiny", "_dense_tiny"}) {
    const fs::path p = fixtures / (family + suffix);
    if (family.find_first_of("/.") == std::string::npos && fs::exists(p / "config.json")) {
      fixture = p;
      break;
    }
  }
  // The fixture's weights (one file or shards and their index), linked.
  for (const auto& e : fs::directory_iterator(dir)) fs::remove(e.path());
  for (const auto& e : fs::directory_iterator(fixture)) {
    const std::string name = e.path().filename().string();
    if (name.find(".safetensors") != std::string::npos) fs::create_symlink(e.path(), dir / name);
  }
  {
    std::ofstream out(dir / "config.json", std::ios::binary | std::ios::trunc);
    out.write(config.data(), std::streamsize(config.size()));
  }
  fuzz::refusals_only([&] { (void)load_model(dir.string()); });
  return 0;
}
