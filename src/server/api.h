// Request bodies of the OpenAI (/v1/chat/completions, /v1/completions) and Anthropic
// (/v1/messages) APIs turned into engine requests, and the engine's results into their
// response bodies. Every field is checked for its type and range; a bad one throws ApiError
// naming it (the server answers 400 with the API's error object). Fields the engine cannot
// honour yet (n > 1, tool_choice other than auto/none) are refused by name rather than ignored.
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
  nlohmann::ordered_json tools;  // OpenAI `tools` for the template (null: none)
};

// A function call the model wrote (Qwen / Hermes style: <tool_call>{"name", "arguments"}</tool_call>).
struct ToolCall {
  std::string name;
  std::string arguments;  // JSON text, as OpenAI's function.arguments
};

// Splits streamed reply text into what the client may see as content now and the tool calls
// the model writes. Two forms: <tool_call>{"name", "arguments"}</tool_call> blocks anywhere
// (the Qwen / Hermes templates' format: text from the first "<tool_call>" on is held), and a
// reply that is nothing but such a JSON object (or an array of them), bare or in a ``` fence,
// naming a declared tool (small models often answer so: held while the reply still looks like
// one). At the end the held text is parsed; what is not a call is given back as content.
class ToolCallParser {
 public:
  explicit ToolCallParser(std::vector<std::string> tool_names) : names_(std::move(tool_names)) {}
  // Content to send now for this piece.
  std::string push(const std::string& piece);
  // At the end: content still held (text around unparseable blocks), and the calls.
  std::string finish(std::vector<ToolCall>* calls);

 private:
  bool json_call(const std::string& text, std::vector<ToolCall>* calls) const;
  std::vector<std::string> names_;
  std::string pending_;  // not yet sent: may begin "<tool_call>" or a JSON call, or is past it
  bool in_calls_ = false;
  bool maybe_json_ = true;  // nothing sent yet, and the reply may still be a bare JSON call
};

// The function names of an OpenAI `tools` array (validated by parse_openai_chat).
std::vector<std::string> tool_names(const nlohmann::ordered_json& tools);

// A request body as JSON, its nesting bounded (kMaxJsonDepth levels, else ApiError 400 naming
// the limit): nlohmann's parser keeps its own stack, but dump() and the walks over tools and
// messages recurse per level, and a 2 MB body of 300000 nested objects in a tool's parameters
// took the server down (stack overflow). Malformed JSON throws nlohmann::json::exception.
constexpr int kMaxJsonDepth = 64;
nlohmann::json parse_request_body(const std::string& body);

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
