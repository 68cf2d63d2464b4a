// The CUDA gate of models/registry.h: a family whose GPU kernels have not passed the device tests
// (FamilyEntry::cuda false) is refused by name on a GPU backend unless
// TURBOSPARK_CUDA_UNVERIFIED=1, and always runs on the CPU.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/error.h"
#include "formats/hf_config.h"
#include "models/registry.h"

namespace turbospark {
namespace {

TEST(Registry, UnverifiedFamiliesAreRefusedOnTheGpuByName) {
  const FamilyEntry unverified{"x_text", "XForCausalLM", nullptr, false};
  const FamilyEntry verified{"y_text", "YForCausalLM", nullptr, true};
  unsetenv("TURBOSPARK_CUDA_UNVERIFIED");
  EXPECT_NO_THROW(check_family_runs_on(unverified, "cpu", "/m"));
  EXPECT_NO_THROW(check_family_runs_on(verified, "cuda", "/m"));
  try {
    check_family_runs_on(unverified, "cuda", "/m");
    ADD_FAILURE() << "an unverified family passed on cuda";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/m: XForCausalLM is not supported on --device cuda"), std::string::npos)
        << e.what();
  }
  setenv("TURBOSPARK_CUDA_UNVERIFIED", "0", 1);
  EXPECT_THROW(check_family_runs_on(unverified, "cuda", "/m"), Error);
  setenv("TURBOSPARK_CUDA_UNVERIFIED", "1", 1);
  EXPECT_NO_THROW(check_family_runs_on(unverified, "cuda", "/m"));
  unsetenv("TURBOSPARK_CUDA_UNVERIFIED");
}

// Every family the registry knows has passed the device suite (tests/device/run.sh, 2026-12-05
// for gpt-oss and Gemma 4): none is behind the gate. A new family starts behind it.
TEST(Registry, EveryFamilyKnownTodayRunsOnCuda) {
  for (const FamilyEntry& f : families()) EXPECT_TRUE(f.cuda) << f.architecture;
}

}  // namespace
}  // namespace turbospark
