// The library a chat template can reach besides methods (chat_template_methods.cpp):
// jinja2's filters and tests, and the globals -- transformers' raise_exception and
// strftime_now next to jinja2's range, namespace, dict and joiner.
//
// Each builtin follows the jinja2 3.1 / CPython implementation it names, including the odd
// corners templates rely on: `default` only replaces undefined (not none), `map`/`select`
// return single-use generators that treat none as empty, `int` accepts "42.5", `tojson` is
// transformers' json.dumps rather than jinja2's HTML-safe one. Names jinja2 knows but this
// file does not implement are listed in kUnsupportedFilters/kUnsupportedTests so errors can
// say "unsupported" rather than "unknown".
#include <algorithm>
#include <cmath>
#include <ctime>
#include <fmt/format.h>
#include <map>
#include <set>

#include "formats/chat_template_detail.h"

namespace turbospark::chat_template_detail {
namespace {

std::string percent_format(const std::string& f, const std::vector<Value>& values) {
  std::string out;
  size_t next = 0;
  for (size_t k = 0; k < f.size(); ++k) {
    if (f[k] != '%') {
      out += f[k];
      continue;
    }
    if (++k >= f.size()) raise("incomplete format");
    if (f[k] == '%') {
      out += '%';
      continue;
    }
    std::string spec;
    while (k < f.size() && (f[k] == '.' || isdigit(static_cast<unsigned char>(f[k])))) spec += f[k++];
    if (k >= f.size()) raise("incomplete format");
    char conv = f[k];
    if (next >= values.size()) raise("not enough arguments for format string");
    const Value& v = values[next++];
    if (conv == 's' && spec.empty()) {
      out += to_str(v);
    } else if (conv == 'r' && spec.empty()) {
      out += to_repr(v);
    } else if ((conv == 'd' || conv == 'i') && spec.empty() && v.is_number()) {
      out += std::to_string(v.kind == Kind::Float ? int64_t(v.f) : v.as_int());
    } else if (conv == 'f' && v.is_number() && (spec.empty() || spec[0] == '.')) {
      int prec = spec.empty() ? 6 : std::stoi(spec.substr(1));
      out += fmt::format("{:.{}f}", v.as_double(), prec);
    } else {
      raise(fmt::format("unsupported: '%{}{}' in the format filter", spec, conv));
    }
  }
  if (next < values.size()) raise("not all arguments converted during string formatting");
  return out;
}

// ---- Python float()/int() of strings ----
std::optional<double> parse_py_float(const std::string& s) {
  std::string t = py_strip(s, std::nullopt, true, true);
  std::string clean;
  for (size_t k = 0; k < t.size(); ++k) {
    if (t[k] == '_') {
      if (k == 0 || k + 1 >= t.size() || !isdigit(static_cast<unsigned char>(t[k - 1])) ||
          !isdigit(static_cast<unsigned char>(t[k + 1])))
        return std::nullopt;
      continue;
    }
    clean += char(tolower(static_cast<unsigned char>(t[k])));
  }
  std::string body = clean;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) body = body.substr(1);
  if (body == "inf" || body == "infinity" || body == "nan") {
    double v = body == "nan" ? NAN : INFINITY;
    return clean[0] == '-' ? -v : v;
  }
  if (body.empty() || body.find_first_not_of("0123456789.e+-") != std::string::npos || body.find('x') != std::string::npos)
    return std::nullopt;
  char* end = nullptr;
  double v = std::strtod(clean.c_str(), &end);
  if (end != clean.c_str() + clean.size()) return std::nullopt;
  return v;
}

std::optional<int64_t> parse_py_int(const std::string& s, int base) {
  std::string t = py_strip(s, std::nullopt, true, true);
  if (t.empty()) return std::nullopt;
  bool neg = false;
  size_t k = 0;
  if (t[0] == '+' || t[0] == '-') {
    neg = t[0] == '-';
    k = 1;
  }
  if (base == 16 && t.compare(k, 2, "0x") == 0) k += 2;
  if (k >= t.size()) return std::nullopt;
  int64_t v = 0;
  bool prev_digit = false;
  for (; k < t.size(); ++k) {
    char c = char(tolower(static_cast<unsigned char>(t[k])));
    if (c == '_' && prev_digit && k + 1 < t.size()) {
      prev_digit = false;
      continue;
    }
    int d = isdigit(static_cast<unsigned char>(c)) ? c - '0' : (c >= 'a' && c <= 'z') ? c - 'a' + 10 : 99;
    if (d >= base) return std::nullopt;
    if (__builtin_mul_overflow(v, int64_t(base), &v) || __builtin_add_overflow(v, int64_t(d), &v)) return std::nullopt;
    prev_digit = true;
  }
  if (!prev_digit) return std::nullopt;
  return neg ? -v : v;
}

// Python round(x, n): correctly rounded half-even on the exact binary value, which is what
// printf's "%.*f" computes.
double py_round(double x, int64_t digits) {
  if (!std::isfinite(x)) return x;
  if (digits > 300) return x;
  if (digits < 0) {
    double p = std::pow(10.0, double(-digits));
    double y = std::nearbyint(x / p) * p;
    return y;
  }
  std::string s = fmt::format("{:.{}f}", x, int(digits));
  return std::strtod(s.c_str(), nullptr);
}

// ---- attribute paths for map/selectattr/sort/... (jinja2 make_attrgetter: items first) ----
Value attr_path(const Value& item, const std::string& path) {
  Value cur = item;
  size_t b = 0;
  while (true) {
    size_t e = path.find('.', b);
    std::string part = path.substr(b, e == std::string::npos ? std::string::npos : e - b);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
    cur = get_item(cur, numeric ? Value::integer(std::stoll(part)) : Value::string(part));
    if (e == std::string::npos) return cur;
    b = e + 1;
  }
}

Value generator(std::vector<Value> items, const char* type = "generator") {
  return Value::make_list(std::move(items), ListKind::Generator, type);
}


// Sort key for sort/dictsort/unique/min/max: strings compare lower-cased unless
// case_sensitive.
Value sort_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::string(change_case(v.s, false));
  return v;
}

// ---- filters ----
using FilterFn = Value (*)(Evaluator&, const Value&, CallArgs&);

Value join_values(Evaluator&, const std::vector<Value>& items, const std::string& sep) {
  std::string out;
  for (size_t k = 0; k < items.size(); ++k) {
    if (k) out += sep;
    out += to_str(items[k]);
  }
  return Value::string(out);
}

Value f_abs(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "abs");
  require_defined(v);
  if (v.kind == Kind::Float) return Value::real(std::fabs(v.f));
  if (v.is_integral()) return Value::integer(std::llabs(v.as_int()));
  raise(fmt::format("bad operand type for abs(): '{}'", type_name(v)));
}

Value f_attr(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"name"}, "attr");
  if (!a[0]) raise("attr filter needs a name");
  const std::string& name = require_string(*a[0], "attr");
  require_defined(v);
  // Python getattr only: a dict's methods, never its items.
  Value r = get_attr(v, name);
  if (v.is_plain_dict() && r.kind != Kind::Callable && !r.is_undefined()) return missing_attribute(v, name);
  return r;
}

Value f_capitalize(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "capitalize");
  return keep_markup(v, Value::string(py_capitalize(to_str(v))));
}

Value f_center(Evaluator& ev, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"width"}, "center");
  CallArgs inner;
  inner.positional.push_back(arg_or(a[0], Value::integer(80)));
  (void)ev;
  return keep_markup(v, call_str_method(Value::string(to_str(v)), "center", inner));
}

Value f_default(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"default_value", "boolean"}, "default");
  bool boolean = a[1] && truthy(*a[1]);
  if (v.is_undefined() || (boolean && !truthy(v))) return arg_or(a[0], Value::string(""));
  return v;
}

Value f_dictsort(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"case_sensitive", "by", "reverse"}, "dictsort");
  bool case_sensitive = a[0] && truthy(*a[0]);
  std::string by = a[1] ? require_string(*a[1], "dictsort") : "key";
  bool reverse = a[2] && truthy(*a[2]);
  require_defined(v);
  if (!v.is_plain_dict()) raise("dictsort expects a mapping");
  if (by != "key" && by != "value") raise("You can only sort by either \"key\" or \"value\"");
  std::vector<Value> items;
  for (const auto& [k, val] : v.dict->items) items.push_back(tuple2(key_value(k), val));
  size_t pos = by == "key" ? 0 : 1;
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    Value kx = sort_key(x.list->items[pos], case_sensitive), ky = sort_key(y.list->items[pos], case_sensitive);
    return reverse ? py_lt(ky, kx) : py_lt(kx, ky);
  });
  return Value::make_list(std::move(items));
}

Value f_escape(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "escape");
  if (v.is_string() && v.markup) return v;
  return markup_string(html_escape(to_str(v)));
}

Value f_first(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "first");
  if (v.is_list() && v.list->kind == ListKind::Generator) {
    auto& l = *v.list;
    if (l.cursor < l.items.size()) return l.items[l.cursor++];
  } else {
    std::vector<Value> items = iterate(v);
    if (!items.empty()) return items.front();
  }
  return Value::undefined("No first item, sequence was empty.");
}

Value f_last(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "last");
  if (v.is_list() && v.list->kind == ListKind::Generator) raise(fmt::format("'{}' object is not reversible", type_name(v)));
  if (v.is_list() && v.list->kind == ListKind::View && v.list->wrapper != "dict_keys" &&
      v.list->wrapper != "dict_values" && v.list->wrapper != "dict_items" && v.list->wrapper.rfind("range", 0) != 0)
    raise(fmt::format("'{}' object is not reversible", type_name(v)));
  std::vector<Value> items = iterate(v);
  if (!items.empty()) return items.back();
  return Value::undefined("No last item, sequence was empty.");
}

Value f_float(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"default"}, "float");
  Value fallback = arg_or(a[0], Value::real(0.0));
  if (v.is_number()) return Value::real(v.as_double());
  if (v.is_string()) {
    if (auto d = parse_py_float(v.s)) return Value::real(*d);
  }
  return fallback;
}

Value f_format(Evaluator&, const Value& v, CallArgs& args) {
  if (!args.keyword.empty()) raise("unsupported: keyword arguments to the format filter");
  return Value::string(percent_format(to_str(v), args.positional));
}

Value f_indent(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"width", "first", "blank"}, "indent");
  std::string indention;
  if (a[0] && a[0]->is_string()) {
    indention = a[0]->s;
  } else {
    int64_t width = a[0] ? require_int(*a[0], "indent") : 4;
    indention = std::string(size_t(std::max<int64_t>(width, 0)), ' ');
  }
  bool first = a[1] && truthy(*a[1]);
  bool blank = a[2] && truthy(*a[2]);
  std::string s = to_str(v) + "\n";  // jinja2's quirk so py_splitlines() keeps a trailing empty line
  std::vector<std::string> lines = py_splitlines(s, false);
  std::string rv;
  if (blank) {
    for (size_t k = 0; k < lines.size(); ++k) rv += (k ? "\n" + indention : "") + lines[k];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t k = 1; k < lines.size(); ++k) rv += "\n" + (lines[k].empty() ? lines[k] : indention + lines[k]);
  }
  if (first) rv = indention + rv;
  return keep_markup(v, Value::string(rv));
}

Value f_int(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"default", "base"}, "int");
  Value fallback = arg_or(a[0], Value::integer(0));
  int64_t base = a[1] ? require_int(*a[1], "int") : 10;
  if (v.is_integral()) return Value::integer(v.as_int());
  if (v.kind == Kind::Float) {
    if (!std::isfinite(v.f)) raise("cannot convert float infinity or NaN to integer");
    return Value::integer(int64_t(std::trunc(v.f)));
  }
  if (v.is_string()) {
    if (auto i = parse_py_int(v.s, int(base))) return Value::integer(*i);
    if (auto d = parse_py_float(v.s)) {
      if (!std::isfinite(*d)) raise("cannot convert float infinity or NaN to integer");
      return Value::integer(int64_t(std::trunc(*d)));
    }
  }
  return fallback;
}

Value f_items(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "items");
  if (v.is_undefined()) return generator({});
  if (!v.is_plain_dict()) raise("Can only get item pairs from a mapping.");
  std::vector<Value> items;
  for (const auto& [k, val] : v.dict->items) items.push_back(tuple2(key_value(k), val));
  return generator(std::move(items));
}

Value f_join(Evaluator& ev, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"d", "attribute"}, "join");
  std::string sep = a[0] ? to_str(*a[0]) : "";
  std::vector<Value> items = iterate(v);
  if (a[1] && !a[1]->is_none()) {
    std::string path = to_str(*a[1]);
    for (auto& item : items) item = attr_path(item, path);
  }
  return join_values(ev, items, sep);
}

Value f_length(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "length");
  return Value::integer(py_len(v));
}

Value f_list(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "list");
  return Value::make_list(iterate(v));
}

Value f_lower(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "lower");
  return keep_markup(v, Value::string(change_case(to_str(v), false)));
}

Value f_upper(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "upper");
  return keep_markup(v, Value::string(change_case(to_str(v), true)));
}

Value f_map(Evaluator& ev, const Value& v, CallArgs& args) {
  if (!truthy(v)) return generator({});  // jinja2: `if value:` before iterating, so none is empty
  std::vector<Value> items = iterate(v);
  std::vector<Value> out;
  const Value* attribute = nullptr;
  const Value* fallback = nullptr;
  for (const auto& [k, val] : args.keyword) {
    if (k == "attribute") attribute = &val;
    else if (k == "default") fallback = &val;
  }
  if (attribute) {
    if (!args.positional.empty()) raise("map: positional arguments with attribute=");
    for (const auto& [k, val] : args.keyword)
      if (k != "attribute" && k != "default") raise(fmt::format("Unexpected keyword argument '{}'", k));
    std::string path = to_str(*attribute);
    for (const auto& item : items) {
      Value r = attr_path(item, path);
      if (r.is_undefined() && fallback) r = *fallback;
      out.push_back(std::move(r));
    }
    return generator(std::move(out));
  }
  if (args.positional.empty()) raise("map requires a filter argument");
  std::string name = require_string(args.positional[0], "map");
  if (!is_known_filter(name)) {
    raise(is_jinja_filter(name) ? fmt::format("unsupported filter '{}'", name) : fmt::format("No filter named '{}'.", name));
  }
  CallArgs rest;
  rest.positional.assign(args.positional.begin() + 1, args.positional.end());
  rest.keyword = args.keyword;
  for (const auto& item : items) {
    CallArgs copy = rest;
    out.push_back(apply_filter(ev, name, item, copy));
  }
  return generator(std::move(out));
}

Value min_max(const Value& v, CallArgs& args, bool want_max) {
  auto a = bind_args(args, {"case_sensitive", "attribute"}, want_max ? "max" : "min");
  bool case_sensitive = a[0] && truthy(*a[0]);
  std::vector<Value> items = iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  auto key = [&](const Value& x) {
    Value k = (a[1] && !a[1]->is_none()) ? attr_path(x, to_str(*a[1])) : x;
    return sort_key(k, case_sensitive);
  };
  size_t best = 0;
  for (size_t k = 1; k < items.size(); ++k) {
    bool better = want_max ? py_lt(key(items[best]), key(items[k])) : py_lt(key(items[k]), key(items[best]));
    if (better) best = k;
  }
  return items[best];
}
Value f_max(Evaluator&, const Value& v, CallArgs& args) { return min_max(v, args, true); }
Value f_min(Evaluator&, const Value& v, CallArgs& args) { return min_max(v, args, false); }

Value select_impl(Evaluator& ev, const Value& v, CallArgs& args, bool by_attr, bool keep) {
  if (!truthy(v)) return generator({});  // jinja2: `if value:` before iterating, so none is empty
  std::vector<Value> items = iterate(v);
  size_t first_test_arg = 0;
  std::string attr;
  if (by_attr) {
    if (args.positional.empty()) raise("Missing parameter for attribute name");
    attr = to_str(args.positional[0]);
    first_test_arg = 1;
  }
  if (!args.keyword.empty()) raise("unsupported: keyword arguments to select/reject filters");
  std::optional<std::string> test;
  CallArgs test_args;
  if (args.positional.size() > first_test_arg) {
    test = require_string(args.positional[first_test_arg], "select");
    if (!is_known_test(*test))
      raise(is_jinja_test(*test) ? fmt::format("unsupported test '{}'", *test) : fmt::format("No test named '{}'.", *test));
    test_args.positional.assign(args.positional.begin() + first_test_arg + 1, args.positional.end());
  }
  std::vector<Value> out;
  for (const auto& item : items) {
    Value subject = by_attr ? attr_path(item, attr) : item;
    bool ok;
    if (test) {
      CallArgs copy = test_args;
      ok = apply_test(ev, *test, subject, copy);
    } else {
      ok = truthy(subject);
    }
    if (ok == keep) out.push_back(item);
  }
  return generator(std::move(out));
}
Value f_select(Evaluator& ev, const Value& v, CallArgs& a) { return select_impl(ev, v, a, false, true); }
Value f_reject(Evaluator& ev, const Value& v, CallArgs& a) { return select_impl(ev, v, a, false, false); }
Value f_selectattr(Evaluator& ev, const Value& v, CallArgs& a) { return select_impl(ev, v, a, true, true); }
Value f_rejectattr(Evaluator& ev, const Value& v, CallArgs& a) { return select_impl(ev, v, a, true, false); }

Value f_replace(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"old", "new", "count"}, "replace");
  if (!a[0] || !a[1]) raise("replace filter needs old and new");
  int64_t count = (a[2] && !a[2]->is_none()) ? require_int(*a[2], "replace") : -1;
  return Value::string(py_replace(to_str(v), to_str(*a[0]), to_str(*a[1]), count));
}

Value f_reverse(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "reverse");
  if (v.is_string()) {
    std::u32string u = utf8_decode(v.s);
    std::reverse(u.begin(), u.end());
    return Value::string(utf8_encode(u));
  }
  std::vector<Value> items = iterate(v);
  std::reverse(items.begin(), items.end());
  if (v.is_list() && v.list->kind == ListKind::Generator) return Value::make_list(std::move(items));
  const char* type = v.is_plain_dict() ? "dict_reversekeyiterator" : "list_reverseiterator";
  return generator(std::move(items), type);
}

Value f_round(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"precision", "method"}, "round");
  int64_t precision = a[0] ? require_int(*a[0], "round") : 0;
  std::string method = a[1] ? require_string(*a[1], "round") : "common";
  require_defined(v);
  if (!v.is_number()) raise(fmt::format("type {} doesn't define __round__ method", type_name(v)));
  if (method == "common") {
    if (v.is_integral()) {
      if (precision >= 0) return Value::integer(v.as_int());
      raise("unsupported: round() of an integer to negative precision");
    }
    return Value::real(py_round(v.f, precision));
  }
  if (method != "floor" && method != "ceil") raise("method must be common, ceil or floor");
  double p = std::pow(10.0, double(precision));
  double x = v.as_double() * p;
  return Value::real((method == "floor" ? std::floor(x) : std::ceil(x)) / p);
}

Value f_safe(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "safe");
  return markup_string(to_str(v));
}

Value f_sort(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"reverse", "case_sensitive", "attribute"}, "sort");
  bool reverse = a[0] && truthy(*a[0]);
  bool case_sensitive = a[1] && truthy(*a[1]);
  std::vector<Value> items = iterate(v);
  std::optional<std::string> attr;
  if (a[2] && !a[2]->is_none()) attr = to_str(*a[2]);
  if (attr && attr->find(',') != std::string::npos) raise("unsupported: sorting by several attributes");
  auto key = [&](const Value& x) { return sort_key(attr ? attr_path(x, *attr) : x, case_sensitive); };
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    return reverse ? py_lt(key(y), key(x)) : py_lt(key(x), key(y));
  });
  return Value::make_list(std::move(items));
}

Value f_string(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "string");
  return keep_markup(v, Value::string(to_str(v)));
}

Value f_sum(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"attribute", "start"}, "sum");
  Value total = arg_or(a[1], Value::integer(0));
  for (const auto& item : iterate(v)) {
    Value x = (a[0] && !a[0]->is_none()) ? attr_path(item, to_str(*a[0])) : item;
    total = binary_op("+", total, x);
  }
  return total;
}

Value f_title(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "title");
  // jinja2 do_title: words start after runs of [-\s({\[<]; first char upper, rest lower.
  std::u32string u = utf8_decode(to_str(v)), out;
  bool at_start = true;
  for (char32_t c : u) {
    bool sep = is_py_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    if (sep) {
      out.push_back(c);
      at_start = true;
      continue;
    }
    map_case(c, at_start, out);
    at_start = false;
  }
  return Value::string(utf8_encode(out));
}

Value f_tojson(Evaluator&, const Value& v, CallArgs& args) {
  // transformers: json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
  auto a = bind_args(args, {"ensure_ascii", "indent", "separators", "sort_keys"}, "tojson");
  JsonOptions o;
  o.ensure_ascii = a[0] && truthy(*a[0]);
  if (a[1] && !a[1]->is_none()) {
    if (a[1]->is_string()) {
      o.indent = a[1]->s;
    } else {
      int64_t n = require_int(*a[1], "tojson indent");
      o.indent = std::string(size_t(std::max<int64_t>(n, 0)), ' ');
    }
  }
  if (a[2] && !a[2]->is_none()) {
    const Value& s = *a[2];
    if (!s.is_list() || s.list->items.size() != 2 || !s.list->items[0].is_string() || !s.list->items[1].is_string())
      raise("tojson separators must be a pair of strings");
    o.separators = std::make_pair(s.list->items[0].s, s.list->items[1].s);
  }
  o.sort_keys = a[3] && truthy(*a[3]);
  return Value::string(to_json(v, o));
}

Value f_trim(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"chars"}, "trim");
  std::optional<std::u32string> chars;
  if (a[0] && !a[0]->is_none()) chars = utf8_decode(to_str(*a[0]));
  if (v.is_string() && v.markup && a[0] && escape_changes(*a[0]))
    raise("unsupported: trim of Markup with characters that HTML escaping changes");
  return keep_markup(v, Value::string(py_strip(to_str(v), chars, true, true)));
}

Value f_unique(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"case_sensitive", "attribute"}, "unique");
  bool case_sensitive = a[0] && truthy(*a[0]);
  std::vector<Value> seen, out;
  for (const auto& item : iterate(v)) {
    Value key = sort_key((a[1] && !a[1]->is_none()) ? attr_path(item, to_str(*a[1])) : item, case_sensitive);
    if (key.is_list() || key.kind == Kind::Dict) raise(fmt::format("unhashable type: '{}'", type_name(key)));
    bool dup = std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return py_eq(s, key); });
    if (dup) continue;
    seen.push_back(key);
    out.push_back(item);
  }
  return generator(std::move(out));
}

Value f_batch(Evaluator&, const Value& v, CallArgs& args) {
  auto a = bind_args(args, {"linecount", "fill_with"}, "batch");
  if (!a[0]) raise("batch needs a line count");
  int64_t n = require_int(*a[0], "batch");
  if (n <= 0) raise("batch line count must be positive");
  std::vector<Value> items = iterate(v), out, cur;
  for (auto& item : items) {
    cur.push_back(item);
    if (int64_t(cur.size()) == n) {
      out.push_back(Value::make_list(std::move(cur)));
      cur.clear();
    }
  }
  if (!cur.empty()) {
    if (a[1] && !a[1]->is_none())
      while (int64_t(cur.size()) < n) cur.push_back(*a[1]);
    out.push_back(Value::make_list(std::move(cur)));
  }
  return generator(std::move(out));
}

Value f_wordcount(Evaluator&, const Value& v, CallArgs& args) {
  bind_args(args, {}, "wordcount");
  std::string s = to_str(v);
  if (std::any_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) >= 0x80; }))
    raise("unsupported: wordcount of non-ASCII text");
  int64_t n = 0;
  bool in_word = false;
  for (char c : s) {
    bool w = isalnum(static_cast<unsigned char>(c)) || c == '_';
    if (w && !in_word) ++n;
    in_word = w;
  }
  return Value::integer(n);
}

const std::map<std::string, FilterFn>& filters() {
  static const std::map<std::string, FilterFn> table = {
      {"abs", f_abs},          {"attr", f_attr},       {"batch", f_batch},       {"capitalize", f_capitalize},
      {"center", f_center},    {"count", f_length},    {"d", f_default},         {"default", f_default},
      {"dictsort", f_dictsort}, {"e", f_escape},       {"escape", f_escape},     {"first", f_first},
      {"float", f_float},      {"format", f_format},   {"indent", f_indent},     {"int", f_int},
      {"items", f_items},      {"join", f_join},       {"last", f_last},         {"length", f_length},
      {"list", f_list},        {"lower", f_lower},     {"map", f_map},           {"max", f_max},
      {"min", f_min},          {"reject", f_reject},   {"rejectattr", f_rejectattr}, {"replace", f_replace},
      {"reverse", f_reverse},  {"round", f_round},     {"safe", f_safe},         {"select", f_select},
      {"selectattr", f_selectattr}, {"sort", f_sort},  {"string", f_string},     {"sum", f_sum},
      {"title", f_title},      {"tojson", f_tojson},   {"trim", f_trim},         {"unique", f_unique},
      {"upper", f_upper},      {"wordcount", f_wordcount},
  };
  return table;
}

const std::set<std::string> kUnsupportedFilters = {
    "filesizeformat", "forceescape", "groupby", "pprint",  "random", "slice",   "striptags",
    "truncate",       "urlencode",   "urlize",  "wordwrap", "xmlattr"};

// ---- tests ----
bool test_sameas(const Value& a, const Value& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::None: return true;
    case Kind::Bool: return a.b == b.b;
    case Kind::Int: return a.i == b.i && a.i >= -5 && a.i <= 256;  // CPython's small-int cache
    case Kind::List: return a.list == b.list;
    case Kind::Dict: return a.dict == b.dict;
    case Kind::Callable: return a.fn == b.fn;
    default: return false;
  }
}

const std::set<std::string> kKnownTests = {
    "defined", "undefined", "none",    "boolean", "false",  "true",   "integer", "float",       "number",
    "string",  "mapping",   "iterable", "sequence", "callable", "lower", "upper",  "odd",         "even",
    "divisibleby", "sameas", "in",     "eq",      "equalto", "==",    "ne",      "!=",          "lt",
    "lessthan", "<",        "le",      "<=",      "gt",     "greaterthan", ">",  "ge",          ">=",
    "filter",  "test"};
const std::set<std::string> kUnsupportedTests = {"escaped"};

const std::set<std::string> kJinjaGlobals = {"range", "dict", "lipsum", "cycler", "joiner", "namespace"};

Value make_joiner(const std::string& sep) {
  auto used = std::make_shared<bool>(false);
  return Value::callable("joiner", [used, sep](Evaluator&, CallArgs& args) {
    bind_args(args, {}, "joiner");
    if (!*used) {
      *used = true;
      return Value::string("");
    }
    return Value::string(sep);
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
std::vector<std::optional<Value>> bind_args(const CallArgs& args, std::initializer_list<const char*> names,
                                            const std::string& what) {
  std::vector<std::optional<Value>> out(names.size());
  if (args.positional.size() > names.size())
    raise(fmt::format("{}() takes at most {} argument(s) ({} given)", what, names.size(), args.positional.size()));
  for (size_t k = 0; k < args.positional.size(); ++k) out[k] = args.positional[k];
  for (const auto& [key, val] : args.keyword) {
    size_t idx = 0;
    for (const char* n : names) {
      if (key == n) break;
      ++idx;
    }
    if (idx == names.size()) raise(fmt::format("{}() got an unexpected keyword argument '{}'", what, key));
    if (out[idx]) raise(fmt::format("{}() got multiple values for argument '{}'", what, key));
    out[idx] = val;
  }
  return out;
}

bool is_known_filter(const std::string& name) { return filters().count(name) > 0; }
bool is_known_test(const std::string& name) { return kKnownTests.count(name) > 0; }
bool is_jinja_filter(const std::string& name) { return is_known_filter(name) || kUnsupportedFilters.count(name); }
bool is_jinja_test(const std::string& name) { return is_known_test(name) || kUnsupportedTests.count(name); }

Value apply_filter(Evaluator& ev, const std::string& name, const Value& subject, CallArgs& args) {
  auto it = filters().find(name);
  if (it == filters().end())
    raise(is_jinja_filter(name) ? fmt::format("unsupported filter '{}'", name) : fmt::format("unknown filter '{}'", name));
  return it->second(ev, subject, args);
}

bool apply_test(Evaluator& ev, const std::string& name, const Value& v, CallArgs& args) {
  (void)ev;
  auto one = [&]() -> Value {
    auto a = bind_args(args, {"other"}, name);
    if (!a[0]) raise(fmt::format("test '{}' needs an argument", name));
    return *a[0];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.kind == Kind::Bool;
  if (name == "false") return v.kind == Kind::Bool && !v.b;
  if (name == "true") return v.kind == Kind::Bool && v.b;
  if (name == "integer") return v.kind == Kind::Int;
  if (name == "float") return v.kind == Kind::Float;
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_plain_dict();
  if (name == "iterable") {
    return v.is_undefined() || v.is_string() || v.is_list() ||
           (v.kind == Kind::Dict && v.dict->kind != DictKind::Namespace);
  }
  if (name == "sequence") {
    return v.is_undefined() || v.is_string() || v.is_plain_dict() ||
           (v.is_list() && (v.list->kind == ListKind::List || v.list->kind == ListKind::Tuple ||
                            v.list->wrapper.rfind("range", 0) == 0));
  }
  if (name == "callable") return v.kind == Kind::Callable || v.is_undefined();
  if (name == "lower" || name == "upper") {
    CallArgs none;
    return truthy(call_str_method(Value::string(to_str(v)), name == "lower" ? "islower" : "isupper", none));
  }
  if (name == "odd" || name == "even") {
    Value m = binary_op("%", v, Value::integer(2));
    return py_eq(m, Value::integer(name == "odd" ? 1 : 0));
  }
  if (name == "divisibleby") return py_eq(binary_op("%", v, one()), Value::integer(0));
  if (name == "sameas") return test_sameas(v, one());
  if (name == "in") return py_contains(one(), v);
  if (name == "eq" || name == "equalto" || name == "==") return py_eq(v, one());
  if (name == "ne" || name == "!=") return !py_eq(v, one());
  if (name == "lt" || name == "lessthan" || name == "<") return py_lt(v, one());
  if (name == "gt" || name == "greaterthan" || name == ">") return py_lt(one(), v);
  if (name == "le" || name == "<=") return !py_lt(one(), v);
  if (name == "ge" || name == ">=") return !py_lt(v, one());
  if (name == "filter") return v.is_string() && is_jinja_filter(v.s);
  if (name == "test") return v.is_string() && is_jinja_test(v.s);
  raise(is_jinja_test(name) ? fmt::format("unsupported test '{}'", name) : fmt::format("unknown test '{}'", name));
}

Value get_global(const std::string& name) {
  if (name == "raise_exception") {
    return Value::callable(name, [](Evaluator&, CallArgs& args) -> Value {
      auto a = bind_args(args, {"message"}, "raise_exception");
      throw TemplateError("raise_exception: " + (a[0] ? to_str(*a[0]) : std::string()));
    });
  }
  if (name == "strftime_now") {
    return Value::callable(name, [](Evaluator&, CallArgs& args) -> Value {
      auto a = bind_args(args, {"format"}, "strftime_now");
      if (!a[0]) raise("strftime_now() needs a format");
      const std::string& f = require_string(*a[0], "strftime_now");
      std::time_t now = std::time(nullptr);
      std::tm local{};
      localtime_r(&now, &local);
      char buf[512];
      size_t n = std::strftime(buf, sizeof buf, f.c_str(), &local);
      if (n == 0 && !f.empty()) raise("strftime_now: format too long or empty result");
      return Value::string(std::string(buf, n));
    });
  }
  if (name == "range") {
    return Value::callable(name, [](Evaluator&, CallArgs& args) -> Value {
      if (!args.keyword.empty()) raise("range() takes no keyword arguments");
      std::vector<int64_t> p;
      for (const auto& a : args.positional) p.push_back(require_int(a, "range"));
      if (p.empty() || p.size() > 3) raise(fmt::format("range expected 1 to 3 arguments, got {}", p.size()));
      int64_t start = p.size() == 1 ? 0 : p[0], stop = p.size() == 1 ? p[0] : p[1], step = p.size() == 3 ? p[2] : 1;
      if (step == 0) raise("range() arg 3 must not be zero");
      std::vector<Value> items;
      for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
        if (items.size() >= 100000) raise("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        items.push_back(Value::integer(k));
      }
      std::string repr = step == 1 ? fmt::format("range({}, {})", start, stop)
                                   : fmt::format("range({}, {}, {})", start, stop, step);
      return Value::make_list(std::move(items), ListKind::View, repr);
    });
  }
  if (name == "dict" || name == "namespace") {
    return Value::callable(name, [name](Evaluator&, CallArgs& args) -> Value {
      Value d = Value::make_dict(name == "dict" ? DictKind::Dict : DictKind::Namespace);
      if (args.positional.size() > 1) raise(fmt::format("{} expected at most 1 positional argument", name));
      if (!args.positional.empty()) {
        const Value& src = args.positional[0];
        if (!src.is_plain_dict()) raise(fmt::format("unsupported: {}() from a non-mapping", name));
        d.dict->items = src.dict->items;
      }
      for (const auto& [k, v] : args.keyword) d.dict->set(k, v);
      return d;
    });
  }
  if (name == "joiner") {
    return Value::callable(name, [](Evaluator&, CallArgs& args) -> Value {
      auto a = bind_args(args, {"sep"}, "joiner");
      return make_joiner(a[0] ? to_str(*a[0]) : ", ");
    });
  }
  if (kJinjaGlobals.count(name)) {
    return Value::callable(name, [name](Evaluator&, CallArgs&) -> Value {
      raise(fmt::format("unsupported global function '{}'", name));
    });
  }
  return Value::undefined(fmt::format("'{}' is undefined", name));
}

Value call_value(Evaluator& ev, const Value& callee, CallArgs& args) {
  if (callee.kind == Kind::Callable) return callee.fn->fn(ev, args);
  require_defined(callee);
  raise(fmt::format("'{}' object is not callable", type_name(callee)));
}

}  // namespace turbospark::chat_template_detail
