// GGUF files as Hugging Face-style checkpoints. One place maps llama.cpp's tensor names
// and metadata onto the names, shapes and config fields the families read, and undoes
// what llama.cpp's converter did to the weights (the row permutation of Llama's q/k
// projections for its interleaved RoPE, the +1 folded into Gemma's norm weights), so the
// family code is the same for both formats.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/gguf.h"
#include "formats/safetensors.h"

namespace turbospark {

// Tensors of `gguf` under their Hugging Face names and [rows, cols] shapes. Tensors whose
// data had to be rewritten live in `owned`.
std::vector<TensorInfo> gguf_hf_tensors(const GgufFile& gguf, std::vector<std::unique_ptr<uint8_t[]>>& owned);

// config.json equivalent built from the GGUF metadata (architectures, model_type, sizes,
// RoPE, eps, eos, tying).
nlohmann::json gguf_hf_config(const GgufFile& gguf);

// tokenizer.chat_template, or "" when the file has none.
std::string gguf_chat_template(const GgufFile& gguf);

bool is_gguf_path(const std::string& path);

}  // namespace turbospark
