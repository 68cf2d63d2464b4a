// Tree-walking evaluator for parsed chat templates.
//
// Scoping copies jinja2's observable behaviour: `if` shares its enclosing scope; each
// iteration of a `for` body, a macro call, a `with` body and the body of a `{% set %}` or
// `{% filter %}` block get a fresh child scope, so assignments there never leak out (a
// template that wants state across iterations must use namespace()). Macros see their
// defining scope by reference, so they read variables as they are at call time.
#include <fmt/format.h>

#include "formats/chat_template_detail.h"

namespace turbospark::chat_template_detail {

struct Scope {
  std::vector<std::pair<std::string, Value>> vars;
  std::shared_ptr<Scope> parent;

  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get())
      for (const auto& [k, v] : s->vars)
        if (k == name) return &v;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, old] : vars) {
      if (k == name) {
        old = std::move(v);
        return;
      }
    }
    vars.emplace_back(name, std::move(v));
  }
};

class Evaluator {
 public:
  explicit Evaluator(std::shared_ptr<Scope> root) : scope_(std::move(root)) {}

  std::string render(const Body& body) {
    std::string out;
    out_ = &out;
    exec_body(body);
    return out;
  }

  int line() const { return line_; }

 private:
  enum class Flow { Normal, Break, Continue };

  std::shared_ptr<Scope> scope_;
  std::string* out_ = nullptr;
  const Value* placeholder_ = nullptr;
  int line_ = 0;
  int macro_depth_ = 0;

  // Runs `fn` with a child scope (and optionally a fresh output buffer), restoring both.
  template <typename Fn>
  void in_child_scope(std::shared_ptr<Scope> parent, std::string* out, Fn&& fn) {
    auto saved_scope = scope_;
    auto* saved_out = out_;
    scope_ = std::make_shared<Scope>();
    scope_->parent = std::move(parent);  // by value: callers pass scope_ itself
    if (out) out_ = out;
    try {
      fn();
    } catch (...) {
      scope_ = saved_scope;
      out_ = saved_out;
      throw;
    }
    scope_ = saved_scope;
    out_ = saved_out;
  }

  Flow exec_body(const Body& body) {
    for (const auto& st : body) {
      Flow f = exec(*st);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  void assign(const Target& t, Value v) {
    switch (t.kind) {
      case Target::Kind::Name: scope_->set(t.names[0], std::move(v)); return;
      case Target::Kind::Tuple: {
        require_defined_value(v);
        std::vector<Value> items = iterate(v);
        if (items.size() != t.names.size()) {
          if (items.size() > t.names.size()) raise(fmt::format("too many values to unpack (expected {})", t.names.size()));
          raise(fmt::format("not enough values to unpack (expected {}, got {})", t.names.size(), items.size()));
        }
        for (size_t k = 0; k < items.size(); ++k) scope_->set(t.names[k], std::move(items[k]));
        return;
      }
      case Target::Kind::Attr: {
        const Value* ns = scope_->find(t.names[0]);
        if (!ns || ns->kind != Kind::Dict || ns->dict->kind != DictKind::Namespace)
          raise("cannot assign attribute on non-namespace object");
        ns->dict->set(t.attr, std::move(v));
        return;
      }
    }
  }

  static void require_defined_value(const Value& v) {
    if (v.is_undefined()) raise(v.s);
  }

  // Evaluation depth over statements, expressions and macro calls together: each level is a
  // few stack frames, and a macro recursing through deep expressions multiplies them.
  static constexpr int kMaxEvalDepth = 2000;
  int eval_depth_ = 0;
  struct Deeper {
    explicit Deeper(Evaluator& e) : e_(e) {
      if (++e_.eval_depth_ > kMaxEvalDepth) {
        --e_.eval_depth_;
        raise(fmt::format("template evaluation nested deeper than {} levels", kMaxEvalDepth));
      }
    }
    ~Deeper() { --e_.eval_depth_; }
    Evaluator& e_;
  };

  void emit(const std::string& text) {
    check_template_bytes(out_->size() + text.size());
    *out_ += text;
  }

  int64_t loop_iterations_ = 0;  // over the whole render (kMaxLoopIterations)

  Flow exec(const Stmt& st) {
    Deeper deeper(*this);
    line_ = st.line;
    switch (st.kind) {
      case StmtKind::Text: emit(st.text); return Flow::Normal;
      case StmtKind::Print: emit(to_str(eval(*st.expr))); return Flow::Normal;
      case StmtKind::If:
        for (const auto& [cond, body] : st.branches) {
          if (!cond || truthy(eval(*cond))) return exec_body(body);
        }
        return Flow::Normal;
      case StmtKind::For: return exec_for(st);
      case StmtKind::Set: assign(st.target, eval(*st.expr)); return Flow::Normal;
      case StmtKind::SetBlock: {
        std::string captured;
        in_child_scope(scope_, &captured, [&] { exec_body(st.body); });
        Value v = Value::string(std::move(captured));
        if (st.expr) v = apply_chain(*st.expr, v);
        line_ = st.line;
        assign(st.target, std::move(v));
        return Flow::Normal;
      }
      case StmtKind::FilterBlock: {
        std::string captured;
        in_child_scope(scope_, &captured, [&] { exec_body(st.body); });
        emit(to_str(apply_chain(*st.expr, Value::string(std::move(captured)))));
        return Flow::Normal;
      }
      case StmtKind::With: {
        std::vector<Value> values;
        for (const auto& a : st.assignments) values.push_back(eval(*a.second));
        Flow flow = Flow::Normal;
        in_child_scope(scope_, nullptr, [&] {
          for (size_t k = 0; k < values.size(); ++k) assign(st.assignments[k].first, std::move(values[k]));
          flow = exec_body(st.body);
        });
        return flow;
      }
      case StmtKind::Block: return exec_body(st.body);
      case StmtKind::Macro: scope_->set(st.name, make_macro(st)); return Flow::Normal;
      case StmtKind::Break: return Flow::Break;
      case StmtKind::Continue: return Flow::Continue;
    }
    return Flow::Normal;
  }

  Value apply_chain(const Expr& chain, const Value& subject) {
    const Value* saved = placeholder_;
    placeholder_ = &subject;
    Value r = eval(chain);
    placeholder_ = saved;
    return r;
  }

  Flow exec_for(const Stmt& st) {
    Value iterable = eval(*st.expr);
    std::vector<Value> items = iterate(iterable);
    if (st.condition) {
      std::vector<Value> kept;
      for (auto& item : items) {
        bool keep = false;
        in_child_scope(scope_, nullptr, [&] {
          assign(st.target, item);
          keep = truthy(eval(*st.condition));
        });
        if (keep) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      Flow flow = Flow::Normal;
      in_child_scope(scope_, nullptr, [&] { flow = exec_body(st.else_body); });
      return flow == Flow::Normal ? Flow::Normal : flow;
    }
    const int64_t n = int64_t(items.size());
    auto changed_state = std::make_shared<std::optional<std::vector<Value>>>();
    bool stop = false;
    for (int64_t k = 0; k < n && !stop; ++k) {
      if (++loop_iterations_ > kMaxLoopIterations)
        raise(fmt::format("more than {} loop iterations in one render (the limit)", kMaxLoopIterations));
      Value loop = Value::make_dict(DictKind::Loop);
      auto& d = *loop.dict;
      d.set("index0", Value::integer(k));
      d.set("index", Value::integer(k + 1));
      d.set("revindex0", Value::integer(n - k - 1));
      d.set("revindex", Value::integer(n - k));
      d.set("first", Value::boolean(k == 0));
      d.set("last", Value::boolean(k == n - 1));
      d.set("length", Value::integer(n));
      d.set("depth", Value::integer(1));
      d.set("depth0", Value::integer(0));
      d.set("previtem", k > 0 ? items[size_t(k - 1)] : Value::undefined("there is no previous item"));
      d.set("nextitem", k + 1 < n ? items[size_t(k + 1)] : Value::undefined("there is no next item"));
      d.set("cycle", Value::callable("loop.cycle", [k](Evaluator&, CallArgs& args) -> Value {
        if (!args.keyword.empty()) raise("loop.cycle() takes no keyword arguments");
        if (args.positional.empty()) raise("no items for cycling given");
        return args.positional[size_t(k) % args.positional.size()];
      }));
      d.set("changed", Value::callable("loop.changed", [changed_state](Evaluator&, CallArgs& args) -> Value {
        if (!args.keyword.empty()) raise("loop.changed() takes no keyword arguments");
        auto& last = *changed_state;
        bool differs = !last || last->size() != args.positional.size();
        if (!differs)
          for (size_t j = 0; j < args.positional.size(); ++j)
            if (!py_eq((*last)[j], args.positional[j])) differs = true;
        last = args.positional;
        return Value::boolean(differs);
      }));
      in_child_scope(scope_, nullptr, [&] {
        assign(st.target, items[size_t(k)]);
        scope_->set("loop", loop);
        if (exec_body(st.body) == Flow::Break) stop = true;
      });
    }
    return Flow::Normal;
  }

  // A macro sees its defining scope, which usually stores the macro itself: holding that
  // scope from the macro's value would be a reference cycle (LeakSanitizer found every
  // template with a macro leaking it). The render keeps the scope alive instead; the macro
  // holds a weak reference.
  std::vector<std::shared_ptr<Scope>> macro_scopes_;

  Value make_macro(const Stmt& st) {
    const Stmt* macro = &st;
    macro_scopes_.push_back(scope_);
    std::weak_ptr<Scope> closure = scope_;
    return Value::callable("macro '" + st.name + "'", [macro, closure](Evaluator& ev, CallArgs& args) -> Value {
      const std::shared_ptr<Scope> scope = closure.lock();
      if (!scope) raise("macro '" + macro->name + "' called after its template finished rendering");
      return ev.call_macro(*macro, scope, args);
    });
  }

 public:
  Value call_macro(const Stmt& m, const std::shared_ptr<Scope>& closure, CallArgs& args) {
    if (macro_depth_ >= 200) raise("maximum macro recursion depth exceeded");
    const int call_line = line_;
    std::vector<std::optional<Value>> bound(m.params.size());
    std::vector<Value> extra_positional;
    Value extra_keywords = Value::make_dict();
    for (size_t k = 0; k < args.positional.size(); ++k) {
      if (k < m.params.size()) {
        bound[k] = args.positional[k];
      } else if (m.uses_varargs) {
        extra_positional.push_back(args.positional[k]);
      } else {
        raise(fmt::format("macro '{}' takes not more than {} argument(s)", m.name, m.params.size()));
      }
    }
    for (const auto& [key, val] : args.keyword) {
      size_t idx = 0;
      while (idx < m.params.size() && m.params[idx] != key) ++idx;
      if (idx < m.params.size()) {
        if (bound[idx]) raise(fmt::format("macro '{}' got multiple values for argument '{}'", m.name, key));
        bound[idx] = val;
      } else if (m.uses_kwargs) {
        extra_keywords.dict->set(key, val);
      } else {
        raise(fmt::format("macro '{}' takes no keyword argument '{}'", m.name, key));
      }
    }
    std::string captured;
    ++macro_depth_;
    try {
      in_child_scope(closure, &captured, [&] {
        for (size_t k = 0; k < m.params.size(); ++k) {
          if (bound[k]) {
            scope_->set(m.params[k], *bound[k]);
          } else if (m.defaults[k]) {
            scope_->set(m.params[k], eval(*m.defaults[k]));
          } else {
            scope_->set(m.params[k], Value::undefined(fmt::format("parameter '{}' was not provided", m.params[k])));
          }
        }
        if (m.uses_varargs) scope_->set("varargs", Value::make_list(extra_positional, ListKind::Tuple));
        if (m.uses_kwargs) scope_->set("kwargs", extra_keywords);
        exec_body(m.body);
      });
    } catch (...) {
      --macro_depth_;
      throw;
    }
    --macro_depth_;
    line_ = call_line;
    return Value::string(std::move(captured));
  }

 private:
  Value lookup(const std::string& name) {
    if (const Value* v = scope_->find(name)) return *v;
    return get_global(name);
  }

  CallArgs eval_args(const Expr& e, size_t first) {
    CallArgs args;
    for (size_t k = first; k < e.args.size(); ++k) args.positional.push_back(eval(*e.args[k]));
    for (const auto& [key, val] : e.kwargs) args.keyword.emplace_back(key, eval(*val));
    return args;
  }

  Value eval(const Expr& e) {
    Deeper deeper(*this);
    line_ = e.line;
    switch (e.kind) {
      case ExprKind::Const: return e.value;
      case ExprKind::Name: return lookup(e.name);
      case ExprKind::Placeholder:
        if (!placeholder_) raise("internal: filter block without a subject");
        return *placeholder_;
      case ExprKind::ListLit:
      case ExprKind::TupleLit: {
        std::vector<Value> items;
        for (const auto& a : e.args) items.push_back(eval(*a));
        return Value::make_list(std::move(items), e.kind == ExprKind::TupleLit ? ListKind::Tuple : ListKind::List);
      }
      case ExprKind::DictLit: {
        Value d = Value::make_dict();
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          Value key = eval(*e.args[k]);
          d.dict->set(dict_key(key), eval(*e.args[k + 1]));
        }
        return d;
      }
      case ExprKind::GetAttr: {
        Value obj = eval(*e.args[0]);
        line_ = e.line;
        return get_attr(obj, e.name);
      }
      case ExprKind::GetItem: {
        Value obj = eval(*e.args[0]);
        Value key = eval(*e.args[1]);
        line_ = e.line;
        return get_item(obj, key);
      }
      case ExprKind::Slice: {
        Value obj = eval(*e.args[0]);
        Value parts[3];
        for (int k = 0; k < 3; ++k) parts[k] = e.args[k + 1] ? eval(*e.args[k + 1]) : Value::none();
        line_ = e.line;
        return get_slice(obj, parts[0], parts[1], parts[2]);
      }
      case ExprKind::Call: {
        Value callee = eval(*e.args[0]);
        CallArgs args = eval_args(e, 1);
        line_ = e.line;
        return call_value(*this, callee, args);
      }
      case ExprKind::Filter: {
        Value subject = eval(*e.args[0]);
        CallArgs args = eval_args(e, 1);
        line_ = e.line;
        return apply_filter(*this, e.name, subject, args);
      }
      case ExprKind::Test: {
        Value subject = eval(*e.args[0]);
        CallArgs args = eval_args(e, 1);
        line_ = e.line;
        return Value::boolean(apply_test(*this, e.name, subject, args));
      }
      case ExprKind::Neg:
      case ExprKind::Pos: {
        Value v = eval(*e.args[0]);
        require_defined_value(v);
        if (!v.is_number()) raise(fmt::format("bad operand type for unary {}: '{}'", e.kind == ExprKind::Neg ? '-' : '+', type_name(v)));
        if (e.kind == ExprKind::Pos) return v.kind == Kind::Bool ? Value::integer(v.as_int()) : v;
        if (v.kind == Kind::Float) return Value::real(-v.f);
        if (v.as_int() == INT64_MIN) raise("integer overflow");
        return Value::integer(-v.as_int());
      }
      case ExprKind::Not: return Value::boolean(!truthy(eval(*e.args[0])));
      case ExprKind::And: {
        Value a = eval(*e.args[0]);
        return truthy(a) ? eval(*e.args[1]) : a;
      }
      case ExprKind::Or: {
        Value a = eval(*e.args[0]);
        return truthy(a) ? a : eval(*e.args[1]);
      }
      case ExprKind::Binary: {
        Value a = eval(*e.args[0]);
        Value b = eval(*e.args[1]);
        line_ = e.line;
        return binary_op(e.name, a, b);
      }
      case ExprKind::Compare: {
        Value left = eval(*e.args[0]);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.args[k + 1]);
          line_ = e.line;
          const std::string& op = e.ops[k];
          bool ok;
          if (op == "==") ok = py_eq(left, right);
          else if (op == "!=") ok = !py_eq(left, right);
          else if (op == "<") ok = py_lt(left, right);
          else if (op == ">") ok = py_lt(right, left);
          else if (op == "<=") ok = py_lt(left, right) || py_eq(left, right);
          else if (op == ">=") ok = py_lt(right, left) || py_eq(left, right);
          else if (op == "in") ok = py_contains(right, left);
          else ok = !py_contains(right, left);
          if (!ok) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case ExprKind::Concat: {
        std::string out;
        for (const auto& a : e.args) {
          out += to_str(eval(*a));
          check_template_bytes(out.size());
        }
        return Value::string(std::move(out));
      }
      case ExprKind::CondExpr: {
        if (truthy(eval(*e.args[0]))) return eval(*e.args[1]);
        if (e.args[2]) return eval(*e.args[2]);
        return Value::undefined(fmt::format(
            "the inline if-expression on line {} evaluated to false and no else section was defined.", e.line));
      }
    }
    raise("internal: unknown expression");
  }
};

std::string render_program(const Program& program, const nlohmann::ordered_json& context) {
  auto globals = std::make_shared<Scope>();
  if (!context.is_object()) throw TemplateError("render context must be a JSON object");
  for (auto it = context.begin(); it != context.end(); ++it) globals->set(it.key(), from_json(it.value()));
  auto root = std::make_shared<Scope>();
  root->parent = globals;
  Evaluator ev(root);
  try {
    return ev.render(program.body);
  } catch (TemplateError& e) {
    if (e.line == 0) throw TemplateError(e.what(), ev.line());
    throw;
  }
}

}  // namespace turbospark::chat_template_detail
