#pragma once

#include <CLI/CLI.hpp>

namespace turbospark::cli {

void add_logits_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_run_command(CLI::App& app);
void add_inspect_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_perplexity_command(CLI::App& app);
void add_chat_command(CLI::App& app);
void add_convert_command(CLI::App& app);
void add_serve_command(CLI::App& app);

}  // namespace turbospark::cli
