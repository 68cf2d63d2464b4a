// turbospark convert: rewrites a safetensors checkpoint with its weights quantized to a
// packed format the engine runs in place (core/quant_grouped.h):
//   --quant int4-affine  every weight matrix the model multiplies by (linear layers, routed
//                        experts, the embedding) becomes MLX-style affine 4-bit with
//                        --group-size columns per scale/bias; matrices whose rows are not a
//                        whole number of groups stay as they are (as MLX does) and are counted.
//   --quant mxfp4        routed-expert weights only become MXFP4 (NAME_blocks/NAME_scales, the
//                        gpt-oss layout); everything else stays as it is.
// Which tensors are weight matrices is not guessed from names: the model is loaded first and
// the checkpoint reports what it was asked for (Checkpoint::matrix_uses).
//
// --expert-store DIR instead writes the model's routed experts (safetensors or GGUF, any stored
// format) into an expert store (experts/expert_store.h): one aligned, checksummed record per
// (layer, expert), which `--expert-store DIR` on the running commands streams from.
#include <fmt/format.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "core/mapped_file.h"
#include "core/quant.h"
#include "core/quant_grouped.h"
#include "core/thread_pool.h"
#include "experts/expert_store.h"
#include "formats/gguf_model.h"
#include "formats/safetensors.h"
#include "models/registry.h"

namespace turbospark::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Files beside the weights that a converted checkpoint keeps.
constexpr const char* kCopiedFiles[] = {"tokenizer.json",     "tokenizer_config.json", "special_tokens_map.json",
                                        "generation_config.json", "chat_template.jinja", "chat_template.json",
                                        "vocab.json",         "merges.txt",            "tokenizer.model",
                                        "added_tokens.json"};

std::string weight_stem(const std::string& name) {
  const std::string suffix = ".weight";
  if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
    return name.substr(0, name.size() - suffix.size());
  return name;
}

// "...experts.<digit>..." : an unfused routed expert's own matrix.
bool is_routed_expert_name(const std::string& name) {
  for (size_t p = name.find(".experts."); p != std::string::npos; p = name.find(".experts.", p + 1)) {
    const size_t d = p + 9;
    if (d < name.size() && name[d] >= '0' && name[d] <= '9') return true;
  }
  return false;
}

bool is_float(DType t) { return t == DType::BF16 || t == DType::F16 || t == DType::F32; }

// A tensor to quantize: n matrices (1 for a plain matrix) of [rows, cols], stored
// [n, cols, rows] when transposed.
struct Plan {
  std::string name;
  const TensorInfo* src = nullptr;
  int64_t n = 1, rows = 0, cols = 0;
  bool stacked = false, transposed = false;
};

// Row r of matrix k of the plan as floats.
void source_row(const Plan& p, int64_t k, int64_t r, float* dst, std::vector<float>& scratch) {
  const size_t es = dtype_size(p.src->dtype);
  const uint8_t* base = p.src->data + size_t(k * p.rows * p.cols) * es;
  if (!p.transposed) return dequantize_row(p.src->dtype, base + size_t(r * p.cols) * es, dst, p.cols);
  scratch.resize(1);
  for (int64_t i = 0; i < p.cols; ++i) {
    dequantize_row(p.src->dtype, base + size_t(i * p.rows + r) * es, scratch.data(), 1);
    dst[i] = scratch[0];
  }
}

// Every stacked row rr = k * rows + r of the plan as floats, fn(rr, row), across the pool.
// A NaN or infinity would quantize to NaN scales: refused naming the tensor and row (workers
// only record it; the calling thread fails).
template <class Fn>
void for_each_row(ThreadPool& pool, const Plan& p, Fn&& fn) {
  std::atomic<int64_t> bad_row{-1};
  pool.parallel_for(p.n * p.rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(size_t(p.cols)), scratch;
    for (int64_t rr = begin; rr < end; ++rr) {
      source_row(p, rr / p.rows, rr % p.rows, row.data(), scratch);
      for (float x : row)
        if (!std::isfinite(x)) bad_row.store(rr);
      fn(rr, row.data());
    }
  });
  const int64_t bad = bad_row.load();
  if (bad < 0) return;
  if (p.stacked) fail("convert: {} has a NaN or infinite weight (matrix {}, row {})", p.name, bad / p.rows, bad % p.rows);
  fail("convert: {} has a NaN or infinite weight (row {})", p.name, bad);
}

std::vector<int64_t> with_lead(const Plan& p, std::vector<int64_t> tail) {
  if (p.stacked) tail.insert(tail.begin(), p.n);
  return tail;
}

void copy_into(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec) fail("convert: cannot copy {} to {}: {}", from.string(), to.string(), ec.message());
}

int64_t dir_bytes(const fs::path& dir) {
  int64_t total = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) total += int64_t(e.file_size());
  return total;
}

}  // namespace

void add_convert_command(CLI::App& app) {
  struct Opts {
    std::string model, quant, out, expert_store;
    int64_t group_size = 64;
    bool experts_only = false;
    int threads = 0;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "convert", "Quantize a safetensors checkpoint (int4-affine or mxfp4) into a new directory, or write a MoE model's "
                 "routed experts into an expert store for streaming (--expert-store)");
  cmd->add_option("--model,-m", o->model, "Checkpoint directory (config.json + *.safetensors), or a GGUF with --expert-store")
      ->required();
  cmd->add_option("--quant", o->quant, "int4-affine (all weight matrices) or mxfp4 (routed experts)");
  cmd->add_option("--expert-store", o->expert_store,
                  "Write the routed experts, as stored, into this directory (created; must not hold files): one aligned "
                  "record per expert for --expert-store on run/generate/logits/bench/serve");
  cmd->add_option("--group-size", o->group_size, "int4-affine: columns per scale/bias (32, 64 or 128)")->capture_default_str();
  cmd->add_flag("--experts-only", o->experts_only,
                "int4-affine: quantize the routed experts only (attention, shared layers and the head stay as they are)");
  cmd->add_option("--threads,-t", o->threads, "Quantizing threads (0: all cores)")->capture_default_str();
  cmd->add_option("--out,-o", o->out, "Output directory of --quant (created; must not hold files)");
  cmd->callback([o] {
    if (!o->expert_store.empty()) {
      if (!o->quant.empty() || !o->out.empty() || o->experts_only)
        fail("convert: --expert-store writes only the expert store: it does not go with --quant, --out or --experts-only");
      LoadedModel loaded = load_model(o->model);
      int64_t next_report = 0;
      const ExpertStoreWriteStats st = write_expert_store(*loaded.model, o->expert_store, [&](int64_t done, int64_t total) {
        if (done * 10 >= next_report * total || done == total) {
          fmt::print(stderr, "\rwriting expert store: {}/{} experts", done, total);
          next_report = done * 10 / total + 1;
          if (done == total) fmt::print(stderr, "\n");
        }
      });
      fmt::print(stderr, "wrote {}: {} experts, {:.2f} GiB in {:.1f} s ({:.2f} GB/s)\n", o->expert_store, st.records,
                 double(st.bytes) / (1 << 30), st.seconds, st.seconds > 0 ? double(st.bytes) / 1e9 / st.seconds : 0.0);
      return;
    }
    if (o->quant.empty()) fail("convert: give --quant int4-affine|mxfp4 (with --out) or --expert-store DIR");
    if (o->out.empty()) fail("convert: --quant needs --out DIR");
    const bool int4 = o->quant == "int4-affine";
    if (!int4 && o->quant != "mxfp4") fail("convert: --quant {} is not supported (int4-affine, mxfp4)", o->quant);
    if (!int4 && o->experts_only) fail("convert: --experts-only goes with --quant int4-affine (mxfp4 quantizes experts only)");
    if (int4 && o->group_size != 32 && o->group_size != 64 && o->group_size != 128)
      fail("convert: --group-size {} is not supported (32, 64 or 128)", o->group_size);
    std::error_code ec;
    if (is_gguf_path(o->model) || !fs::is_directory(o->model, ec))
      fail("convert: --model {} is not a safetensors checkpoint directory", o->model);
    const fs::path in_dir(o->model), out_dir(o->out);
    json config;
    try {
      config = json::parse(read_text_file((in_dir / "config.json").string()));
    } catch (const json::exception& e) {
      fail("{}: malformed JSON: {}", (in_dir / "config.json").string(), e.what());
    }
    if (config.contains("quantization") || config.contains("quantization_config"))
      fail("convert: {} is already quantized (config.json has a quantization entry)", o->model);
    if (fs::exists(out_dir, ec) && !fs::is_empty(out_dir, ec)) fail("convert: --out {} exists and is not empty", o->out);

    // Load the model so the checkpoint records which tensors are weight matrices.
    LoadedModel loaded = load_model(o->model);
    const Checkpoint& ck = *loaded.checkpoint;
    const auto& uses = ck.matrix_uses();

    std::vector<TensorWriteSpec> specs;
    int64_t n_quantized = 0, n_kept_ragged = 0;
    std::string first_ragged;
    const int64_t group = int4 ? o->group_size : mxfp4::kGroup;
    auto pool = std::make_shared<ThreadPool>(o->threads);
    for (const auto& [name, t] : ck.all()) {
      Plan plan;
      plan.name = name;
      plan.src = t;
      bool quantize = false;
      if (auto it = uses.find(name); it != uses.end() && is_float(t->dtype)) {
        const MatrixUse& u = it->second;
        plan.rows = u.rows;
        plan.cols = u.cols;
        plan.stacked = u.expert_stack;
        plan.transposed = u.transposed;
        plan.n = u.expert_stack && !t->shape.empty() ? t->shape[0] : 1;
        const std::vector<int64_t> want = u.expert_stack ? (u.transposed ? std::vector<int64_t>{plan.n, u.cols, u.rows}
                                                                          : std::vector<int64_t>{plan.n, u.rows, u.cols})
                                                         : std::vector<int64_t>{u.rows, u.cols};
        const bool wanted = (int4 && !o->experts_only) || u.expert_stack || is_routed_expert_name(name);
        if (wanted && t->shape == want) {
          if (u.cols % group == 0) {
            quantize = true;
          } else {
            ++n_kept_ragged;
            if (first_ragged.empty()) first_ragged = name;
          }
        }
      }
      if (!quantize) {
        specs.push_back({name, t->dtype, t->shape, [src = t](uint8_t* dst, size_t n) { std::memcpy(dst, src->data, n); }});
        continue;
      }
      ++n_quantized;
      const std::string stem = weight_stem(name);
      const int64_t rows_total = plan.n * plan.rows;
      if (int4) {
        const DType plane = t->dtype == DType::F32 ? DType::F32 : t->dtype;  // scales in the source precision
        const int64_t groups = plan.cols / group;
        const size_t plane_row = size_t(groups) * dtype_size(plane);
        // The packed tensor's fill quantizes and leaves the planes here for the next two fills.
        auto planes = std::make_shared<std::pair<std::vector<uint8_t>, std::vector<uint8_t>>>();
        specs.push_back({name, DType::U32, with_lead(plan, {plan.rows, plan.cols / int4_affine::kPerWord}),
                         [plan, planes, plane, plane_row, group, rows_total, pool](uint8_t* dst, size_t) {
                           planes->first.resize(plane_row * size_t(rows_total));
                           planes->second.resize(plane_row * size_t(rows_total));
                           for_each_row(*pool, plan, [&](int64_t rr, const float* row) {
                             int4_affine::quantize_row(row, plan.cols, group, plane, dst + rr * plan.cols / 2,
                                                       planes->first.data() + size_t(rr) * plane_row,
                                                       planes->second.data() + size_t(rr) * plane_row);
                           });
                         }});
        specs.push_back({stem + ".scales", plane, with_lead(plan, {plan.rows, groups}), [planes](uint8_t* dst, size_t n) {
                           std::memcpy(dst, planes->first.data(), n);
                           std::vector<uint8_t>().swap(planes->first);
                         }});
        specs.push_back({stem + ".biases", plane, with_lead(plan, {plan.rows, groups}), [planes](uint8_t* dst, size_t n) {
                           std::memcpy(dst, planes->second.data(), n);
                           std::vector<uint8_t>().swap(planes->second);
                         }});
      } else {
        auto scales = std::make_shared<std::vector<uint8_t>>();
        const int64_t blocks = plan.cols / mxfp4::kGroup;
        specs.push_back({stem + "_blocks", DType::U8, with_lead(plan, {plan.rows, blocks, mxfp4::kGroupBytes}),
                         [plan, scales, blocks, rows_total, pool](uint8_t* dst, size_t) {
                           scales->resize(size_t(blocks * rows_total));
                           for_each_row(*pool, plan, [&](int64_t rr, const float* row) {
                             mxfp4::quantize_row(row, dst + rr * plan.cols / 2, scales->data() + rr * blocks, plan.cols);
                           });
                         }});
        specs.push_back({stem + "_scales", DType::U8, with_lead(plan, {plan.rows, blocks}), [scales](uint8_t* dst, size_t n) {
                           std::memcpy(dst, scales->data(), n);
                           std::vector<uint8_t>().swap(*scales);
                         }});
      }
    }
    if (n_quantized == 0) fail("convert: {} has no weight matrix that {} applies to", o->model, o->quant);

    // Progress on stderr: on a terminal one line rewritten per tensor, into a pipe or file a
    // line per tenth of the tensors.
    const size_t total = specs.size();
    const bool tty = isatty(STDERR_FILENO) != 0;
    for (size_t i = 0; i < total; ++i) {
      auto fill = std::move(specs[i].fill);
      const std::string name = specs[i].name;
      const bool report = tty || i + 1 == total || (i + 1) * 10 / total != i * 10 / total;
      specs[i].fill = [fill, i, total, name, tty, report](uint8_t* dst, size_t n) {
        if (report) {
          if (tty) fmt::print(stderr, "\rconvert: {:>5}/{} {:<60.60}", i + 1, total, name);
          else fmt::print(stderr, "convert: {:>5}/{} {}\n", i + 1, total, name);
          std::fflush(stderr);
        }
        fill(dst, n);
      };
    }
    fs::create_directories(out_dir, ec);
    if (ec) fail("convert: cannot create {}: {}", o->out, ec.message());
    try {
      write_safetensors((out_dir / "model.safetensors").string(), specs, {{"format", "pt"}});
    } catch (...) {
      if (tty) fmt::print(stderr, "\n");
      fs::remove(out_dir / "model.safetensors", ec);  // no half-written checkpoint left behind
      throw;
    }
    if (tty) fmt::print(stderr, "\n");

    if (int4) {
      // MLX's key; "quantization_config" is left to methods transformers knows by name.
      config["quantization"] = {{"group_size", o->group_size}, {"bits", 4}, {"mode", "affine"}};
    } else {
      config["quantization_config"] = {{"quant_method", "mxfp4"}};
    }
    {
      const std::string text = config.dump(2) + "\n";
      std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen((out_dir / "config.json").c_str(), "w"), std::fclose);
      if (!f || std::fwrite(text.data(), 1, text.size(), f.get()) != text.size())
        fail("convert: cannot write {}", (out_dir / "config.json").string());
    }
    for (const char* file : kCopiedFiles)
      if (fs::exists(in_dir / file, ec)) copy_into(in_dir / file, out_dir / file);

    const int64_t before = ck.total_bytes(), after = dir_bytes(out_dir);
    if (n_kept_ragged > 0)
      fmt::print(stderr, "convert: kept {} matrices as they were: row length not a multiple of {} (e.g. {})\n", n_kept_ragged,
                 group, first_ragged);
    fmt::print("converted {} -> {} ({}{}): {} tensors quantized, {:.1f} MiB of weights -> {:.1f} MiB on disk ({:.0f}%)\n",
               o->model, o->out, o->quant, int4 ? fmt::format(", group size {}", o->group_size) : std::string(),
               n_quantized, double(before) / (1 << 20), double(after) / (1 << 20), 100.0 * double(after) / double(before));
  });
}

}  // namespace turbospark::cli
