#include "experts/expert_store.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#define XXH_INLINE_ALL  // header-only: no library to carry to the GPU machines
#include <xxhash.h>
#include <set>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/quant.h"
#include "core/quant_grouped.h"
#include "models/model.h"

namespace turbospark {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFormat = "turbospark-expert-store";
constexpr const char* kIndexName = "experts.json";
constexpr const char* kDataName = "experts.bin";

int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
int64_t key_of(int32_t layer, int32_t expert) { return int64_t(layer) << 32 | uint32_t(expert); }
int64_t span_bytes(int64_t rows, int64_t stride, int64_t packed) { return rows <= 0 ? 0 : (rows - 1) * stride + packed; }

void add_planes(WeightView& w, std::vector<PlaneField>& out) {
  int64_t packed = 0;
  if (is_grouped(w.dtype)) packed = grouped_row_bytes(w.dtype, w.cols);
  else if (is_quantized(w.dtype)) packed = row_bytes(w.dtype, w.cols);
  else packed = w.cols * int64_t(dtype_size(w.dtype));
  out.push_back({&w.data, span_bytes(w.rows, w.row_bytes, packed)});
  const int64_t groups = w.group_size > 0 ? w.cols / w.group_size : 0;
  if (w.scales) {
    const int64_t each = w.dtype == DType::MXFP4 ? 1 : int64_t(dtype_size(w.scales_dtype));
    out.push_back({&w.scales, span_bytes(w.rows, w.scales_row_bytes, groups * each)});
  }
  if (w.biases) out.push_back({&w.biases, span_bytes(w.rows, w.biases_row_bytes, groups * int64_t(dtype_size(w.scales_dtype)))});
}

// Where each plane of one expert goes in its record: planes that overlap in memory form one
// segment (copied once, relative layout kept), segments at 64-byte-aligned offsets.
struct RecordPlan {
  struct Segment {
    const uint8_t* src;
    int64_t bytes, at;
  };
  std::vector<Segment> segments;
  std::vector<int64_t> plane_at;
  int64_t bytes = 0;
};

RecordPlan plan_record(const std::vector<PlaneField>& planes) {
  RecordPlan plan;
  plan.plane_at.assign(planes.size(), -1);
  std::vector<size_t> order;
  for (size_t i = 0; i < planes.size(); ++i)
    if (planes[i].bytes > 0) order.push_back(i);
  auto begin_of = [&](size_t i) { return static_cast<const uint8_t*>(*planes[i].field); };
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return begin_of(a) < begin_of(b); });
  int64_t at = 0;
  for (size_t i : order) {
    const uint8_t* b = begin_of(i);
    const uint8_t* e = b + planes[i].bytes;
    if (!plan.segments.empty()) {
      RecordPlan::Segment& s = plan.segments.back();
      if (b < s.src + s.bytes) {  // overlaps the previous segment: extend it
        if (e > s.src + s.bytes) {
          at += (e - s.src) - s.bytes;
          s.bytes = e - s.src;
        }
        plan.plane_at[i] = s.at + (b - s.src);
        continue;
      }
      at = align_up(at, kExpertStorePlaneAlign);
    }
    plan.segments.push_back({b, planes[i].bytes, at});
    plan.plane_at[i] = at;
    at += planes[i].bytes;
  }
  plan.bytes = at;
  return plan;
}

// The record of one expert, built from the memory its views point at: buf holds it padded to
// the alignment; the plan says where each plane went.
RecordPlan build_record(ExpertWeights ew, std::vector<uint8_t>& buf) {
  const std::vector<PlaneField> planes = expert_planes(ew);
  RecordPlan plan = plan_record(planes);
  buf.assign(size_t(align_up(plan.bytes, kExpertStoreAlign)), 0);
  for (const RecordPlan::Segment& s : plan.segments) std::memcpy(buf.data() + s.at, s.src, size_t(s.bytes));
  return plan;
}

[[noreturn]] void bad_index(const std::string& path, const std::string& what) {
  fail("expert store {}: {} (rewrite it with turbospark convert --expert-store)", path, what);
}

}  // namespace

std::vector<PlaneField> expert_planes(ExpertWeights& ew) {
  std::vector<PlaneField> p;
  for (Weight* w : {&ew.gate, &ew.up, &ew.down}) add_planes(w->view, p);
  return p;
}

uint64_t expert_store_checksum(const void* data, int64_t bytes) {
  return uint64_t(XXH3_64bits(data, size_t(bytes)));
}

namespace {

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

uint64_t parse_hex64(const std::string& s, bool* ok) {
  *ok = s.size() == 16 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
  return *ok ? std::stoull(s, nullptr, 16) : 0;
}

}  // namespace

std::shared_ptr<const ExpertStore> ExpertStore::open(const std::string& dir) {
  auto store = std::make_shared<ExpertStore>();
  store->dir_ = dir;
  const std::string index_path = (fs::path(dir) / kIndexName).string();
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("expert store {}: not a directory", dir);
  if (!fs::exists(index_path, ec)) fail("expert store {}: no {} (write one with turbospark convert --expert-store)", dir, kIndexName);
  json index;
  try {
    index = json::parse(read_text_file(index_path));
  } catch (const json::exception& e) {
    bad_index(index_path, fmt::format("malformed JSON: {}", e.what()));
  }
  try {
    if (!index.is_object() || index.value("format", std::string()) != kFormat)
      bad_index(index_path, fmt::format("not a {} index", kFormat));
    const int version = index.at("version").get<int>();
    if (version != kExpertStoreVersion)
      bad_index(index_path, fmt::format("version {} (this build reads version {})", version, kExpertStoreVersion));
    const int64_t align = index.at("alignment").get<int64_t>();
    if (align != kExpertStoreAlign) bad_index(index_path, fmt::format("alignment {} (expected {})", align, kExpertStoreAlign));
    store->architecture_ = index.at("source").at("architecture").get<std::string>();
    const std::string data_name = index.at("data").get<std::string>();
    if (data_name.empty() || data_name.find('/') != std::string::npos || data_name == "." || data_name == "..")
      bad_index(index_path, fmt::format("data file name '{}' is not a plain name in the store", data_name));
    store->data_path_ = (fs::path(dir) / data_name).string();
    store->data_bytes_ = index.at("data_bytes").get<int64_t>();
    if (store->data_bytes_ < 0) bad_index(index_path, "negative data_bytes");
    const uintmax_t on_disk = fs::file_size(store->data_path_, ec);
    if (ec) fail("expert store {}: cannot read the size of {}: {}", dir, store->data_path_, ec.message());
    if (int64_t(on_disk) != store->data_bytes_)
      fail("expert store {}: {} is {} bytes, the index says {} (truncated or rewritten)", dir, store->data_path_,
           on_disk, store->data_bytes_);
    const json& records = index.at("records");
    if (!records.is_array()) bad_index(index_path, "records is not an array");
    for (const json& r : records) {
      // [layer, expert, offset, bytes, "xxh3 as 16 hex digits", [plane offsets]]
      if (!r.is_array() || r.size() != 6 || !r[5].is_array())
        bad_index(index_path, "a record is not [layer, expert, offset, bytes, checksum, [planes]]");
      ExpertStoreRecord rec;
      const int64_t layer = r[0].get<int64_t>(), expert = r[1].get<int64_t>();
      if (layer < 0 || layer > std::numeric_limits<int32_t>::max() || expert < 0 ||
          expert > std::numeric_limits<int32_t>::max())
        bad_index(index_path, fmt::format("record with layer {} expert {}", layer, expert));
      rec.layer = int32_t(layer);
      rec.expert = int32_t(expert);
      rec.offset = r[2].get<int64_t>();
      rec.bytes = r[3].get<int64_t>();
      const std::string where = fmt::format("record (layer {}, expert {})", rec.layer, rec.expert);
      bool hex_ok = false;
      rec.checksum = parse_hex64(r[4].get<std::string>(), &hex_ok);
      if (!hex_ok) bad_index(index_path, where + ": the checksum is not 16 lowercase hex digits");
      if (rec.offset < 0 || rec.offset % kExpertStoreAlign != 0 || rec.bytes <= 0 ||
          rec.offset > store->data_bytes_ - align_up(rec.bytes, kExpertStoreAlign))
        bad_index(index_path, fmt::format("{}: bytes [{}, {}) are not an aligned range inside the {} bytes of {}", where,
                                          rec.offset, rec.offset + rec.bytes, store->data_bytes_, data_name));
      if (r[5].size() > 64) bad_index(index_path, where + ": more than 64 planes");
      for (const json& p : r[5]) {
        const int64_t at = p.get<int64_t>();
        if (at < -1 || at >= rec.bytes)
          bad_index(index_path, fmt::format("{}: plane offset {} outside its {} bytes", where, at, rec.bytes));
        rec.plane_at.push_back(at);
      }
      if (!store->records_.emplace(key_of(rec.layer, rec.expert), std::move(rec)).second)
        bad_index(index_path, where + " appears twice");
    }
    if (store->records_.empty()) bad_index(index_path, "no records");
  } catch (const json::exception& e) {
    bad_index(index_path, fmt::format("missing or mistyped field: {}", e.what()));
  }
  return store;
}

const ExpertStoreRecord* ExpertStore::find(int32_t layer, int32_t expert) const {
  auto it = records_.find(key_of(layer, expert));
  return it == records_.end() ? nullptr : &it->second;
}

void check_expert_store_source(const ExpertStore& store, const Model& model) {
  std::vector<ExpertWeights> experts;
  model.for_each_routed_expert([&](const ExpertWeights& e) { experts.push_back(e); });
  if (experts.empty()) return;
  std::vector<uint8_t> buf;
  for (size_t i : {size_t(0), experts.size() / 2, experts.size() - 1}) {
    const ExpertWeights& e = experts[i];
    const ExpertStoreRecord* rec = store.find(e.gate.layer, e.gate.expert);
    if (!rec)
      fail("expert store {}: no record for layer {} expert {} (written from another model?)", store.dir(), e.gate.layer,
           e.gate.expert);
    const RecordPlan plan = build_record(e, buf);
    if (plan.bytes != rec->bytes || plan.plane_at != rec->plane_at ||
        expert_store_checksum(buf.data(), plan.bytes) != rec->checksum)
      fail("expert store {}: layer {} expert {} differs from the model's (written from another checkpoint or format: "
           "rewrite it with turbospark convert --expert-store)", store.dir(), e.gate.layer, e.gate.expert);
  }
}

ExpertStoreWriteStats write_expert_store(const Model& model, const std::string& dir,
                                         const std::function<void(int64_t, int64_t)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelInfo& info = model.info();
  if (model.experts_per_token() == 0 || info.expert_bytes <= 0)
    fail("convert --expert-store: {} is a dense model (no routed experts to store)", info.architecture);
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_empty(dir, ec)) fail("convert --expert-store: {} exists and is not empty", dir);
  fs::create_directories(dir, ec);
  if (ec) fail("convert --expert-store: cannot create {}: {}", dir, ec.message());

  std::vector<ExpertWeights> experts;
  model.for_each_routed_expert([&](const ExpertWeights& e) { experts.push_back(e); });
  if (experts.empty()) fail("convert --expert-store: {} reports no routed experts", info.architecture);

  const std::string data_path = (fs::path(dir) / kDataName).string();
  std::FILE* f = std::fopen(data_path.c_str(), "wb");
  if (!f) fail("convert --expert-store: cannot create {}: {}", data_path, std::strerror(errno));
  json records = json::array();
  std::set<int64_t> seen;
  std::vector<uint8_t> buf;
  int64_t offset = 0;
  int32_t max_layer = -1, max_expert = -1;
  try {
    for (size_t n = 0; n < experts.size(); ++n) {
      ExpertWeights ew = experts[n];
      const int32_t layer = ew.gate.layer, expert = ew.gate.expert;
      TS_CHECK(layer >= 0 && expert >= 0, "convert --expert-store: routed expert {} carries no layer/expert index",
               ew.gate.name);
      TS_CHECK(seen.insert(key_of(layer, expert)).second, "convert --expert-store: layer {} expert {} listed twice",
               layer, expert);
      max_layer = std::max(max_layer, layer);
      max_expert = std::max(max_expert, expert);
      const RecordPlan plan = build_record(ew, buf);
      TS_CHECK(plan.bytes > 0, "convert --expert-store: layer {} expert {} has no bytes", layer, expert);
      const uint64_t sum = expert_store_checksum(buf.data(), plan.bytes);
      if (std::fwrite(buf.data(), 1, buf.size(), f) != buf.size())
        fail("convert --expert-store: writing {}: {}", data_path, std::strerror(errno));
      json at = json::array();
      for (int64_t a : plan.plane_at) at.push_back(a);
      records.push_back(json::array({layer, expert, offset, plan.bytes, hex64(sum), at}));
      offset += int64_t(buf.size());
      if (progress) progress(int64_t(n) + 1, int64_t(experts.size()));
    }
    if (std::fflush(f) != 0 || ::fsync(fileno(f)) != 0)
      fail("convert --expert-store: flushing {}: {}", data_path, std::strerror(errno));
  } catch (...) {
    std::fclose(f);
    throw;
  }
  if (std::fclose(f) != 0) fail("convert --expert-store: closing {}: {}", data_path, std::strerror(errno));

  json index = {{"format", kFormat},
                {"version", kExpertStoreVersion},
                {"alignment", kExpertStoreAlign},
                {"data", kDataName},
                {"data_bytes", offset},
                {"source",
                 {{"architecture", info.architecture},
                  {"layers", max_layer + 1},
                  {"experts", max_expert + 1},
                  {"expert_bytes", info.expert_bytes}}},
                {"records", records}};
  const std::string index_path = (fs::path(dir) / kIndexName).string();
  const std::string tmp = index_path + ".tmp";
  {
    std::FILE* jf = std::fopen(tmp.c_str(), "wb");
    if (!jf) fail("convert --expert-store: cannot create {}: {}", tmp, std::strerror(errno));
    const std::string text = index.dump();
    const bool ok = std::fwrite(text.data(), 1, text.size(), jf) == text.size() && std::fflush(jf) == 0;
    std::fclose(jf);
    if (!ok) fail("convert --expert-store: writing {}: {}", tmp, std::strerror(errno));
  }
  fs::rename(tmp, index_path, ec);  // the index appears last: a store without one is incomplete
  if (ec) fail("convert --expert-store: renaming {} to {}: {}", tmp, index_path, ec.message());
  ExpertStoreWriteStats st;
  st.records = int64_t(experts.size());
  st.bytes = offset;
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace turbospark
