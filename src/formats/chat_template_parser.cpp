// Recursive-descent parser for the jinja2 subset. The grammar and precedence follow
// jinja2.parser.Parser function by function (parse_condexpr > or > and > not > compare >
// + - > ~ > * / // % > ** > unary > postfix > filter/test), because a different binding of
// `not x is defined`, `-1|abs` or `a ~ b | upper` would render different text without error.
//
// Every construct outside the subset fails here, at parse time, with its name and line:
// unknown tags, filters and tests, {% call %}, {% include %}, *args in calls, and so on.
#include <fmt/format.h>

#include <set>

#include "formats/chat_template_detail.h"

namespace turbospark::chat_template_detail {
namespace {

const std::set<std::string> kUnsupportedTags = {"call",   "block",   "extends", "include", "import", "from",
                                                 "autoescape", "endautoescape", "do", "trans", "pluralize",
                                                 "debug"};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  Body parse_template() {
    Body body = subparse({}, nullptr);
    if (cur().type != Tok::Eof) fail(fmt::format("unexpected tag '{}'", cur().value));
    return body;
  }

 private:
  std::vector<Token> toks_;
  size_t p_ = 0;
  int loop_depth_ = 0;
  // Bounds on what a template may build, so parsing, rendering and freeing it recurse a
  // bounded depth (a fuzzed '{{ - - - ... x }}' of a few thousand operators overflowed the
  // stack): nested expressions and blocks, and nodes in one tag (the shipped templates' largest
  // tag has under 40 tokens).
  static constexpr int kMaxNesting = 100;
  static constexpr int kMaxTagNodes = 1024;
  int nesting_ = 0;
  int tag_nodes_ = 0;
  struct Nest {
    explicit Nest(Parser& p) : p_(p) {
      if (++p_.nesting_ > kMaxNesting) {
        --p_.nesting_;
        p_.fail(fmt::format("nesting deeper than {} levels (expressions or blocks)", kMaxNesting));
      }
    }
    ~Nest() { --p_.nesting_; }
    Parser& p_;
  };

  const Token& cur() const { return toks_[p_]; }
  const Token& look() const { return toks_[std::min(p_ + 1, toks_.size() - 1)]; }
  void next() {
    if (p_ + 1 < toks_.size()) ++p_;
  }
  bool is_op(const char* op) const { return cur().type == Tok::Op && cur().value == op; }
  bool is_name(const char* name) const { return cur().type == Tok::Name && cur().value == name; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    next();
    return true;
  }

  std::string describe(const Token& t) const {
    switch (t.type) {
      case Tok::Data: return "template text";
      case Tok::VarBegin: return "'{{'";
      case Tok::VarEnd: return "'}}'";
      case Tok::BlockBegin: return "'{%'";
      case Tok::BlockEnd: return "'%}'";
      case Tok::Eof: return "end of template";
      case Tok::String: return "string literal";
      default: return "'" + t.value + "'";
    }
  }

  [[noreturn]] void fail(const std::string& msg) const { throw TemplateError(msg, cur().line); }

  void expect_op(const char* op) {
    if (!skip_op(op)) fail(fmt::format("expected '{}', got {}", op, describe(cur())));
  }
  std::string expect_name() {
    if (cur().type != Tok::Name) fail(fmt::format("expected a name, got {}", describe(cur())));
    std::string v = cur().value;
    next();
    return v;
  }
  void expect_block_end() {
    if (cur().type != Tok::BlockEnd) fail(fmt::format("expected end of statement '%}}', got {}", describe(cur())));
    next();
  }

  // ---- statements ----

  // Parses template text and tags until a block tag whose name is in `end_names`; leaves the
  // stream on that name (after "{%") and reports which one in `found`.
  Body subparse(const std::set<std::string>& end_names, std::string* found, const char* opener = nullptr,
                int opener_line = 0) {
    Nest nest(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Tok::Eof) {
        if (!end_names.empty()) {
          std::string expected;
          for (const auto& e : end_names) expected += (expected.empty() ? "'" : " or '") + e + "'";
          fail(fmt::format("unexpected end of template, expected {} to close the '{}' from line {}", expected,
                           opener ? opener : "block", opener_line));
        }
        return body;
      }
      if (t.type == Tok::Data) {
        auto s = std::make_unique<Stmt>(StmtKind::Text, t.line);
        s->text = t.value;
        body.push_back(std::move(s));
        next();
      } else if (t.type == Tok::VarBegin) {
        auto s = std::make_unique<Stmt>(StmtKind::Print, t.line);
        tag_nodes_ = 0;
        next();
        s->expr = parse_tuple(true, {}, false);
        if (cur().type != Tok::VarEnd) fail(fmt::format("expected '}}}}', got {}", describe(cur())));
        next();
        body.push_back(std::move(s));
      } else if (t.type == Tok::BlockBegin) {
        tag_nodes_ = 0;
        next();
        if (cur().type == Tok::Name && end_names.count(cur().value)) {
          if (found) *found = cur().value;
          return body;
        }
        body.push_back(parse_statement());
      } else {
        fail(fmt::format("unexpected {}", describe(t)));
      }
    }
  }

  // After the tag name: expects "%}", parses to one of `end_names` and consumes that name.
  Body statements_until(const std::set<std::string>& end_names, std::string* found, const char* opener, int line) {
    expect_block_end();
    std::string which;
    Body body = subparse(end_names, &which, opener, line);
    next();  // the end name
    if (found) *found = which;
    return body;
  }

  std::unique_ptr<Stmt> make(StmtKind kind, int line) {
    return std::make_unique<Stmt>(kind, line);
  }

  std::unique_ptr<Stmt> parse_statement() {
    if (cur().type != Tok::Name) fail(fmt::format("tag name expected, got {}", describe(cur())));
    const std::string tag = cur().value;
    const int line = cur().line;
    if (tag == "if") return parse_if();
    if (tag == "for") return parse_for();
    if (tag == "set") return parse_set();
    if (tag == "macro") return parse_macro();
    if (tag == "with") return parse_with();
    if (tag == "filter") return parse_filter_block();
    if (tag == "generation") {
      // transformers' AssistantTracker: only marks assistant spans; renders its body as is.
      next();
      auto s = make(StmtKind::Block, line);
      s->body = statements_until({"endgeneration"}, nullptr, "generation", line);
      expect_block_end();
      return s;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail(fmt::format("'{}' outside of a for loop", tag));
      next();
      expect_block_end();
      return make(tag == "break" ? StmtKind::Break : StmtKind::Continue, line);
    }
    if (kUnsupportedTags.count(tag)) fail(fmt::format("unsupported tag '{{% {} %}}'", tag));
    fail(fmt::format("unknown tag '{}'", tag));
  }

  std::unique_ptr<Stmt> parse_if() {
    auto s = make(StmtKind::If, cur().line);
    const int line = cur().line;
    next();
    ExprPtr cond = parse_tuple(false, {}, false);
    while (true) {
      std::string which;
      Body body = statements_until({"elif", "else", "endif"}, &which, "if", line);
      s->branches.emplace_back(std::move(cond), std::move(body));
      if (which == "elif") {
        cond = parse_tuple(false, {}, false);
        continue;
      }
      if (which == "else") {
        Body else_body = statements_until({"endif"}, nullptr, "if", line);
        s->branches.emplace_back(nullptr, std::move(else_body));
      }
      expect_block_end();
      return s;
    }
  }

  Target parse_target(const std::set<std::string>& extra_end, bool with_namespace) {
    Target target;
    if (with_namespace && cur().type == Tok::Name && look().type == Tok::Op && look().value == ".") {
      target.kind = Target::Kind::Attr;
      target.names.push_back(expect_name());
      next();
      target.attr = expect_name();
      return target;
    }
    const bool paren = skip_op("(");
    while (true) {
      if (!target.names.empty()) {
        if (!skip_op(",")) break;
        target.kind = Target::Kind::Tuple;
      }
      if (cur().type == Tok::Name && extra_end.count(cur().value)) break;
      if (paren && is_op(")")) break;
      if (cur().type != Tok::Name) fail(fmt::format("can't assign to {}", describe(cur())));
      target.names.push_back(expect_name());
    }
    if (paren) {
      expect_op(")");
      target.kind = Target::Kind::Tuple;
    }
    if (target.names.empty()) fail("assignment target expected");
    for (const auto& n : target.names)
      if (n == "true" || n == "false" || n == "none" || n == "True" || n == "False" || n == "None")
        fail(fmt::format("can't assign to '{}'", n));
    return target;
  }

  std::unique_ptr<Stmt> parse_for() {
    const int line = cur().line;
    auto s = make(StmtKind::For, line);
    next();
    s->target = parse_target({"in"}, false);
    if (!skip_name("in")) fail(fmt::format("expected 'in', got {}", describe(cur())));
    s->expr = parse_tuple(false, {"recursive"}, false);
    if (skip_name("if")) s->condition = parse_expression(true);
    if (is_name("recursive")) fail("unsupported recursive for loop");
    ++loop_depth_;
    std::string which;
    s->body = statements_until({"endfor", "else"}, &which, "for", line);
    --loop_depth_;
    if (which == "else") s->else_body = statements_until({"endfor"}, nullptr, "for", line);
    expect_block_end();
    return s;
  }

  std::unique_ptr<Stmt> parse_set() {
    const int line = cur().line;
    next();
    Target target = parse_target({}, true);
    if (skip_op("=")) {
      auto s = make(StmtKind::Set, line);
      s->target = std::move(target);
      s->expr = parse_tuple(true, {}, false);
      expect_block_end();
      return s;
    }
    auto s = make(StmtKind::SetBlock, line);
    s->target = std::move(target);
    if (is_op("|")) s->expr = parse_filter_chain(false);
    const int depth = loop_depth_;
    loop_depth_ = 0;
    s->body = statements_until({"endset"}, nullptr, "set", line);
    loop_depth_ = depth;
    expect_block_end();
    return s;
  }

  std::unique_ptr<Stmt> parse_macro() {
    const int line = cur().line;
    auto s = make(StmtKind::Macro, line);
    next();
    s->name = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      if (!s->params.empty()) expect_op(",");
      if (is_op(")")) break;
      s->params.push_back(expect_name());
      if (skip_op("=")) {
        s->defaults.push_back(parse_expression(true));
      } else {
        if (!s->defaults.empty() && s->defaults.back()) fail("non-default argument follows default argument");
        s->defaults.push_back(nullptr);
      }
    }
    expect_op(")");
    const int depth = loop_depth_;
    loop_depth_ = 0;
    s->body = statements_until({"endmacro"}, nullptr, "macro", line);
    loop_depth_ = depth;
    expect_block_end();
    for (const auto& st : s->body) scan_macro_names(*st, *s);
    return s;
  }

  std::unique_ptr<Stmt> parse_with() {
    const int line = cur().line;
    auto s = make(StmtKind::With, line);
    next();
    while (cur().type != Tok::BlockEnd) {
      if (!s->assignments.empty()) expect_op(",");
      Target t = parse_target({}, false);
      expect_op("=");
      s->assignments.emplace_back(std::move(t), parse_expression(true));
    }
    s->body = statements_until({"endwith"}, nullptr, "with", line);
    expect_block_end();
    return s;
  }

  std::unique_ptr<Stmt> parse_filter_block() {
    const int line = cur().line;
    auto s = make(StmtKind::FilterBlock, line);
    next();
    s->expr = parse_filter_chain(true);
    s->body = statements_until({"endfilter"}, nullptr, "filter", line);
    expect_block_end();
    return s;
  }

  // Whether a macro body reads `varargs` / `kwargs`; jinja2 only accepts extra arguments then.
  static void scan_expr_names(const Expr& e, Stmt& macro) {
    if (e.kind == ExprKind::Name) {
      if (e.name == "varargs") macro.uses_varargs = true;
      if (e.name == "kwargs") macro.uses_kwargs = true;
    }
    for (const auto& a : e.args)
      if (a) scan_expr_names(*a, macro);
    for (const auto& kw : e.kwargs)
      if (kw.second) scan_expr_names(*kw.second, macro);
  }
  static void scan_macro_names(const Stmt& st, Stmt& macro) {
    if (st.kind == StmtKind::Macro) return;  // nested macros have their own varargs
    if (st.expr) scan_expr_names(*st.expr, macro);
    if (st.condition) scan_expr_names(*st.condition, macro);
    for (const auto& [cond, body] : st.branches) {
      if (cond) scan_expr_names(*cond, macro);
      for (const auto& b : body) scan_macro_names(*b, macro);
    }
    for (const auto& b : st.body) scan_macro_names(*b, macro);
    for (const auto& b : st.else_body) scan_macro_names(*b, macro);
    for (const auto& a : st.assignments) scan_expr_names(*a.second, macro);
  }

  // ---- expressions ----

  ExprPtr node(ExprKind kind, int line) {
    if (++tag_nodes_ > kMaxTagNodes) fail(fmt::format("a tag of more than {} expression nodes", kMaxTagNodes));
    return std::make_unique<Expr>(kind, line);
  }

  bool is_tuple_end(const std::set<std::string>& extra_end) const {
    const Token& t = cur();
    if (t.type == Tok::VarEnd || t.type == Tok::BlockEnd || (t.type == Tok::Op && t.value == ")")) return true;
    return t.type == Tok::Name && extra_end.count(t.value);
  }

  ExprPtr parse_tuple(bool with_condexpr, const std::set<std::string>& extra_end, bool explicit_parens) {
    const int line = cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(parse_expression(with_condexpr));
      if (is_op(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) fail(fmt::format("expected an expression, got {}", describe(cur())));
    }
    auto t = node(ExprKind::TupleLit, line);
    t->args = std::move(items);
    return t;
  }

  ExprPtr parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }

  ExprPtr parse_condexpr() {
    const int line = cur().line;
    ExprPtr expr1 = parse_or();
    while (skip_name("if")) {
      ExprPtr expr2 = parse_or();
      ExprPtr expr3;
      if (skip_name("else")) expr3 = parse_condexpr();
      auto c = node(ExprKind::CondExpr, line);
      c->args.push_back(std::move(expr2));
      c->args.push_back(std::move(expr1));
      c->args.push_back(std::move(expr3));
      expr1 = std::move(c);
    }
    return expr1;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      const int line = cur().line;
      next();
      auto n = node(ExprKind::Or, line);
      n->args.push_back(std::move(left));
      n->args.push_back(parse_and());
      left = std::move(n);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      const int line = cur().line;
      next();
      auto n = node(ExprKind::And, line);
      n->args.push_back(std::move(left));
      n->args.push_back(parse_not());
      left = std::move(n);
    }
    return left;
  }

  ExprPtr parse_not() {
    Nest nest(*this);
    if (is_name("not")) {
      const int line = cur().line;
      next();
      auto n = node(ExprKind::Not, line);
      n->args.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const int line = cur().line;
    ExprPtr left = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().type == Tok::Op && (cur().value == "==" || cur().value == "!=" || cur().value == "<" ||
                                    cur().value == ">" || cur().value == "<=" || cur().value == ">=")) {
        op = cur().value;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && look().type == Tok::Name && look().value == "in") {
        op = "notin";
        next();
        next();
      } else {
        break;
      }
      if (!cmp) {
        cmp = node(ExprKind::Compare, line);
        cmp->args.push_back(std::move(left));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(left);
  }

  ExprPtr binary(const char* op, ExprPtr left, ExprPtr right, int line) {
    auto n = node(ExprKind::Binary, line);
    n->name = op;
    n->args.push_back(std::move(left));
    n->args.push_back(std::move(right));
    return n;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().value;
      const int line = cur().line;
      next();
      left = binary(op == "+" ? "+" : "-", std::move(left), parse_concat(), line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    const int line = cur().line;
    std::vector<ExprPtr> args;
    args.push_back(parse_math2());
    while (skip_op("~")) args.push_back(parse_math2());
    if (args.size() == 1) return std::move(args[0]);
    auto n = node(ExprKind::Concat, line);
    n->args = std::move(args);
    return n;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      static const char* const kOps[] = {"*", "/", "//", "%"};
      const char* op = nullptr;
      for (const char* o : kOps)
        if (cur().value == o) op = o;
      const int line = cur().line;
      next();
      left = binary(op, std::move(left), parse_pow(), line);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      const int line = cur().line;
      next();
      left = binary("**", std::move(left), parse_unary(true), line);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    Nest nest(*this);
    const int line = cur().line;
    ExprPtr n;
    if (is_op("-") || is_op("+")) {
      const bool neg = cur().value == "-";
      next();
      n = node(neg ? ExprKind::Neg : ExprKind::Pos, line);
      n->args.push_back(parse_unary(false));
    } else {
      n = parse_primary();
    }
    n = parse_postfix(std::move(n));
    if (with_filter) n = parse_filter_expr(std::move(n));
    return n;
  }

  ExprPtr parse_primary() {
    Nest nest(*this);
    const Token& t = cur();
    const int line = t.line;
    if (t.type == Tok::Name) {
      auto n = node(ExprKind::Const, line);
      if (t.value == "true" || t.value == "True") {
        n->value = Value::boolean(true);
      } else if (t.value == "false" || t.value == "False") {
        n->value = Value::boolean(false);
      } else if (t.value == "none" || t.value == "None") {
        n->value = Value::none();
      } else {
        n->kind = ExprKind::Name;
        n->name = t.value;
      }
      next();
      return n;
    }
    if (t.type == Tok::String) {
      std::string s = t.value;
      next();
      while (cur().type == Tok::String) {
        s += cur().value;
        next();
      }
      auto n = node(ExprKind::Const, line);
      n->value = Value::string(std::move(s));
      return n;
    }
    if (t.type == Tok::Integer || t.type == Tok::Float) {
      auto n = node(ExprKind::Const, line);
      n->value = t.type == Tok::Integer ? Value::integer(t.ival) : Value::real(t.fval);
      next();
      return n;
    }
    if (is_op("(")) {
      next();
      ExprPtr n = parse_tuple(true, {}, true);
      expect_op(")");
      return n;
    }
    if (is_op("[")) {
      next();
      auto n = node(ExprKind::ListLit, line);
      while (!is_op("]")) {
        if (!n->args.empty()) expect_op(",");
        if (is_op("]")) break;
        n->args.push_back(parse_expression(true));
      }
      expect_op("]");
      return n;
    }
    if (is_op("{")) {
      next();
      auto n = node(ExprKind::DictLit, line);
      while (!is_op("}")) {
        if (!n->args.empty()) expect_op(",");
        if (is_op("}")) break;
        n->args.push_back(parse_expression(true));
        expect_op(":");
        n->args.push_back(parse_expression(true));
      }
      expect_op("}");
      return n;
    }
    fail(fmt::format("unexpected {}", describe(t)));
  }

  ExprPtr parse_postfix(ExprPtr n) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        n = parse_subscript(std::move(n));
      } else if (is_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr n) {
    while (true) {
      if (is_op("|")) {
        n = parse_filter(std::move(n), false);
      } else if (is_name("is")) {
        n = parse_test(std::move(n));
      } else if (is_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr obj) {
    const int line = cur().line;
    if (skip_op(".")) {
      if (cur().type == Tok::Name) {
        auto n = node(ExprKind::GetAttr, line);
        n->name = cur().value;
        n->args.push_back(std::move(obj));
        next();
        return n;
      }
      if (cur().type != Tok::Integer) fail(fmt::format("expected name or number after '.', got {}", describe(cur())));
      auto key = node(ExprKind::Const, line);
      key->value = Value::integer(cur().ival);
      next();
      auto n = node(ExprKind::GetItem, line);
      n->args.push_back(std::move(obj));
      n->args.push_back(std::move(key));
      return n;
    }
    expect_op("[");
    // [a], [a:b], [a:b:c] and the forms with parts left out.
    ExprPtr parts[3];
    bool is_slice = false;
    if (!is_op(":")) {
      parts[0] = parse_expression(true);
    }
    if (skip_op(":")) {
      is_slice = true;
      if (!is_op("]") && !is_op(":")) parts[1] = parse_expression(true);
      if (skip_op(":")) {
        if (!is_op("]")) parts[2] = parse_expression(true);
      }
    }
    if (is_op(",")) {
      // obj[a, b] indexes with a tuple, as in Python.
      if (is_slice) fail("unsupported: slice inside a tuple subscript");
      auto key = node(ExprKind::TupleLit, line);
      key->args.push_back(std::move(parts[0]));
      while (skip_op(",")) {
        if (is_op("]")) break;
        key->args.push_back(parse_expression(true));
      }
      parts[0] = std::move(key);
    }
    expect_op("]");
    if (!is_slice) {
      auto n = node(ExprKind::GetItem, line);
      n->args.push_back(std::move(obj));
      n->args.push_back(std::move(parts[0]));
      return n;
    }
    auto n = node(ExprKind::Slice, line);
    n->args.push_back(std::move(obj));
    for (auto& p : parts) n->args.push_back(std::move(p));
    return n;
  }

  void parse_call_args(Expr& n) {
    expect_op("(");
    bool require_comma = false;
    while (!is_op(")")) {
      if (require_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*") || is_op("**")) fail(fmt::format("unsupported: '{}' argument unpacking in a call", cur().value));
      if (cur().type == Tok::Name && look().type == Tok::Op && look().value == "=") {
        std::string key = cur().value;
        next();
        next();
        n.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!n.kwargs.empty()) fail("positional argument follows keyword argument");
        n.args.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto n = node(ExprKind::Call, cur().line);
    n->args.push_back(std::move(callee));
    parse_call_args(*n);
    return n;
  }

  std::string dotted_name() {
    std::string name = expect_name();
    while (is_op(".")) {
      next();
      name += "." + expect_name();
    }
    return name;
  }

  ExprPtr parse_filter(ExprPtr subject, bool start_inline) {
    while (is_op("|") || start_inline) {
      if (!start_inline) next();
      start_inline = false;
      const int line = cur().line;
      std::string name = dotted_name();
      auto n = node(ExprKind::Filter, line);
      n->name = name;
      n->args.push_back(std::move(subject));
      if (is_op("(")) parse_call_args(*n);
      subject = std::move(n);
    }
    return subject;
  }

  // A filter chain applied to a placeholder: {% filter upper %} and {% set x | trim %}.
  ExprPtr parse_filter_chain(bool start_inline) {
    auto placeholder = node(ExprKind::Placeholder, cur().line);
    return parse_filter(std::move(placeholder), start_inline);
  }

  ExprPtr parse_test(ExprPtr subject) {
    const int line = cur().line;
    next();  // is
    const bool negated = skip_name("not");
    std::string name = dotted_name();
    auto n = node(ExprKind::Test, line);
    n->name = name;
    n->args.push_back(std::move(subject));
    const Token& t = cur();
    if (is_op("(")) {
      parse_call_args(*n);
    } else if ((t.type == Tok::Name || t.type == Tok::String || t.type == Tok::Integer || t.type == Tok::Float ||
                is_op("[") || is_op("{")) &&
               !(t.type == Tok::Name && (t.value == "else" || t.value == "or" || t.value == "and"))) {
      if (is_name("is")) fail("You cannot chain multiple tests with is");
      n->args.push_back(parse_postfix(parse_primary()));
    }
    if (!negated) return n;
    auto neg = node(ExprKind::Not, line);
    neg->args.push_back(std::move(n));
    return neg;
  }
};

}  // namespace

namespace {

// jinja2 rejects unknown filters and tests when it compiles the template, except inside an
// `if` (test and branches) or a conditional expression -- its "soft" frames -- where the
// error waits until the filter actually runs. Templates rely on that (DeepSeek's call
// `from_json`, which transformers does not define, only on paths they do not take), so this
// pass applies the same rule; loops, macros and blocks start a fresh, hard frame.
void check_expr(const Expr& e, bool soft) {
  const bool inner_soft = soft || e.kind == ExprKind::CondExpr;
  if (!soft && e.kind == ExprKind::Filter && !is_known_filter(e.name)) {
    throw TemplateError(is_jinja_filter(e.name) ? fmt::format("unsupported filter '{}'", e.name)
                                                : fmt::format("unknown filter '{}'", e.name),
                        e.line);
  }
  if (!soft && e.kind == ExprKind::Test && !is_known_test(e.name)) {
    throw TemplateError(is_jinja_test(e.name) ? fmt::format("unsupported test '{}'", e.name)
                                              : fmt::format("unknown test '{}'", e.name),
                        e.line);
  }
  for (const auto& a : e.args)
    if (a) check_expr(*a, inner_soft);
  for (const auto& kw : e.kwargs) check_expr(*kw.second, inner_soft);
}

void check_body(const Body& body, bool soft);

void check_stmt(const Stmt& st, bool soft) {
  switch (st.kind) {
    case StmtKind::If:
      for (const auto& [cond, body] : st.branches) {
        if (cond) check_expr(*cond, true);
        check_body(body, true);
      }
      return;
    case StmtKind::For:
      check_expr(*st.expr, soft);
      if (st.condition) check_expr(*st.condition, false);
      check_body(st.body, false);
      check_body(st.else_body, false);
      return;
    case StmtKind::Macro:
      for (const auto& d : st.defaults)
        if (d) check_expr(*d, false);
      check_body(st.body, false);
      return;
    case StmtKind::SetBlock:
    case StmtKind::FilterBlock:
      if (st.expr) check_expr(*st.expr, false);
      check_body(st.body, false);
      return;
    case StmtKind::With:
      for (const auto& a : st.assignments) check_expr(*a.second, soft);
      check_body(st.body, false);
      return;
    case StmtKind::Block: check_body(st.body, soft); return;
    default:
      if (st.expr) check_expr(*st.expr, soft);
      return;
  }
}

void check_body(const Body& body, bool soft) {
  for (const auto& st : body) check_stmt(*st, soft);
}

}  // namespace

std::unique_ptr<Program> parse_program(std::string_view source) {
  Parser parser(tokenize(source));
  auto program = std::make_unique<Program>();
  program->body = parser.parse_template();
  check_body(program->body, false);
  return program;
}

}  // namespace turbospark::chat_template_detail
