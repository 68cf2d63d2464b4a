// Internals of the chat-template interpreter (see chat_template.h): the value model, the
// tokens, the syntax tree and the entry points the lexer, parser, evaluator and builtins
// share. Nothing outside src/formats/chat_template*.cpp should include this header.
//
// The value model follows Python as jinja2 sees it, because byte-identical output depends on
// Python's rules: str() of floats, lists and dicts, truthiness, == across int/float/bool,
// generators that are always truthy and can be consumed once, dicts that keep insertion order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace turbospark::chat_template_detail {

// Thrown during lexing, parsing or rendering; ChatTemplate adds the template name and line.
class TemplateError : public std::runtime_error {
 public:
  explicit TemplateError(const std::string& what, int line = 0) : std::runtime_error(what), line(line) {}
  int line;
};

[[noreturn]] inline void raise(const std::string& what) { throw TemplateError(what); }

// Bounds on what a template may build, each named in its error: the rendered text and any
// string value, list values, and loop iterations over the whole render. Real chat templates
// render a conversation in kilobytes with a few hundred iterations; a hostile one inside a
// downloaded GGUF must not run away with memory or time.
constexpr size_t kMaxTemplateBytes = size_t(16) << 20;
constexpr size_t kMaxTemplateItems = size_t(1) << 20;
constexpr int64_t kMaxLoopIterations = 1'000'000;
inline void check_template_bytes(size_t n) {
  if (n > kMaxTemplateBytes) raise("template output or a string in it larger than the limit of 16 MiB");
}
inline void check_template_items(size_t n) {
  if (n > kMaxTemplateItems) raise("a list in the template longer than the limit of 1048576 items");
}

struct Value;
class Evaluator;

enum class Kind : uint8_t { Undefined, None, Bool, Int, Float, String, List, Dict, Callable };

// What Python type a list-like value stands for; it decides repr, len() and re-iteration.
enum class ListKind : uint8_t {
  List,
  Tuple,
  Generator,  // map/select/items/reverse results: single pass, always truthy, no len()
  View,       // dict_items / dict_keys / dict_values / range: repr is wrapper(items)
};

enum class DictKind : uint8_t { Dict, Namespace, Loop };

struct ListData {
  std::vector<Value> items;
  ListKind kind = ListKind::List;
  std::string wrapper;  // View: "dict_items", "range(0, 3)" (complete repr when it starts with "range")
  size_t cursor = 0;    // Generator: items before cursor were consumed
};

// Keys are stored as text: a str key as itself, any other hashable key (int, float, bool,
// None) as dict_key() encodes it, "\xff" + tag + text, which no UTF-8 string can equal.
// Python folds True, 1 and 1.0 into one key, and so does the encoding.
struct DictData {
  std::vector<std::pair<std::string, Value>> items;  // insertion order, like a Python dict
  DictKind kind = DictKind::Dict;
  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  void set(const std::string& key, Value v);
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

using NativeFn = std::function<Value(Evaluator&, CallArgs&)>;

struct CallableData {
  std::string name;  // for error messages: "strip", "raise_exception", "macro 'm'"
  NativeFn fn;
};

struct Value {
  Kind kind = Kind::Undefined;
  // String only: a markupsafe.Markup (made by |safe or |escape). Python escapes the plain
  // operand of Markup + str, which templates hit with `"..."|safe + text`.
  bool markup = false;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // String: the text (UTF-8); Undefined: the message raised when it is used
  std::shared_ptr<ListData> list;
  std::shared_ptr<DictData> dict;
  std::shared_ptr<CallableData> fn;

  static Value undefined(std::string message) {
    Value v;
    v.s = std::move(message);
    return v;
  }
  static Value none() { return with_kind(Kind::None); }
  static Value boolean(bool x) {
    Value v = with_kind(Kind::Bool);
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v = with_kind(Kind::Int);
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v = with_kind(Kind::Float);
    v.f = x;
    return v;
  }
  static Value string(std::string x) {
    Value v = with_kind(Kind::String);
    v.s = std::move(x);
    return v;
  }
  static Value make_list(std::vector<Value> items, ListKind kind = ListKind::List, std::string wrapper = {}) {
    Value v = with_kind(Kind::List);
    v.list = std::make_shared<ListData>();
    v.list->items = std::move(items);
    v.list->kind = kind;
    v.list->wrapper = std::move(wrapper);
    return v;
  }
  static Value make_dict(DictKind kind = DictKind::Dict) {
    Value v = with_kind(Kind::Dict);
    v.dict = std::make_shared<DictData>();
    v.dict->kind = kind;
    return v;
  }
  static Value callable(std::string name, NativeFn f) {
    Value v = with_kind(Kind::Callable);
    v.fn = std::make_shared<CallableData>(CallableData{std::move(name), std::move(f)});
    return v;
  }

  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_none() const { return kind == Kind::None; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Bool || kind == Kind::Int || kind == Kind::Float; }
  bool is_integral() const { return kind == Kind::Bool || kind == Kind::Int; }
  bool is_list() const { return kind == Kind::List; }
  bool is_plain_dict() const { return kind == Kind::Dict && dict->kind == DictKind::Dict; }
  int64_t as_int() const { return kind == Kind::Bool ? int64_t(b) : i; }
  double as_double() const { return kind == Kind::Float ? f : double(as_int()); }

 private:
  static Value with_kind(Kind k) {
    Value v;
    v.kind = k;
    return v;
  }
};

// ---- values (chat_template_value.cpp) ----
bool truthy(const Value& v);
std::string dict_key(const Value& key);        // raises for unhashable keys
Value key_value(const std::string& key);       // the Python key a stored key stands for
std::string type_name(const Value& v);        // Python's type name: "str", "int", "dict", ...
std::string to_str(const Value& v);           // Python str() as jinja renders {{ v }}
std::string to_repr(const Value& v);          // Python repr()
std::string float_repr(double d);             // Python repr(float)
std::string html_escape(const std::string& s);  // markupsafe.escape: & < > " '
Value markup_string(std::string s);             // a Markup value
bool py_eq(const Value& a, const Value& b);
bool py_lt(const Value& a, const Value& b);   // raises TypeError-like errors for unorderable types
int64_t py_len(const Value& v);               // raises for generators and scalars
bool py_contains(const Value& container, const Value& item);
// Materializes an iterable the way a Python for loop would (consuming generators).
std::vector<Value> iterate(const Value& v);
Value binary_op(const std::string& op, const Value& a, const Value& b);
Value from_json(const nlohmann::ordered_json& j);
// json.dumps(v, ensure_ascii, indent, separators, sort_keys) as transformers' tojson filter.
struct JsonOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // nullopt: single line
  std::optional<std::pair<std::string, std::string>> separators;
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonOptions& options);

// ---- UTF-8 helpers (chat_template_value.cpp) ----
std::u32string utf8_decode(std::string_view s);
std::string utf8_encode(std::u32string_view s);
void utf8_append(std::string& out, char32_t c);
bool is_py_space(char32_t c);  // str.isspace() / regex \s
std::string py_strip(std::string_view s, const std::optional<std::u32string>& chars, bool left, bool right);

// ---- syntax tree ----
enum class ExprKind : uint8_t {
  Const, Name, ListLit, TupleLit, DictLit, GetAttr, GetItem, Slice, Call, Filter, Test,
  Neg, Pos, Not, And, Or, Binary, Compare, Concat, CondExpr, Placeholder,
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  Expr(ExprKind k, int l) : kind(k), line(l) {}
  ExprKind kind;
  int line = 0;
  Value value;                    // Const
  std::string name;               // Name; GetAttr attribute; Filter/Test name; Binary operator
  std::vector<ExprPtr> args;      // operands; Filter/Test/Call/GetAttr/GetItem/Slice: args[0] is the subject
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;   // Compare: one operator per args[1..]
};

struct Target {
  enum class Kind : uint8_t { Name, Tuple, Attr } kind = Kind::Name;
  std::vector<std::string> names;  // Name: 1; Tuple: n; Attr: the namespace variable
  std::string attr;                // Attr: ns.attr
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

enum class StmtKind : uint8_t { Text, Print, If, For, Set, SetBlock, Macro, Break, Continue, FilterBlock, With, Block };

struct Stmt {
  Stmt(StmtKind k, int l) : kind(k), line(l) {}
  StmtKind kind;
  int line = 0;
  std::string text;                                  // Text
  ExprPtr expr;                                      // Print; For iterable; Set value; SetBlock/FilterBlock filter chain
  std::vector<std::pair<ExprPtr, Body>> branches;    // If: (condition or null for else, body)
  Target target;                                     // For, Set, SetBlock
  ExprPtr condition;                                 // For: the `if` filter
  Body body, else_body;                              // For / Macro / SetBlock / FilterBlock / With / Block
  // Macro
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;                     // aligned with params, null when none
  bool uses_varargs = false, uses_kwargs = false;
  // With
  std::vector<std::pair<Target, ExprPtr>> assignments;
};

struct Program {
  Body body;
};

// ---- lexer / parser (chat_template_lexer.cpp, chat_template_parser.cpp) ----
enum class Tok : uint8_t { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Integer, Float, Op, Eof };

struct Token {
  Tok type;
  std::string value;  // Data text, name, decoded string, operator
  int line = 1;
  int64_t ival = 0;
  double fval = 0;
};

std::vector<Token> tokenize(std::string_view source);
std::unique_ptr<Program> parse_program(std::string_view source);

inline Value arg_or(const std::optional<Value>& a, Value fallback) { return a ? *a : std::move(fallback); }
inline Value tuple2(Value a, Value b) {
  std::vector<Value> items;
  items.push_back(std::move(a));
  items.push_back(std::move(b));
  return Value::make_list(std::move(items), ListKind::Tuple);
}

// ---- str / dict / list methods and lookups (chat_template_methods.cpp) ----
void require_defined(const Value& v);  // raises the undefined value's message
const std::string& require_string(const Value& v, const std::string& what);
int64_t require_int(const Value& v, const std::string& what);
Value missing_attribute(const Value& obj, const std::string& name);
// Appends Python's upper (to_upper) or lower case of c; returns whether c is cased.
bool map_case(char32_t c, bool to_upper, std::u32string& out);
std::string change_case(const std::string& s, bool to_upper);
std::string py_capitalize(const std::string& s);
std::vector<std::string> py_splitlines(const std::string& s, bool keepends);
std::string py_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count);
Value call_str_method(const Value& self, const std::string& name, CallArgs& args);
bool escape_changes(const Value& v);               // would markupsafe.escape alter this argument?
Value keep_markup(const Value& source, Value result);  // Markup in, Markup out
Value get_attr(const Value& obj, const std::string& name);   // obj.name as the sandbox resolves it
Value get_item(const Value& obj, const Value& key);          // obj[key]
Value get_slice(const Value& obj, const Value& start, const Value& stop, const Value& step);  // obj[a:b:c]

// ---- builtins (chat_template_builtins.cpp) ----
bool is_known_filter(const std::string& name);
bool is_known_test(const std::string& name);
// Names jinja2 has but this interpreter refuses; parse errors name them as "unsupported".
bool is_jinja_filter(const std::string& name);
bool is_jinja_test(const std::string& name);
Value apply_filter(Evaluator& ev, const std::string& name, const Value& subject, CallArgs& args);
bool apply_test(Evaluator& ev, const std::string& name, const Value& subject, CallArgs& args);
Value get_global(const std::string& name);                   // range, namespace, raise_exception, ...
Value call_value(Evaluator& ev, const Value& callee, CallArgs& args);

// Binds call arguments to named parameters like a Python signature; raises on extras.
std::vector<std::optional<Value>> bind_args(const CallArgs& args, std::initializer_list<const char*> names,
                                            const std::string& what);

// ---- evaluator (chat_template_eval.cpp) ----
std::string render_program(const Program& program, const nlohmann::ordered_json& context);


}  // namespace turbospark::chat_template_detail
