// The CUDA entry points of a build without the CUDA backend (TURBOSPARK_CUDA=OFF): the
// request is refused by name rather than silently run on the CPU.
#include "core/error.h"
#include "ops/backend.h"

namespace turbospark {

std::unique_ptr<Backend> make_cuda_backend(int) {
  fail("--device cuda: this build has no CUDA backend (configure with -DTURBOSPARK_CUDA=ON on a machine with nvcc)");
}

bool cuda_available() { return false; }

}  // namespace turbospark
