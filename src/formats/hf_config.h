// Hugging Face config.json access with errors that name the file and the field. For
// multimodal checkpoints the text model's fields live under "text_config"; text() returns
// that object when present so families read the same field names either way.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace turbospark {

class HfConfig {
 public:
  static HfConfig load(const std::string& model_dir);  // reads model_dir/config.json
  static HfConfig from_json(nlohmann::json root, std::string path);

  const std::string& path() const { return path_; }
  const nlohmann::json& root() const { return root_; }
  // The text model's config: root["text_config"] when present, else root.
  const nlohmann::json& text() const;

  std::string architecture() const;  // architectures[0], or "" when absent
  std::string model_type() const;    // text model_type, else root model_type

  // Typed reads of text() fields. The required forms throw "PATH: field NAME ..." when the
  // field is missing or of the wrong type.
  int64_t get_int(const std::string& name) const;
  int64_t get_int(const std::string& name, int64_t fallback) const;
  double get_float(const std::string& name) const;
  double get_float(const std::string& name, double fallback) const;
  bool get_bool(const std::string& name, bool fallback) const;
  std::string get_string(const std::string& name, const std::string& fallback) const;
  std::vector<int64_t> get_int_list(const std::string& name) const;  // [] when absent
  bool has(const std::string& name) const;
  // An int or a list of ints (eos_token_id); [] when absent or null.
  std::vector<int64_t> get_id_list(const std::string& name) const;
  // RoPE theta from rope_parameters.rope_theta or the legacy rope_theta.
  double rope_theta(double fallback) const;
  // rope_parameters.rope_type (or legacy rope_scaling.rope_type/type), "default" if absent.
  std::string rope_type() const;

 private:
  std::string path_;
  nlohmann::json root_;
};

}  // namespace turbospark
