// experts/slot_layout.h, the layout the CUDA tier of expert streaming copies experts by,
// checked on the CPU: experts of every MoE family and format are copied into host "slots"
// (the layout's copies, by memcpy, into 256-byte-aligned buffers filled with a poison byte
// first), and every row of every view read back through the in-slot views dequantizes to the
// same floats as the stored expert's row. A plane copied short, to the wrong offset, or a view
// addressing the wrong place in its slot shows as a differing row; gpt-oss's interleaved
// gate/up rows must share one copy.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <ostream>
#include <memory>
#include <string>
#include <vector>

#include "core/quant_grouped.h"
#include "experts/slot_layout.h"
#include "models/registry.h"
#include "test_util.h"

namespace turbospark {
namespace {

using testing::fixture;

struct LayoutCase {
  std::string fixture;
  std::string file;  // a GGUF inside the fixture, or empty
  bool interleaved;  // gate and up share one copy
};

void PrintTo(const LayoutCase& c, std::ostream* os) { *os << c.fixture << (c.file.empty() ? "" : "/" + c.file); }

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

class ExpertSlotLayoutTest : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(ExpertSlotLayoutTest, CopiedExpertsReadBackRowForRow) {
  const LayoutCase& c = GetParam();
  const std::string path = c.file.empty() ? fixture(c.fixture) : fixture(c.fixture) + "/" + c.file;
  LoadedModel m = load_model(path);
  const std::vector<const ExpertWeights*> firsts = m.model->first_expert_of_each_layer();
  ASSERT_FALSE(firsts.empty());
  int checked = 0;
  m.model->for_each_routed_expert([&](const ExpertWeights& e) {
    const ExpertWeights* first = nullptr;
    for (const ExpertWeights* f : firsts) {
      if (f->gate.layer == e.gate.layer) first = f;
    }
    ASSERT_NE(first, nullptr) << "layer " << e.gate.layer;
    const ExpertSlotLayout layout = ExpertSlotLayout::of(*first);
    // Only 256-byte-aligned bytes, poisoned: a byte the copies miss reads back as 0xA5.
    const size_t bytes = size_t((layout.bytes() + 255) / 256 * 256);
    std::unique_ptr<uint8_t, FreeDeleter> slot(static_cast<uint8_t*>(std::aligned_alloc(256, std::max<size_t>(bytes, 256))));
    std::memset(slot.get(), 0xA5, bytes);
    int64_t copied = 0;
    layout.for_each_copy(e, [&](const void* src, int64_t offset, int64_t n) {
      ASSERT_GE(offset, 0);
      ASSERT_LE(offset + n, layout.bytes());
      EXPECT_EQ(offset % 256, 0);
      std::memcpy(slot.get() + offset, src, size_t(n));
      copied += n;
    });
    const ExpertWeights in = layout.in_slot(e, slot.get());
    const WeightView* host[3] = {&e.gate.view, &e.up.view, &e.down.view};
    const WeightView* dev[3] = {&in.gate.view, &in.up.view, &in.down.view};
    for (int v = 0; v < 3; ++v) {
      std::vector<float> want(size_t(host[v]->cols)), got(size_t(host[v]->cols));
      for (int64_t r = 0; r < host[v]->rows; ++r) {
        dequantize_weight_row(*host[v], r, want.data());
        dequantize_weight_row(*dev[v], r, got.data());
        ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * 4))
            << "layer " << e.gate.layer << " expert " << e.gate.expert << " view " << v << " row " << r;
      }
    }
    // Interleaved gate/up: up is the gate's copy shifted by one row, and nothing is copied twice.
    if (c.interleaved) {
      EXPECT_EQ(static_cast<const uint8_t*>(in.up.view.data) - static_cast<const uint8_t*>(in.gate.view.data),
                static_cast<const uint8_t*>(e.up.view.data) - static_cast<const uint8_t*>(e.gate.view.data));
      EXPECT_LT(copied, e.gate.view.bytes() + e.up.view.bytes() + e.down.view.bytes());
    }
    ++checked;
  });
  EXPECT_GT(checked, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Families, ExpertSlotLayoutTest,
    ::testing::Values(LayoutCase{"qwen3_moe_tiny", "", false},
                      LayoutCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-q4_0.gguf", false},
                      LayoutCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-bf16.gguf", false},
                      LayoutCase{"gpt_oss_tiny", "", true}, LayoutCase{"gpt_oss_mxfp4_tiny", "", true},
                      LayoutCase{"gemma4_moe_tiny", "", false}, LayoutCase{"qwen4_exp_tiny", "", false}),
    [](const ::testing::TestParamInfo<LayoutCase>& info) {
      return testing::param_name(info.param.fixture, info.param.file);
    });

// A layout refuses an expert whose planes differ from the layer's (another layer's expert,
// stored in another format or without the scales plane).
TEST(ExpertSlotLayout, RefusesAnExpertStoredOtherwise) {
  LoadedModel bf16 = load_model(fixture("gpt_oss_tiny"));
  LoadedModel mxfp4 = load_model(fixture("gpt_oss_mxfp4_tiny"));
  const ExpertSlotLayout layout = ExpertSlotLayout::of(*bf16.model->first_expert_of_each_layer()[0]);
  const ExpertWeights& other = *mxfp4.model->first_expert_of_each_layer()[0];
  EXPECT_THROW(layout.for_each_copy(other, [](const void*, int64_t, int64_t) {}), Error);
}

}  // namespace
}  // namespace turbospark
