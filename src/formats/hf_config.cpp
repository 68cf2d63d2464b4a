#include "formats/hf_config.h"

#include <filesystem>

#include "core/error.h"
#include "core/mapped_file.h"

namespace turbospark {

using nlohmann::json;

HfConfig HfConfig::load(const std::string& model_dir) {
  std::string path = (std::filesystem::path(model_dir) / "config.json").string();
  if (!file_exists(path)) fail("{}: missing config.json (is this a Hugging Face model directory?)", path);
  json j;
  try {
    j = json::parse(read_text_file(path));
  } catch (const json::exception& e) {
    fail("{}: malformed JSON: {}", path, e.what());
  }
  return from_json(std::move(j), path);
}

HfConfig HfConfig::from_json(json root, std::string path) {
  if (!root.is_object()) fail("{}: config is not a JSON object", path);
  HfConfig c;
  c.path_ = std::move(path);
  c.root_ = std::move(root);
  return c;
}

static const json& text_of(const json& root) {
  auto it = root.find("text_config");
  if (it != root.end() && it->is_object()) return *it;
  return root;
}

const json& HfConfig::text() const { return text_of(root_); }

std::string HfConfig::architecture() const {
  auto it = root_.find("architectures");
  if (it != root_.end() && it->is_array() && !it->empty() && (*it)[0].is_string()) return (*it)[0].get<std::string>();
  return "";
}

std::string HfConfig::model_type() const {
  const json& t = text_of(root_);
  if (t.contains("model_type") && t["model_type"].is_string()) return t["model_type"].get<std::string>();
  if (root_.contains("model_type") && root_["model_type"].is_string()) return root_["model_type"].get<std::string>();
  return "";
}

bool HfConfig::has(const std::string& name) const {
  const json& t = text_of(root_);
  return t.contains(name) && !t[name].is_null();
}

int64_t HfConfig::get_int(const std::string& name) const {
  const json& t = text_of(root_);
  if (!t.contains(name) || t[name].is_null()) fail("{}: missing field {}", path_, name);
  if (!t[name].is_number_integer()) fail("{}: field {} must be an integer, got {}", path_, name, t[name].dump());
  return t[name].get<int64_t>();
}

int64_t HfConfig::get_int(const std::string& name, int64_t fallback) const {
  return has(name) ? get_int(name) : fallback;
}

double HfConfig::get_float(const std::string& name) const {
  const json& t = text_of(root_);
  if (!t.contains(name) || t[name].is_null()) fail("{}: missing field {}", path_, name);
  if (!t[name].is_number()) fail("{}: field {} must be a number, got {}", path_, name, t[name].dump());
  return t[name].get<double>();
}

double HfConfig::get_float(const std::string& name, double fallback) const {
  return has(name) ? get_float(name) : fallback;
}

bool HfConfig::get_bool(const std::string& name, bool fallback) const {
  if (!has(name)) return fallback;
  const json& v = text_of(root_)[name];
  if (!v.is_boolean()) fail("{}: field {} must be true or false, got {}", path_, name, v.dump());
  return v.get<bool>();
}

std::string HfConfig::get_string(const std::string& name, const std::string& fallback) const {
  if (!has(name)) return fallback;
  const json& v = text_of(root_)[name];
  if (!v.is_string()) fail("{}: field {} must be a string, got {}", path_, name, v.dump());
  return v.get<std::string>();
}

std::vector<int64_t> HfConfig::get_int_list(const std::string& name) const {
  std::vector<int64_t> out;
  if (!has(name)) return out;
  const json& v = text_of(root_)[name];
  if (!v.is_array()) fail("{}: field {} must be a list of integers, got {}", path_, name, v.dump());
  for (const auto& e : v) {
    if (!e.is_number_integer()) fail("{}: field {} must be a list of integers, got {}", path_, name, v.dump());
    out.push_back(e.get<int64_t>());
  }
  return out;
}

std::vector<int64_t> HfConfig::get_id_list(const std::string& name) const {
  if (!has(name)) {
    // generation-related ids sometimes live only at the top level of multimodal configs
    if (root_.contains(name) && root_[name].is_number_integer()) return {root_[name].get<int64_t>()};
    return {};
  }
  const json& v = text_of(root_)[name];
  if (v.is_number_integer()) return {v.get<int64_t>()};
  return get_int_list(name);
}

double HfConfig::rope_theta(double fallback) const {
  const json& t = text_of(root_);
  auto rp = t.find("rope_parameters");
  if (rp != t.end() && rp->is_object() && rp->contains("rope_theta")) {
    const json& v = (*rp)["rope_theta"];
    if (!v.is_number()) fail("{}: field rope_parameters.rope_theta must be a number", path_);
    return v.get<double>();
  }
  return get_float("rope_theta", fallback);
}

std::string HfConfig::rope_type() const {
  const json& t = text_of(root_);
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    auto rp = t.find(key);
    if (rp == t.end() || !rp->is_object()) continue;
    for (const char* field : {"rope_type", "type"}) {
      if (rp->contains(field) && (*rp)[field].is_string()) return (*rp)[field].get<std::string>();
    }
  }
  return "default";
}

}  // namespace turbospark
