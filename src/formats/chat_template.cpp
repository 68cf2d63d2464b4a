// Public face of the chat-template interpreter: parse once, render many times, and turn the
// interpreter's TemplateError into turbospark::Error with the template's name and line.
#include "formats/chat_template.h"

#include "core/error.h"
#include "formats/chat_template_detail.h"

namespace turbospark {

namespace {

[[noreturn]] void rethrow(const std::string& name, const chat_template_detail::TemplateError& e) {
  if (e.line > 0) fail("chat template {}: {} at line {}", name, e.what(), e.line);
  fail("chat template {}: {}", name, e.what());
}

}  // namespace

ChatTemplate ChatTemplate::parse(std::string source, std::string name_for_errors) {
  ChatTemplate t;
  t.name_ = std::move(name_for_errors);
  t.source_ = std::move(source);
  try {
    t.program_ = chat_template_detail::parse_program(t.source_);
  } catch (const chat_template_detail::TemplateError& e) {
    rethrow(t.name_, e);
  }
  return t;
}

std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
  TS_CHECK(program_ != nullptr, "chat template {}: rendered before parse()", name_);
  try {
    return chat_template_detail::render_program(*program_, context);
  } catch (const chat_template_detail::TemplateError& e) {
    rethrow(name_, e);
  }
}

std::string ChatTemplate::render(const nlohmann::json& context) const { return render(nlohmann::ordered_json(context)); }

nlohmann::ordered_json chat_template_context(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                             const nlohmann::ordered_json& extra) {
  TS_CHECK(extra.is_object(), "chat template context: extra variables must be a JSON object");
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const ChatMessage& m : messages) {
    TS_CHECK(m.fields.is_object() || m.fields.is_null(), "chat message fields must be a JSON object (role '{}')", m.role);
    nlohmann::ordered_json msg = nlohmann::ordered_json::object();
    msg["role"] = m.role;
    msg["content"] = m.content;
    if (m.fields.is_object())
      for (auto it = m.fields.begin(); it != m.fields.end(); ++it) msg[it.key()] = it.value();
    list.push_back(std::move(msg));
  }
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = std::move(list);
  context["tools"] = nullptr;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = add_generation_prompt;
  for (auto it = extra.begin(); it != extra.end(); ++it) context[it.key()] = it.value();
  return context;
}

std::string apply_chat_template(const ChatTemplate& chat_template, const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt, const nlohmann::ordered_json& extra) {
  return chat_template.render(chat_template_context(messages, add_generation_prompt, extra));
}

}  // namespace turbospark
