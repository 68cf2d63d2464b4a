// One error type for the whole engine. Every failure a user can cause (bad file, bad flag,
// bad token id) is thrown as turbospark::Error with a single line naming the culprit; the
// CLI prints it and exits non-zero. Internal invariants use TS_CHECK, which also throws, so
// a bug surfaces as a message rather than a crash.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace turbospark {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace turbospark

#define TS_CHECK(cond, ...)                          \
  do {                                               \
    if (!(cond)) ::turbospark::fail(__VA_ARGS__);    \
  } while (0)
