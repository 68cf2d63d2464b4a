// turbospark: command-line front end. Every failure prints one line and exits non-zero.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <exception>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"turbospark: an inference engine for mixture-of-experts and dense language models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "turbospark 0.1.0");
  turbospark::cli::add_run_command(app);
  turbospark::cli::add_chat_command(app);
  turbospark::cli::add_serve_command(app);
  turbospark::cli::add_generate_command(app);
  turbospark::cli::add_logits_command(app);
  turbospark::cli::add_inspect_command(app);
  turbospark::cli::add_bench_command(app);
  turbospark::cli::add_perplexity_command(app);
  turbospark::cli::add_convert_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version print and exit 0; every other parse error is one line too.
    if (e.get_exit_code() == 0) return app.exit(e);
    fmt::print(stderr, "error: {} (see --help)\n", e.what());
    return e.get_exit_code();
  } catch (const turbospark::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
