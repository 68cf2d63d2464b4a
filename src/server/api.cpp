#include "server/api.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <random>

namespace turbospark::server {
namespace {

using nlohmann::json;

[[noreturn]] void bad(const std::string& param, const std::string& message) { throw ApiError(400, param, message); }

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "a number";
  }
}

void require_object(const json& body) {
  if (!body.is_object()) bad("", fmt::format("the request body must be a JSON object, got {}", type_name(body)));
}

// A finite number in [lo, hi] (null or absent: `fallback`).
double number(const json& body, const char* key, double lo, double hi, double fallback) {
  if (!body.contains(key) || body[key].is_null()) return fallback;
  const json& v = body[key];
  if (!v.is_number()) bad(key, fmt::format("'{}' must be a number, got {}", key, type_name(v)));
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi) bad(key, fmt::format("'{}' must be in [{}, {}], got {}", key, lo, hi, x));
  return x;
}

int64_t integer(const json& body, const char* key, int64_t lo, int64_t hi, int64_t fallback) {
  if (!body.contains(key) || body[key].is_null()) return fallback;
  const json& v = body[key];
  if (!v.is_number_integer() && !v.is_number_unsigned()) {
    bad(key, fmt::format("'{}' must be an integer, got {}", key, v.is_number() ? v.dump() : type_name(v)));
  }
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(hi)) {
    bad(key, fmt::format("'{}' must be in [{}, {}], got {}", key, lo, hi, v.dump()));
  }
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) bad(key, fmt::format("'{}' must be in [{}, {}], got {}", key, lo, hi, x));
  return x;
}

bool boolean(const json& body, const char* key, bool fallback) {
  if (!body.contains(key) || body[key].is_null()) return fallback;
  if (!body[key].is_boolean()) bad(key, fmt::format("'{}' must be a boolean, got {}", key, type_name(body[key])));
  return body[key].get<bool>();
}

std::string model_of(const json& body, const std::string& served, bool required) {
  if (!body.contains("model") || body["model"].is_null()) {
    if (required) bad("model", "'model' is required");
    return served;
  }
  if (!body["model"].is_string()) bad("model", fmt::format("'model' must be a string, got {}", type_name(body["model"])));
  const std::string m = body["model"].get<std::string>();
  if (m != served) throw ApiError(404, "model", fmt::format("model '{}' does not exist; this server has '{}'", m, served));
  return m;
}

// "stop" / "stop_sequences": a string or an array of at most 16 non-empty strings.
std::vector<std::string> stops(const json& body, const char* key) {
  std::vector<std::string> out;
  if (!body.contains(key) || body[key].is_null()) return out;
  const json& v = body[key];
  if (v.is_string()) {
    out.push_back(v.get<std::string>());
  } else if (v.is_array()) {
    if (v.size() > 16) bad(key, fmt::format("'{}' holds at most 16 strings, got {}", key, v.size()));
    for (const json& s : v) {
      if (!s.is_string()) bad(key, fmt::format("'{}' must hold strings, got {}", key, type_name(s)));
      out.push_back(s.get<std::string>());
    }
  } else {
    bad(key, fmt::format("'{}' must be a string or an array of strings, got {}", key, type_name(v)));
  }
  for (const std::string& s : out)
    if (s.empty()) bad(key, fmt::format("'{}' strings must not be empty", key));
  return out;
}

// Message content: a string, or an array of {"type": "text", "text": ...} parts (joined).
std::string content_text(const json& c, const std::string& where) {
  if (c.is_string()) return c.get<std::string>();
  if (c.is_null()) return {};
  if (!c.is_array()) bad(where, fmt::format("'{}' must be a string or an array of content parts, got {}", where, type_name(c)));
  std::string text;
  for (const json& part : c) {
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      bad(where, fmt::format("each part of '{}' must be an object with a 'type'", where));
    const std::string type = part["type"].get<std::string>();
    if (type != "text") bad(where, fmt::format("content part type '{}' is not supported (text only)", type));
    if (!part.contains("text") || !part["text"].is_string())
      bad(where, fmt::format("a text part of '{}' needs a string 'text'", where));
    text += part["text"].get<std::string>();
  }
  return text;
}

void refuse_unsupported(const json& body) {
  for (const char* key : {"functions", "function_call"}) {
    if (body.contains(key) && !body[key].is_null() && !(body[key].is_array() && body[key].empty()))
      throw ApiError(400, key, fmt::format("'{}' (the deprecated form) is not supported; use 'tools'", key));
  }
  if (integer(body, "n", 1, 1 << 20, 1) != 1) throw ApiError(400, "n", "'n' must be 1 (one choice per request)");
  if (body.contains("response_format") && !body["response_format"].is_null()) {
    const json& rf = body["response_format"];
    if (!(rf.is_object() && rf.value("type", "") == "text"))
      throw ApiError(400, "response_format", "'response_format' other than text is not supported by this server yet");
  }
}

// temperature, top_p, top_k, min_p, seed: the OpenAI ranges (top_k/min_p as llama-server).
void sampling(const json& body, SamplingParams* sp, double max_temperature) {
  sp->temperature = float(number(body, "temperature", 0, max_temperature, 1.0));
  sp->top_p = float(number(body, "top_p", 0, 1, 1.0));
  if (body.contains("top_p") && !body["top_p"].is_null() && sp->top_p <= 0.f) bad("top_p", "'top_p' must be in (0, 1]");
  sp->top_k = int(integer(body, "top_k", 0, 1 << 30, 0));
  sp->min_p = float(number(body, "min_p", 0, 1, 0.0));
  // No seed: a fresh one per request (a fixed default would repeat every "random" reply).
  const bool seeded = body.contains("seed") && !body["seed"].is_null();
  sp->seed = seeded ? uint64_t(integer(body, "seed", INT64_MIN, INT64_MAX, 0)) : std::random_device{}();
}

}  // namespace

nlohmann::json parse_request_body(const std::string& body) {
  return nlohmann::json::parse(body, [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
    if (depth > kMaxJsonDepth)
      throw ApiError(400, "", fmt::format("the JSON body is nested deeper than {} levels", kMaxJsonDepth));
    return true;
  });
}

ApiRequest parse_openai_chat(const json& body, const std::string& served_model) {
  require_object(body);
  ApiRequest r;
  r.model = model_of(body, served_model, /*required=*/false);
  refuse_unsupported(body);
  if (!body.contains("messages")) bad("messages", "'messages' is required");
  const json& msgs = body["messages"];
  if (!msgs.is_array() || msgs.empty()) bad("messages", "'messages' must be a non-empty array");
  for (size_t i = 0; i < msgs.size(); ++i) {
    const json& m = msgs[i];
    const std::string where = fmt::format("messages[{}]", i);
    if (!m.is_object()) bad(where, fmt::format("'{}' must be an object, got {}", where, type_name(m)));
    if (!m.contains("role") || !m["role"].is_string()) bad(where + ".role", fmt::format("'{}.role' must be a string", where));
    std::string role = m["role"].get<std::string>();
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      bad(where + ".role",
          fmt::format("'{}.role' must be system, developer, user, assistant or tool, got '{}'", where, role));
    const bool has_calls = role == "assistant" && m.contains("tool_calls") && !m["tool_calls"].is_null();
    if (!m.contains("content") && !has_calls) bad(where + ".content", fmt::format("'{}.content' is required", where));
    ChatMessage cm{role, m.contains("content") ? content_text(m["content"], where + ".content") : std::string()};
    if (has_calls) {
      // As templates read them: function.arguments as an object (OpenAI sends a JSON string).
      const json& calls = m["tool_calls"];
      if (!calls.is_array()) bad(where + ".tool_calls", fmt::format("'{}.tool_calls' must be an array", where));
      nlohmann::ordered_json out = nlohmann::ordered_json::array();
      for (const json& c : calls) {
        if (!c.is_object() || !c.contains("function") || !c["function"].is_object() ||
            !c["function"].contains("name") || !c["function"]["name"].is_string())
          bad(where + ".tool_calls", fmt::format("each of '{}.tool_calls' needs function.name", where));
        nlohmann::ordered_json fn = {{"name", c["function"]["name"]}};
        const json args = c["function"].value("arguments", json("{}"));
        if (args.is_string()) {
          const json parsed = json::parse(args.get<std::string>(), nullptr, /*allow_exceptions=*/false);
          fn["arguments"] = parsed.is_discarded() ? nlohmann::ordered_json(args) : nlohmann::ordered_json(parsed);
        } else {
          fn["arguments"] = args;
        }
        out.push_back({{"id", c.value("id", "")}, {"type", "function"}, {"function", fn}});
      }
      cm.fields["tool_calls"] = out;
    }
    if (role == "tool" && m.contains("tool_call_id") && m["tool_call_id"].is_string())
      cm.fields["tool_call_id"] = m["tool_call_id"].get<std::string>();
    r.messages.push_back(std::move(cm));
  }
  if (body.contains("tools") && !body["tools"].is_null()) {
    const json& tools = body["tools"];
    if (!tools.is_array()) bad("tools", "'tools' must be an array");
    for (size_t i = 0; i < tools.size(); ++i) {
      const json& t = tools[i];
      if (!t.is_object() || t.value("type", "") != "function" || !t.contains("function") || !t["function"].is_object() ||
          !t["function"].contains("name") || !t["function"]["name"].is_string())
        bad("tools", fmt::format("tools[{}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", i));
    }
    std::string choice = "auto";
    if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
      if (!body["tool_choice"].is_string() ||
          (body["tool_choice"] != "auto" && body["tool_choice"] != "none"))
        throw ApiError(400, "tool_choice", "'tool_choice' other than \"auto\" or \"none\" is not supported yet");
      choice = body["tool_choice"].get<std::string>();
    }
    if (!tools.empty() && choice == "auto") r.tools = nlohmann::ordered_json::parse(tools.dump());
  }
  sampling(body, &r.sampling, 2.0);
  const int64_t mt = integer(body, "max_completion_tokens", 1, int64_t(1) << 31, -1);
  r.max_tokens = integer(body, "max_tokens", 1, int64_t(1) << 31, mt);
  r.stop = stops(body, "stop");
  r.stream = boolean(body, "stream", false);
  // logprobs: true adds each token's log-probability; top_logprobs (0..20) the n best.
  const bool logprobs = boolean(body, "logprobs", false);
  const int64_t top = integer(body, "top_logprobs", 0, 20, -1);
  if (top >= 0 && !logprobs) bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  r.top_logprobs = logprobs ? int(std::max<int64_t>(top, 0)) : -1;
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const json& so = body["stream_options"];
    if (!so.is_object()) bad("stream_options", "'stream_options' must be an object");
    r.include_usage = boolean(so, "include_usage", false);
  }
  return r;
}

ApiRequest parse_openai_completion(const json& body, const std::string& served_model) {
  require_object(body);
  ApiRequest r;
  r.model = model_of(body, served_model, /*required=*/false);
  refuse_unsupported(body);
  if (body.contains("echo") && boolean(body, "echo", false)) throw ApiError(400, "echo", "'echo' is not supported by this server yet");
  if (body.contains("suffix") && !body["suffix"].is_null()) throw ApiError(400, "suffix", "'suffix' is not supported by this server yet");
  if (!body.contains("prompt")) bad("prompt", "'prompt' is required");
  const json& p = body["prompt"];
  if (p.is_string()) {
    r.prompt = p.get<std::string>();
  } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
    r.prompt = p[0].get<std::string>();
  } else {
    bad("prompt", "'prompt' must be a string (or an array of one string)");
  }
  if (r.prompt.empty()) bad("prompt", "'prompt' must not be empty");
  sampling(body, &r.sampling, 2.0);
  r.max_tokens = integer(body, "max_tokens", 1, int64_t(1) << 31, 16);  // the API's default
  r.top_logprobs = int(integer(body, "logprobs", 0, 5, -1));  // the legacy API: an integer, at most 5
  r.stop = stops(body, "stop");
  r.stream = boolean(body, "stream", false);
  if (body.contains("stream_options") && body["stream_options"].is_object())
    r.include_usage = boolean(body["stream_options"], "include_usage", false);
  return r;
}

ApiRequest parse_anthropic_messages(const json& body, const std::string& served_model) {
  require_object(body);
  ApiRequest r;
  r.model = model_of(body, served_model, /*required=*/true);
  for (const char* key : {"tools", "tool_choice"})
    if (body.contains(key) && !body[key].is_null() && !(body[key].is_array() && body[key].empty()))
      throw ApiError(400, key, fmt::format("'{}' is not supported by this server yet", key));
  if (!body.contains("max_tokens")) bad("max_tokens", "'max_tokens' is required");
  r.max_tokens = integer(body, "max_tokens", 1, int64_t(1) << 31, 1);
  if (body.contains("system") && !body["system"].is_null())
    r.messages.push_back({"system", content_text(body["system"], "system")});
  if (!body.contains("messages")) bad("messages", "'messages' is required");
  const json& msgs = body["messages"];
  if (!msgs.is_array() || msgs.empty()) bad("messages", "'messages' must be a non-empty array");
  for (size_t i = 0; i < msgs.size(); ++i) {
    const json& m = msgs[i];
    const std::string where = fmt::format("messages.{}", i);
    if (!m.is_object()) bad(where, fmt::format("'{}' must be an object", where));
    if (!m.contains("role") || !m["role"].is_string()) bad(where + ".role", fmt::format("'{}.role' must be a string", where));
    const std::string role = m["role"].get<std::string>();
    if (role != "user" && role != "assistant")
      bad(where + ".role", fmt::format("'{}.role' must be user or assistant, got '{}'", where, role));
    if (!m.contains("content")) bad(where + ".content", fmt::format("'{}.content' is required", where));
    r.messages.push_back({role, content_text(m["content"], where + ".content")});
  }
  sampling(body, &r.sampling, 1.0);  // Anthropic's temperature range is [0, 1]
  r.stop = stops(body, "stop_sequences");
  r.stream = boolean(body, "stream", false);
  return r;
}

json openai_error(const std::string& message, const std::string& type, const std::string& param) {
  return json{{"error",
               {{"message", message}, {"type", type}, {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", nullptr}}}};
}

json anthropic_error(const std::string& message, const std::string& type) {
  return json{{"type", "error"}, {"error", {{"type", type}, {"message", message}}}};
}

namespace {

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}

}  // namespace

namespace {

const std::string kCallOpen = "<tool_call>", kCallClose = "</tool_call>";

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \n\t\r");
  if (a == std::string::npos) return {};
  const size_t b = s.find_last_not_of(" \n\t\r");
  return s.substr(a, b - a + 1);
}

// Whether the reply so far may still turn out to be a bare or fenced JSON call.
bool may_be_json_call(const std::string& text) {
  const std::string t = trim(text);
  if (t.empty()) return true;
  if (t[0] == '{' || t[0] == '[') return true;
  static const std::string kFence = "```json";
  if (t.size() <= kFence.size()) return kFence.compare(0, t.size(), t) == 0 || t.rfind("```", 0) == 0;
  return t.rfind("```", 0) == 0;
}

}  // namespace

std::vector<std::string> tool_names(const nlohmann::ordered_json& tools) {
  std::vector<std::string> names;
  if (tools.is_array())
    for (const auto& t : tools) names.push_back(t["function"]["name"].get<std::string>());
  return names;
}

bool ToolCallParser::json_call(const std::string& text, std::vector<ToolCall>* calls) const {
  std::string t = trim(text);
  if (t.rfind("```", 0) == 0) {  // ```json ... ```
    const size_t nl = t.find('\n');
    const size_t end = t.rfind("```");
    if (nl == std::string::npos || end <= nl) return false;
    t = trim(t.substr(nl + 1, end - nl - 1));
  }
  const json j = json::parse(t, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return false;
  std::vector<ToolCall> found;
  for (const json& c : j.is_array() ? j : json::array({j})) {
    if (!c.is_object() || !c.contains("name") || !c["name"].is_string()) return false;
    const std::string name = c["name"].get<std::string>();
    if (std::find(names_.begin(), names_.end(), name) == names_.end()) return false;
    const json args = c.contains("arguments") ? c["arguments"] : c.value("parameters", json::object());
    found.push_back({name, args.is_string() ? args.get<std::string>() : args.dump()});
  }
  if (found.empty()) return false;
  calls->insert(calls->end(), found.begin(), found.end());
  return true;
}

std::string ToolCallParser::push(const std::string& piece) {
  pending_ += piece;
  if (in_calls_) return {};
  const size_t at = pending_.find(kCallOpen);
  if (at != std::string::npos) {
    in_calls_ = true;
    std::string out = maybe_json_ ? std::string() : pending_.substr(0, at);
    if (!maybe_json_) pending_.erase(0, at);
    return out;
  }
  if (maybe_json_ && may_be_json_call(pending_)) return {};
  maybe_json_ = false;
  const size_t hold = stop_prefix_hold(pending_, {kCallOpen});
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string ToolCallParser::finish(std::vector<ToolCall>* calls) {
  if (maybe_json_ && !in_calls_ && json_call(pending_, calls)) {
    pending_.clear();
    return {};
  }
  std::string content;
  size_t pos = 0;
  while (pos < pending_.size()) {
    const size_t open = pending_.find(kCallOpen, pos);
    if (open == std::string::npos) {
      content += pending_.substr(pos);
      break;
    }
    content += pending_.substr(pos, open - pos);
    const size_t body = open + kCallOpen.size();
    const size_t close = pending_.find(kCallClose, body);
    const std::string block = pending_.substr(body, close == std::string::npos ? std::string::npos : close - body);
    const json j = json::parse(block, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded() && j.is_object() && j.contains("name") && j["name"].is_string()) {
      const json args = j.value("arguments", json::object());
      calls->push_back({j["name"].get<std::string>(), args.is_string() ? args.get<std::string>() : args.dump()});
    } else {
      content += pending_.substr(open, close == std::string::npos ? std::string::npos : close + kCallClose.size() - open);
    }
    pos = close == std::string::npos ? pending_.size() : close + kCallClose.size();
  }
  pending_.clear();
  // What is left between and around calls is usually whitespace: drop it then.
  if (!calls->empty() && trim(content).empty()) content.clear();
  return content;
}

json chat_logprobs(const std::vector<TokenLogprob>& tokens) {
  json content = json::array();
  for (const TokenLogprob& t : tokens) {
    json top = json::array();
    for (const auto& [text, lp] : t.top) top.push_back({{"token", text}, {"logprob", lp}, {"bytes", bytes_of(text)}});
    content.push_back({{"token", t.token}, {"logprob", t.logprob}, {"bytes", bytes_of(t.token)}, {"top_logprobs", top}});
  }
  return json{{"content", content}};
}

json completion_logprobs(const std::vector<TokenLogprob>& tokens, int64_t text_offset) {
  json toks = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  for (const TokenLogprob& t : tokens) {
    toks.push_back(t.token);
    lps.push_back(t.logprob);
    json top = json::object();
    for (const auto& [text, lp] : t.top) top[text] = lp;
    tops.push_back(top);
    offsets.push_back(text_offset);
    text_offset += int64_t(t.token.size());
  }
  return json{{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

const char* openai_finish_reason(Finish f) {
  switch (f) {
    case Finish::kLength: return "length";
    case Finish::kStop:
    case Finish::kStopString: return "stop";
    default: return nullptr;
  }
}

const char* anthropic_stop_reason(Finish f) {
  switch (f) {
    case Finish::kLength: return "max_tokens";
    case Finish::kStopString: return "stop_sequence";
    case Finish::kStop: return "end_turn";
    default: return nullptr;
  }
}

}  // namespace turbospark::server
