// Chat templates: the Jinja2 programs that Hugging Face checkpoints ship (tokenizer_config.json
// "chat_template", chat_template.jinja, GGUF tokenizer.chat_template) to turn a conversation
// into the prompt text. turbospark renders them itself, byte-identically to what transformers'
// apply_chat_template produces with jinja2: a sandboxed environment with trim_blocks and
// lstrip_blocks, the loopcontrols extension (break/continue), transformers' tojson filter
// (json.dumps with ensure_ascii=False) and its raise_exception / strftime_now globals.
//
// The interpreter implements the part of Jinja2 that chat templates use (see
// tests/unit/test_chat_template.cpp for the real templates it is checked against). Anything
// outside that subset -- an unknown tag, filter, test or method, {% include %}, {% call %},
// printf-style '%' on strings, case conversion of scripts it has no table for -- fails with
// turbospark::Error naming the construct and the line instead of rendering something else.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace turbospark {

namespace chat_template_detail {
struct Program;
}

struct ChatMessage {
  std::string role;
  std::string content;
  // Further fields of the message as templates read them: tool_calls, reasoning_content,
  // tool_call_id, name, ... Keys keep their order (tojson prints them in that order). A
  // "content" key here replaces `content`, e.g. null for a tool-call turn or a list of parts.
  nlohmann::ordered_json fields = nlohmann::ordered_json::object();
};

class ChatTemplate {
 public:
  // Throws turbospark::Error on syntax errors and unsupported constructs:
  // "chat template NAME: unsupported filter 'xmlattr' at line 12".
  static ChatTemplate parse(std::string source, std::string name_for_errors);

  // Renders with `context` as the template's variables (messages, add_generation_prompt,
  // bos_token, eos_token, tools, enable_thinking, ...). Use ordered_json so objects keep their
  // key order, as Python dicts do; the nlohmann::json overload sorts keys (its storage does).
  // Throws turbospark::Error for runtime errors, including the template's raise_exception().
  std::string render(const nlohmann::ordered_json& context) const;
  std::string render(const nlohmann::json& context) const;

  const std::string& name() const { return name_; }
  const std::string& source() const { return source_; }

 private:
  std::shared_ptr<const chat_template_detail::Program> program_;
  std::string name_;
  std::string source_;
};

// The context transformers' apply_chat_template(messages, add_generation_prompt=...,
// **extra) passes to the template: messages, tools=None, documents=None,
// add_generation_prompt, then every key of `extra` (bos_token, eos_token, tools,
// enable_thinking, ...), which may replace the defaults.
nlohmann::ordered_json chat_template_context(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                             const nlohmann::ordered_json& extra = nlohmann::ordered_json::object());

std::string apply_chat_template(const ChatTemplate& chat_template, const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt,
                                const nlohmann::ordered_json& extra = nlohmann::ordered_json::object());

}  // namespace turbospark
