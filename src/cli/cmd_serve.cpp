// turbospark serve: an HTTP server with the OpenAI (/v1/chat/completions, /v1/completions,
// /v1/models) and Anthropic (/v1/messages) APIs, streaming (server-sent events) or not, plus
// /health, Prometheus /metrics and a chat page at /. Requests run on server::ServeEngine's
// slots (see server/engine.h); cpp-httplib (Debian's libcpp-httplib-dev) carries HTTP.
//
// Bad input is a 400 with the API's error object naming the field; an unknown model 404; a
// missing or wrong key (--api-key) 401; a body over --max-body-mb 413. A client that goes
// away mid-stream cancels its request (its slot is freed at the engine's next step).
// SIGINT/SIGTERM stop accepting, cancel what runs, and exit 0.
#include <fmt/format.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "cli/commands.h"
#include "cli/common.h"
#include "core/error.h"
#include "server/api.h"
#include "server/engine.h"

namespace turbospark::cli {

// server/page.cpp
extern const char* const kChatPageHtml;

namespace {

using nlohmann::json;
using server::ApiError;
using server::ApiRequest;
using server::Finish;
using server::RequestHandle;
using server::ServeEvent;

std::atomic<bool> g_stop{false};
extern "C" void on_stop_signal(int) { g_stop.store(true); }

// Constant-time comparison (the key's length is not secret).
bool same_secret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string random_id(const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 rng(std::random_device{}());
  return fmt::format("{}{:016x}{:04x}", prefix, rng(), counter.fetch_add(1) & 0xffff);
}

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

enum class Api { kOpenAi, kAnthropic };

void send_error(httplib::Response& res, Api api, int status, const std::string& message, const std::string& param) {
  res.status = status;
  std::string type;
  if (api == Api::kAnthropic) {
    type = status == 401 ? "authentication_error" : status == 404 ? "not_found_error" : status >= 500 ? "api_error"
                                                                                                          : "invalid_request_error";
    res.set_content(server::anthropic_error(message, type).dump(), "application/json");
  } else {
    type = status == 401 ? "authentication_error" : status == 404 ? "not_found_error" : status >= 500 ? "server_error"
                                                                                                          : "invalid_request_error";
    res.set_content(server::openai_error(message, type, param).dump(), "application/json");
  }
}

std::string sse(const json& data) { return "data: " + data.dump() + "\n\n"; }
std::string sse_event(const char* event, const json& data) {
  return fmt::format("event: {}\ndata: {}\n\n", event, data.dump());
}

// OpenAI's tool_calls array (stream: with each call's index, as deltas carry it).
json tool_calls_json(const std::vector<server::ToolCall>& calls, bool stream) {
  json out = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    json c = {{"id", random_id("call_")}, {"type", "function"},
              {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (stream) c["index"] = i;
    out.push_back(c);
  }
  return out;
}

json usage(int64_t prompt, int64_t completion) {
  return json{{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

// Streams a request's events as server-sent events: `head` first, then render(event) for each
// event as it comes. A client gone (a failed write, or the connection closed) cancels it.
void stream_events(httplib::Response& res, std::shared_ptr<RequestHandle> handle, std::string head,
                   std::function<std::string(const ServeEvent&)> render) {
  res.set_header("Cache-Control", "no-cache");
  auto unsent = std::make_shared<std::string>(std::move(head));
  res.set_chunked_content_provider(
      "text/event-stream",
      [handle, render = std::move(render), unsent](size_t, httplib::DataSink& sink) {
        std::string out = std::move(*unsent);
        unsent->clear();
        const ServeEvent e = handle->next();
        out += render(e);
        // Never an empty write: in chunked encoding a zero-length chunk ends the response.
        if (!out.empty() && !sink.write(out.data(), out.size())) {
          handle->cancel();
          return false;
        }
        if (e.done()) sink.done();
        return true;
      },
      [handle](bool success) {
        if (!success) handle->cancel();
      });
}

struct Server {
  LoadedRuntime& rt;
  server::ServeEngine& engine;
  std::string model_id;

  // Prompt ids and the engine request for an API request.
  server::ServeRequest engine_request(const ApiRequest& ar, bool chat) {
    server::ServeRequest sr;
    if (chat) {
      if (!ar.tools.is_null() && !rt.chat_template)
        throw ApiError(400, "tools", "this model has no chat template, which tools need");
      sr.prompt = conversation_tokens(rt, ar.messages, /*raw=*/false, ar.tools.is_null() ? nullptr : &ar.tools);
    } else {
      sr.prompt = rt.tokenizer->encode(ar.prompt, /*parse_special=*/true, /*add_special=*/true);
    }
    const int64_t room = engine.context() - int64_t(sr.prompt.size());
    if (room <= 0) {
      throw ApiError(400, chat ? "messages" : "prompt",
                     fmt::format("the prompt is {} tokens; this server's context is {} (--ctx)", sr.prompt.size(),
                                 engine.context()));
    }
    // Past the context the reply ends with finish_reason "length", as llama-server does.
    sr.max_tokens = ar.max_tokens < 0 ? room : std::min(ar.max_tokens, room);
    sr.sampling = ar.sampling;
    sr.stop = ar.stop;
    sr.top_logprobs = ar.top_logprobs;
    return sr;
  }

  // Runs an endpoint's body with the API's error handling.
  template <class Fn>
  void guarded(httplib::Response& res, Api api, Fn&& fn) {
    try {
      fn();
    } catch (const ApiError& e) {
      send_error(res, api, e.status, e.what(), e.param);
    } catch (const json::exception& e) {
      send_error(res, api, 400, fmt::format("invalid JSON body: {}", e.what()), "");
    } catch (const Error& e) {
      send_error(res, api, 400, e.what(), "");
    } catch (const std::exception& e) {
      send_error(res, api, 500, e.what(), "");
    }
  }


  // Waits for the whole reply (non-streaming endpoints); the tokens' logprobs when asked.
  static ServeEvent collect(RequestHandle& h, std::string* text, std::vector<server::TokenLogprob>* logprobs = nullptr) {
    for (;;) {
      ServeEvent e = h.next();
      *text += e.text;
      if (logprobs) logprobs->insert(logprobs->end(), e.logprobs.begin(), e.logprobs.end());
      if (e.done()) return e;
    }
  }

  void openai(const httplib::Request& req, httplib::Response& res, bool chat) {
    guarded(res, Api::kOpenAi, [&] {
      const json body = server::parse_request_body(req.body);
      const ApiRequest ar = chat ? server::parse_openai_chat(body, model_id) : server::parse_openai_completion(body, model_id);
      const server::ServeRequest sr = engine_request(ar, chat);
      const int64_t n_prompt = int64_t(sr.prompt.size());
      auto handle = engine.submit(sr);
      const std::string id = random_id(chat ? "chatcmpl-" : "cmpl-");
      const int64_t created = unix_time();
      const char* object = chat ? "chat.completion" : "text_completion";
      if (!ar.stream) {
        std::string text;
        std::vector<server::TokenLogprob> lps;
        const ServeEvent last = collect(*handle, &text, &lps);
        if (last.finish == Finish::kError) throw std::runtime_error(last.error);
        json choice = {{"index", 0}, {"finish_reason", server::openai_finish_reason(last.finish)}};
        const bool with_lp = sr.top_logprobs >= 0;
        if (chat && !ar.tools.is_null()) {
          server::ToolCallParser parser(server::tool_names(ar.tools));
          std::vector<server::ToolCall> calls;
          std::string content = parser.push(text);
          content += parser.finish(&calls);
          choice["message"] = {{"role", "assistant"}, {"content", content.empty() && !calls.empty() ? json(nullptr) : json(content)}};
          if (!calls.empty()) {
            choice["message"]["tool_calls"] = tool_calls_json(calls, false);
            choice["finish_reason"] = "tool_calls";
          }
          choice["logprobs"] = with_lp ? server::chat_logprobs(lps) : json(nullptr);
        } else if (chat) {
          choice["message"] = {{"role", "assistant"}, {"content", text}};
          choice["logprobs"] = with_lp ? server::chat_logprobs(lps) : json(nullptr);
        } else {
          choice["text"] = text;
          choice["logprobs"] = with_lp ? server::completion_logprobs(lps, 0) : json(nullptr);
        }
        const json out = {{"id", id},         {"object", object},      {"created", created},
                          {"model", model_id}, {"choices", {choice}}, {"usage", usage(n_prompt, last.completion_tokens)}};
        res.set_content(out.dump(), "application/json");
        return;
      }
      const std::string chunk_object = chat ? "chat.completion.chunk" : "text_completion";
      const bool with_lp = sr.top_logprobs >= 0;
      auto text_offset = std::make_shared<int64_t>(0);
      auto chunk = [=, model = model_id](const json& delta_or_text, const char* finish,
                                         const std::vector<server::TokenLogprob>& lps = {}) {
        json choice = {{"index", 0}, {"finish_reason", finish ? json(finish) : json(nullptr)}};
        json lp = nullptr;
        if (with_lp && !lps.empty()) {
          lp = chat ? server::chat_logprobs(lps) : server::completion_logprobs(lps, *text_offset);
          for (const auto& t : lps) *text_offset += int64_t(t.token.size());
        }
        if (chat) choice["delta"] = delta_or_text;
        else choice["text"] = delta_or_text;
        choice["logprobs"] = lp;
        return json{{"id", id}, {"object", chunk_object}, {"created", created}, {"model", model}, {"choices", {choice}}};
      };
      const bool include_usage = ar.include_usage;
      // With tools, content passes through a parser that holds back the model's tool calls.
      auto parser = ar.tools.is_null() ? nullptr : std::make_shared<server::ToolCallParser>(server::tool_names(ar.tools));
      stream_events(res, handle, chat ? sse(chunk(json{{"role", "assistant"}, {"content", ""}}, nullptr)) : "",
          [=, model = model_id](const ServeEvent& e) {
            std::string out;
            const std::string text = parser ? parser->push(e.text) : e.text;
            if (!text.empty() || !e.logprobs.empty())
              out += sse(chunk(chat ? json{{"content", text}} : json(text), nullptr, e.logprobs));
            std::vector<server::ToolCall> calls;
            if (e.done() && parser) {
              const std::string rest = parser->finish(&calls);
              if (!rest.empty()) out += sse(chunk(json{{"content", rest}}, nullptr));
              if (!calls.empty()) out += sse(chunk(json{{"tool_calls", tool_calls_json(calls, true)}}, nullptr));
            }
            if (e.done()) {
              if (e.finish == Finish::kError) {
                out += sse(server::openai_error(e.error, "server_error", ""));
              } else {
                const char* finish = calls.empty() ? server::openai_finish_reason(e.finish) : "tool_calls";
                out += sse(chunk(chat ? json::object() : json(""), finish));
                if (include_usage) {
                  out += sse(json{{"id", id}, {"object", chunk_object}, {"created", created}, {"model", model},
                                  {"choices", json::array()}, {"usage", usage(n_prompt, e.completion_tokens)}});
                }
              }
              out += "data: [DONE]\n\n";
            }
            return out;
          });
    });
  }

  void anthropic(const httplib::Request& req, httplib::Response& res) {
    guarded(res, Api::kAnthropic, [&] {
      const json body = server::parse_request_body(req.body);
      const ApiRequest ar = server::parse_anthropic_messages(body, model_id);
      const server::ServeRequest sr = engine_request(ar, /*chat=*/true);
      const int64_t n_prompt = int64_t(sr.prompt.size());
      auto handle = engine.submit(sr);
      const std::string id = random_id("msg_");
      auto stop_sequence = [](const ServeEvent& e) {
        return e.finish == Finish::kStopString ? json(e.stop_string) : json(nullptr);
      };
      if (!ar.stream) {
        std::string text;
        const ServeEvent last = collect(*handle, &text);
        if (last.finish == Finish::kError) throw std::runtime_error(last.error);
        const json out = {{"id", id},
                          {"type", "message"},
                          {"role", "assistant"},
                          {"model", model_id},
                          {"content", {{{"type", "text"}, {"text", text}}}},
                          {"stop_reason", server::anthropic_stop_reason(last.finish)},
                          {"stop_sequence", stop_sequence(last)},
                          {"usage", {{"input_tokens", n_prompt}, {"output_tokens", last.completion_tokens}}}};
        res.set_content(out.dump(), "application/json");
        return;
      }
      const std::string head =
          sse_event("message_start",
                    {{"type", "message_start"},
                     {"message",
                      {{"id", id}, {"type", "message"}, {"role", "assistant"}, {"model", model_id},
                       {"content", json::array()}, {"stop_reason", nullptr}, {"stop_sequence", nullptr},
                       {"usage", {{"input_tokens", n_prompt}, {"output_tokens", 0}}}}}}) +
          sse_event("content_block_start", {{"type", "content_block_start"},
                                            {"index", 0},
                                            {"content_block", {{"type", "text"}, {"text", ""}}}});
      stream_events(res, handle, head,
          [=](const ServeEvent& e) {
            std::string out;
            if (!e.text.empty()) {
              out += sse_event("content_block_delta", {{"type", "content_block_delta"},
                                                       {"index", 0},
                                                       {"delta", {{"type", "text_delta"}, {"text", e.text}}}});
            }
            if (e.done()) {
              if (e.finish == Finish::kError) {
                out += sse_event("error", server::anthropic_error(e.error, "api_error"));
              } else {
                out += sse_event("content_block_stop", {{"type", "content_block_stop"}, {"index", 0}});
                out += sse_event("message_delta",
                                 {{"type", "message_delta"},
                                  {"delta", {{"stop_reason", server::anthropic_stop_reason(e.finish)},
                                             {"stop_sequence", stop_sequence(e)}}},
                                  {"usage", {{"output_tokens", e.completion_tokens}}}});
                out += sse_event("message_stop", {{"type", "message_stop"}});
              }
            }
            return out;
          });
    });
  }
};

}  // namespace

void add_serve_command(CLI::App& app) {
  struct Opts {
    std::string model, host = "127.0.0.1", api_key, alias, device = "auto";
    int port = 8080, parallel = 4, threads = 0;
    int64_t ctx = 0;
    double max_body_mb = 8;
    bool no_prefix_cache = false;
    int64_t kv_pool_tokens = 0;
    bool quiet = false;
    ExpertCacheFlags experts;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "Serve a model over HTTP: OpenAI (/v1/chat/completions, /v1/completions, /v1/models) and Anthropic "
      "(/v1/messages) APIs, streaming or not; /health, /metrics (Prometheus) and a chat page at /");
  cmd->add_option("--model,-m", o->model, "Model directory or .gguf file (default: $TURBOSPARK_MODEL, then the installed default)");
  cmd->add_option("--host", o->host, "Address to listen on (0.0.0.0: every interface)")->capture_default_str();
  cmd->add_option("--port", o->port, "Port (0: any free port, printed at start)")->capture_default_str();
  cmd->add_option("--parallel", o->parallel, "Sequence slots: requests running at once (more wait in a queue)")
      ->capture_default_str();
  cmd->add_option("--ctx", o->ctx, "Context per slot in tokens (default: the model's, at most 8192)");
  cmd->add_option("--api-key", o->api_key,
                  "Require this key (Authorization: Bearer KEY, or x-api-key) on every endpoint but /health");
  cmd->add_option("--alias", o->alias, "Model id the API reports and requests name (default: the file or folder name)");
  cmd->add_option("--max-body-mb", o->max_body_mb, "Largest request body in MiB (larger: 413)")->capture_default_str();
  cmd->add_option("--kv-pool-tokens", o->kv_pool_tokens,
                  "KV cache positions shared by all slots (default 0: --parallel x --ctx); with fewer, requests wait "
                  "for blocks and a reply that finds none preempts the newest request, which is recomputed later");
  cmd->add_flag("--no-prefix-cache", o->no_prefix_cache,
                "Compute every prompt in full (by default, full KV blocks of earlier requests that begin a prompt "
                "the same way are reused)");
  cmd->add_option("--threads", o->threads, "Worker threads (default: all cores)");
  cmd->add_option("--device", o->device, "cpu, cuda or auto (cuda when built with it and a GPU is present)")
      ->capture_default_str();
  cmd->add_flag("--quiet,-q", o->quiet, "No load progress or request log on stderr");
  add_expert_cache_options(cmd, o->experts);
  cmd->callback([o] {
    if (o->port < 0 || o->port > 65535) fail("--port must be in 0..65535, got {}", o->port);
    if (o->parallel < 1 || o->parallel > 256) fail("--parallel must be in 1..256, got {}", o->parallel);
    if (o->ctx < 0) fail("--ctx must be >= 0, got {}", o->ctx);
    if (!(o->max_body_mb > 0 && o->max_body_mb <= 1024)) fail("--max-body-mb must be in (0, 1024], got {}", o->max_body_mb);
    const std::string path = o->model.empty() ? default_model_path() : o->model;
    LoadedRuntime rt = load_runtime(path, o->device, o->threads, o->quiet, o->experts);
    if (!rt.tokenizer) fail("{}: no tokenizer (tokenizer.json or GGUF vocabulary); serve needs one", path);
    const Model& model = *rt.model.model;
    const int64_t ctx = o->ctx != 0 ? o->ctx : std::min<int64_t>(model.info().max_context, 8192);
    std::string id = o->alias;
    if (id.empty()) {
      std::filesystem::path p(path);
      while (!p.empty() && p.filename().empty()) p = p.parent_path();  // a trailing '/'
      id = p.extension() == ".gguf" ? p.stem().string() : p.filename().string();
    }
    if (o->kv_pool_tokens < 0) fail("--kv-pool-tokens must be >= 0 (0: --parallel x --ctx), got {}", o->kv_pool_tokens);
    server::ServeEngine engine(rt, o->parallel, ctx, 0, !o->no_prefix_cache, o->kv_pool_tokens);
    if (!o->quiet) {
      // Features the family lacks are said once, not silently skipped (the capability table).
      const Capabilities caps = model.capabilities();
      if (!caps.prefix_cache.on && !o->no_prefix_cache)
        fmt::print(stderr, "serve: prefix cache off: {}\n", caps.prefix_cache.why_not);
    }
    Server s{rt, engine, id};

    httplib::Server http;
    const size_t http_threads = size_t(std::max(8, 2 * o->parallel + 4));
    http.new_task_queue = [http_threads] { return new httplib::ThreadPool(http_threads); };
    http.set_payload_max_length(size_t(o->max_body_mb * 1024 * 1024));
    // Short socket timeouts bound shutdown: httplib's stop() waits for every connection's
    // thread, and one idle in a keep-alive connection sits in a read until its timeout (with
    // 60 s, SIGTERM took a minute when a client kept its connection open).
    http.set_read_timeout(std::chrono::seconds(5));
    http.set_keep_alive_timeout(2);
    const std::string key = o->api_key;
    http.set_pre_routing_handler([key](const httplib::Request& req, httplib::Response& res) {
      if (key.empty() || req.path == "/health" || req.path == "/") return httplib::Server::HandlerResponse::Unhandled;
      std::string given;
      const std::string auth = req.get_header_value("Authorization");
      if (auth.rfind("Bearer ", 0) == 0) given = auth.substr(7);
      if (given.empty()) given = req.get_header_value("x-api-key");
      if (same_secret(given, key)) return httplib::Server::HandlerResponse::Unhandled;
      send_error(res, req.path == "/v1/messages" ? Api::kAnthropic : Api::kOpenAi, 401,
                 given.empty() ? "an API key is required (Authorization: Bearer KEY)" : "invalid API key", "");
      return httplib::Server::HandlerResponse::Handled;
    });
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      const Api api = req.path == "/v1/messages" ? Api::kAnthropic : Api::kOpenAi;
      if (res.status == 404) send_error(res, api, 404, fmt::format("no route for {} {}", req.method, req.path), "");
      else if (res.status == 413) send_error(res, api, 413, "request body too large (the server's --max-body-mb)", "");
      else if (res.status >= 400) send_error(res, api, res.status, fmt::format("HTTP {}", res.status), "");
    });
    http.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"status":"ok"})", "application/json");
    });
    http.Get("/v1/models", [&s](const httplib::Request&, httplib::Response& res) {
      const json out = {{"object", "list"},
                        {"data", {{{"id", s.model_id}, {"object", "model"}, {"created", unix_time()}, {"owned_by", "turbospark"}}}}};
      res.set_content(out.dump(), "application/json");
    });
    http.Get("/metrics", [&engine](const httplib::Request&, httplib::Response& res) {
      res.set_content(engine.prometheus(), "text/plain; version=0.0.4");
    });
    http.Get("/", [](const httplib::Request&, httplib::Response& res) { res.set_content(kChatPageHtml, "text/html; charset=utf-8"); });
    http.Post("/v1/chat/completions", [&s](const httplib::Request& req, httplib::Response& res) { s.openai(req, res, true); });
    http.Post("/v1/completions", [&s](const httplib::Request& req, httplib::Response& res) { s.openai(req, res, false); });
    http.Post("/v1/messages", [&s](const httplib::Request& req, httplib::Response& res) { s.anthropic(req, res); });

    int port = o->port;
    if (port == 0) {
      port = http.bind_to_any_port(o->host);
      if (port < 0) fail("cannot listen on {} (any port)", o->host);
    } else if (!http.bind_to_port(o->host, port)) {
      fail("cannot listen on {}:{} (in use, or not an address of this machine)", o->host, port);
    }
    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);
    std::signal(SIGPIPE, SIG_IGN);
    // On a signal: cancel every request first (their HTTP threads are waiting on the engine and
    // would hold up the server's shutdown), then stop the server.
    std::thread watcher([&http, &engine] {
      while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      engine.shutdown();
      http.stop();
    });
    fmt::print(stderr, "turbospark serve: listening on http://{}:{} (model '{}', {} slots of {} tokens, steps of up to {} "
               "rows{})\n", o->host, port, id, o->parallel, ctx, engine.step_rows(),
               o->api_key.empty() ? "" : ", API key required");
    std::fflush(stderr);
    const bool ok = http.listen_after_bind();
    const bool by_signal = g_stop.exchange(true);
    watcher.join();
    if (!ok && !by_signal) fail("the HTTP server stopped unexpectedly");
    if (!o->quiet) fmt::print(stderr, "turbospark serve: stopped\n");
  });
}

}  // namespace turbospark::cli
