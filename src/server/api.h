// Request bodies of the OpenAI (/v1/chat/completions, /v1/completions) and Anthropic
// (/v1/messages) APIs turned into engine requests, and the engine's results into their
// response bodies. Every field is checked for its type and range; a bad one throws ApiError
// naming it (the server answers 400 with the API's error object). Fields the engine cannot
// honour yet (tools, n > 1) are refused by name rather than ignored.
#pragma once

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "formats/chat_template.h"
#include "server/engine.h"

namespace turbospark::server {

struct ApiError : std::runtime_error {
  ApiError(int status, std::string param, const std::string& message)
      : std::runtime_error(message), status(status), param(std::move(param)) {}
  int status;
  std::string param;  // the offending field ("" when none)
};

// What the server is asked: the conversation or text, sampling, limits, streaming.
struct ApiRequest {
  std::string model;
  std::vector<ChatMessage> messages;  // chat and messages endpoints
  std::string prompt;                 // completions endpoint
  SamplingParams sampling;
  int64_t max_tokens = -1;  // -1: until the context is full
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;  // OpenAI stream_options.include_usage
  int top_logprobs = -1;       // -1: no logprobs; else per token its own and the n best
};

// served_model: the id /v1/models lists; a request naming another model is refused.
ApiRequest parse_openai_chat(const nlohmann::json& body, const std::string& served_model);
ApiRequest parse_openai_completion(const nlohmann::json& body, const std::string& served_model);
ApiRequest parse_anthropic_messages(const nlohmann::json& body, const std::string& served_model);

// Error bodies: OpenAI {"error": {"message", "type", "param", "code"}} and Anthropic
// {"type": "error", "error": {"type", "message"}}.
nlohmann::json openai_error(const std::string& message, const std::string& type, const std::string& param);
nlohmann::json anthropic_error(const std::string& message, const std::string& type);

// OpenAI's logprobs objects for the tokens of one event: chat ({"content": [...]}) and the
// legacy completions form ({"tokens", "token_logprobs", "top_logprobs", "text_offset"}).
nlohmann::json chat_logprobs(const std::vector<TokenLogprob>& tokens);
nlohmann::json completion_logprobs(const std::vector<TokenLogprob>& tokens, int64_t text_offset);

const char* openai_finish_reason(Finish f);     // "stop", "length" (cancelled/error: null)
const char* anthropic_stop_reason(Finish f);    // "end_turn", "max_tokens", "stop_sequence"

}  // namespace turbospark::server
