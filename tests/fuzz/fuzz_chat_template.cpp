// Chat templates (Jinja subset): the lexer, parser and renderer on arbitrary source, rendered
// with a conversation that exercises roles, tool calls and the usual variables.
#include <cstdint>
#include <string>

#include "formats/chat_template.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace turbospark;
  const std::string source(reinterpret_cast<const char*>(data), size);
  fuzz::refusals_only([&] {
    const ChatTemplate t = ChatTemplate::parse(source, "fuzz");
    ChatMessage tool_call{"assistant", "", nlohmann::ordered_json::object()};
    tool_call.fields["tool_calls"] = nlohmann::ordered_json::parse(
        R"([{"type":"function","function":{"name":"f","arguments":{"x":1}}}])");
    const std::vector<ChatMessage> messages = {
        {"system", "Be brief."}, {"user", "Hi <b>&</b>"}, tool_call, {"tool", "{\"ok\":true}"}, {"user", "Bye"}};
    nlohmann::ordered_json extra = {{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"enable_thinking", false}};
    extra["tools"] = nlohmann::ordered_json::parse(
        R"([{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}])");
    (void)apply_chat_template(t, messages, true, extra);
  });
  return 0;
}
