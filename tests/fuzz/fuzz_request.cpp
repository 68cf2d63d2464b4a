// The server's request bodies: the bounded JSON parse, then (the first byte picks the
// endpoint) the OpenAI chat or completions or the Anthropic messages reader, every field's
// type and range; an accepted conversation rendered through Qwen3's chat template with its
// tools, as the server does; and the same bytes fed to the tool-call parser as if the model
// had written them. The server answers ApiError, malformed JSON and turbospark::Error with a
// 400; anything else is a finding.
#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>

#include "formats/chat_template.h"
#include "fuzz_util.h"
#include "server/api.h"

namespace {

const turbospark::ChatTemplate& qwen3_template() {
  static const turbospark::ChatTemplate t = [] {
    std::ifstream in(TS_SOURCE_DIR "/tests/fuzz/corpus/chat_template/qwen3.jinja");
    if (!in) __builtin_trap();
    return turbospark::ChatTemplate::parse(std::string(std::istreambuf_iterator<char>(in), {}), "qwen3");
  }();
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace turbospark;
  using namespace turbospark::server;
  if (size == 0) return 0;
  const int endpoint = data[0] % 3;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    const nlohmann::json j = parse_request_body(body);
    const ApiRequest r = endpoint == 0   ? parse_openai_chat(j, "m")
                         : endpoint == 1 ? parse_openai_completion(j, "m")
                                         : parse_anthropic_messages(j, "m");
    std::vector<std::string> names;
    if (!r.messages.empty()) {
      nlohmann::ordered_json extra = {{"bos_token", ""}, {"eos_token", "<|im_end|>"}, {"enable_thinking", false}};
      if (!r.tools.is_null()) {
        extra["tools"] = r.tools;
        names = tool_names(r.tools);
      }
      (void)apply_chat_template(qwen3_template(), r.messages, true, extra);
    }
    ToolCallParser parser(names);
    std::vector<ToolCall> calls;
    (void)parser.push(body.substr(0, body.size() / 2));
    (void)parser.push(body.substr(body.size() / 2));
    (void)parser.finish(&calls);
  } catch (const ApiError&) {
  } catch (const nlohmann::json::exception&) {
  } catch (const Error&) {
  }
  return 0;
}
