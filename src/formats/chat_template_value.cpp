// Python semantics of chat-template values: str()/repr(), truthiness, comparisons, arithmetic,
// len/in/iteration, and json.dumps as transformers' tojson filter calls it. Templates feed
// these results straight into the prompt, so each rule mirrors CPython exactly where a chat
// template can observe it (float repr, list repr quoting, floor division signs, ...).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fmt/format.h>

#include "formats/chat_template_detail.h"

#include <cstdint>

namespace turbospark::chat_template_detail {

// ---------------------------------------------------------------------------------------------
// Dict
const Value* DictData::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}
Value* DictData::find(std::string_view key) {
  for (auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}
void DictData::set(const std::string& key, Value v) {
  if (Value* slot = find(key)) {
    *slot = std::move(v);
  } else {
    items.emplace_back(key, std::move(v));
  }
}

std::string dict_key(const Value& key) {
  switch (key.kind) {
    case Kind::String: return key.s;
    case Kind::Bool:
    case Kind::Int: return "\xffi" + std::to_string(key.as_int());
    case Kind::Float:
      if (std::isfinite(key.f) && key.f == std::floor(key.f) && std::fabs(key.f) < 9.2e18)
        return "\xffi" + std::to_string(int64_t(key.f));
      return "\xff" "f" + float_repr(key.f);
    case Kind::None: return "\xffn";
    case Kind::List:
      if (key.list->kind == ListKind::Tuple) raise("unsupported: tuple as a dict key");
      break;
    default: break;
  }
  raise("unhashable type: '" + type_name(key) + "'");
}

Value key_value(const std::string& key) {
  if (key.empty() || static_cast<unsigned char>(key[0]) != 0xff) return Value::string(key);
  if (key[1] == 'i') return Value::integer(std::stoll(key.substr(2)));
  if (key[1] == 'f') return Value::real(std::strtod(key.c_str() + 2, nullptr));
  return Value::none();
}

// ---------------------------------------------------------------------------------------------
// UTF-8
std::u32string utf8_decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    unsigned char c = s[i];
    char32_t cp;
    int n;
    if (c < 0x80) {
      cp = c, n = 1;
    } else if ((c >> 5) == 6) {
      cp = c & 0x1f, n = 2;
    } else if ((c >> 4) == 14) {
      cp = c & 0x0f, n = 3;
    } else if ((c >> 3) == 30) {
      cp = c & 0x07, n = 4;
    } else {
      raise("invalid UTF-8 in template text or context");
    }
    if (i + n > s.size()) raise("invalid UTF-8 in template text or context");
    for (int k = 1; k < n; ++k) {
      unsigned char cc = s[i + k];
      if ((cc >> 6) != 2) raise("invalid UTF-8 in template text or context");
      cp = (cp << 6) | (cc & 0x3f);
    }
    out.push_back(cp);
    i += n;
  }
  return out;
}

void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(char(c));
  } else if (c < 0x800) {
    out.push_back(char(0xc0 | (c >> 6)));
    out.push_back(char(0x80 | (c & 0x3f)));
  } else if (c < 0x10000) {
    out.push_back(char(0xe0 | (c >> 12)));
    out.push_back(char(0x80 | ((c >> 6) & 0x3f)));
    out.push_back(char(0x80 | (c & 0x3f)));
  } else {
    out.push_back(char(0xf0 | (c >> 18)));
    out.push_back(char(0x80 | ((c >> 12) & 0x3f)));
    out.push_back(char(0x80 | ((c >> 6) & 0x3f)));
    out.push_back(char(0x80 | (c & 0x3f)));
  }
}

std::string utf8_encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) utf8_append(out, c);
  return out;
}

bool is_py_space(char32_t c) {
  if (c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f)) return true;
  if (c < 0x85) return false;
  return c == 0x85 || c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 ||
         c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

std::string py_strip(std::string_view s, const std::optional<std::u32string>& chars, bool left, bool right) {
  std::u32string u = utf8_decode(s);
  auto strip_it = [&](char32_t c) { return chars ? chars->find(c) != std::u32string::npos : is_py_space(c); };
  size_t b = 0, e = u.size();
  if (left)
    while (b < e && strip_it(u[b])) ++b;
  if (right)
    while (e > b && strip_it(u[e - 1])) --e;
  return utf8_encode(std::u32string_view(u).substr(b, e - b));
}

// ---------------------------------------------------------------------------------------------
// str() / repr()
std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  // Shortest round-trip digits, then CPython's layout: fixed notation for exponents in
  // [-4, 16), otherwise d.ddde+XX; fixed always shows a fractional part ("5.0").
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  size_t epos = sci.find('e');
  std::string digits = sci.substr(0, epos);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  int exp = std::stoi(sci.substr(epos + 1));
  std::string out = neg ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      std::string int_part = digits.substr(0, std::min<size_t>(digits.size(), exp + 1));
      while (int_part.size() < size_t(exp + 1)) int_part += '0';
      std::string frac = digits.size() > size_t(exp + 1) ? digits.substr(exp + 1) : "0";
      out += int_part + "." + frac;
    } else {
      out += "0." + std::string(-exp - 1, '0') + digits;
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
  }
  return out;
}

// Python's str.isprintable() for the characters a chat is likely to hold: controls, the
// non-space separators and the common format characters are not printable; everything else
// is treated as printable (unassigned code points would differ, which no template observes).
static bool is_printable(char32_t c) {
  if (c < 0x20 || (c >= 0x7f && c <= 0xa0) || c == 0xad) return false;
  if (c == 0x378 || c == 0x379 || (c >= 0x380 && c <= 0x383) || c == 0x38b || c == 0x38d || c == 0x3a2)
    return false;  // unassigned in the Greek block
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) ||
      (c >= 0x205f && c <= 0x2064) || (c >= 0x2066 && c <= 0x206f) || c == 0x3000 || c == 0xfeff ||
      (c >= 0xfff9 && c <= 0xfffb) || (c >= 0x600 && c <= 0x605) || c == 0x61c || c == 0x6dd || c == 0x70f ||
      c == 0x180e || (c >= 0xd800 && c <= 0xf8ff) || c >= 0xf0000 || (c >= 0xe0000 && c <= 0xe007f))
    return false;
  return true;
}

static std::string repr_string(const std::string& s) {
  char quote = (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : utf8_decode(s)) {
    if (c == char32_t(quote) || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (is_printable(c)) {
      utf8_append(out, c);
    } else if (c <= 0xff) {
      out += fmt::format("\\x{:02x}", uint32_t(c));
    } else if (c <= 0xffff) {
      out += fmt::format("\\u{:04x}", uint32_t(c));
    } else {
      out += fmt::format("\\U{:08x}", uint32_t(c));
    }
  }
  out += quote;
  return out;
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::List:
      switch (v.list->kind) {
        case ListKind::List: return "list";
        case ListKind::Tuple: return "tuple";
        case ListKind::Generator: return v.list->wrapper.empty() ? "generator" : v.list->wrapper;
        case ListKind::View: return v.list->wrapper.rfind("range", 0) == 0 ? "range" : v.list->wrapper;
      }
      break;
    case Kind::Dict:
      return v.dict->kind == DictKind::Dict ? "dict" : v.dict->kind == DictKind::Namespace ? "Namespace" : "LoopContext";
    case Kind::Callable: return "function";
  }
  return "object";
}

static std::string repr_items(const std::vector<Value>& items, size_t from = 0) {
  std::string out;
  for (size_t k = from; k < items.size(); ++k) {
    if (k > from) out += ", ";
    out += to_repr(items[k]);
  }
  return out;
}

static std::string repr_dict(const DictData& d) {
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : d.items) {
    if (!first) out += ", ";
    first = false;
    out += to_repr(key_value(k)) + ": " + to_repr(v);
  }
  return out + "}";
}

std::string to_repr(const Value& v) {
  switch (v.kind) {
    case Kind::String: return repr_string(v.s);
    case Kind::Undefined: return "Undefined";  // jinja2's Undefined.__repr__
    case Kind::List:
      switch (v.list->kind) {
        case ListKind::List: return "[" + repr_items(v.list->items) + "]";
        case ListKind::Tuple:
          return "(" + repr_items(v.list->items) + (v.list->items.size() == 1 ? ",)" : ")");
        case ListKind::View:
          if (v.list->wrapper.rfind("range", 0) == 0) return v.list->wrapper;
          return v.list->wrapper + "([" + repr_items(v.list->items) + "])";
        case ListKind::Generator:
          raise("cannot render a " + type_name(v) +
                " object (Python prints its memory address); convert it with |list first");
      }
      break;
    case Kind::Dict:
      if (v.dict->kind == DictKind::Namespace) return "<Namespace " + repr_dict(*v.dict) + ">";
      if (v.dict->kind == DictKind::Loop) {
        const Value* index = v.dict->find("index");
        const Value* length = v.dict->find("length");
        return fmt::format("<LoopContext {}/{}>", index ? index->i : 0, length ? length->i : 0);
      }
      return repr_dict(*v.dict);
    case Kind::Callable:
      raise("cannot render the function '" + v.fn->name + "' (Python prints its memory address)");
    default: break;
  }
  return to_str(v);
}

std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

Value markup_string(std::string s) {
  Value v = Value::string(std::move(s));
  v.markup = true;
  return v;
}

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined: return "";
    case Kind::None: return "None";
    case Kind::Bool: return v.b ? "True" : "False";
    case Kind::Int: return std::to_string(v.i);
    case Kind::Float: return float_repr(v.f);
    case Kind::String: return v.s;
    default: return to_repr(v);
  }
}

// ---------------------------------------------------------------------------------------------
// truthiness, len, in, iteration
bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool: return v.b;
    case Kind::Int: return v.i != 0;
    case Kind::Float: return v.f != 0.0;
    case Kind::String: return !v.s.empty();
    case Kind::List: return v.list->kind == ListKind::Generator || !v.list->items.empty();
    case Kind::Dict: return v.dict->kind != DictKind::Dict || !v.dict->items.empty();
    case Kind::Callable: return true;
  }
  return false;
}

int64_t py_len(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined: return 0;
    case Kind::String: return int64_t(utf8_decode(v.s).size());
    case Kind::List:
      if (v.list->kind == ListKind::Generator) raise("object of type '" + type_name(v) + "' has no len()");
      return int64_t(v.list->items.size());
    case Kind::Dict:
      if (v.dict->kind == DictKind::Dict) return int64_t(v.dict->items.size());
      break;
    default: break;
  }
  raise("object of type '" + type_name(v) + "' has no len()");
}

std::vector<Value> iterate(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined: return {};
    case Kind::String: {
      std::vector<Value> out;
      std::string ch;
      for (char32_t c : utf8_decode(v.s)) {
        ch.clear();
        utf8_append(ch, c);
        out.push_back(Value::string(ch));
      }
      return out;
    }
    case Kind::List:
      if (v.list->kind == ListKind::Generator) {
        std::vector<Value> rest(v.list->items.begin() + v.list->cursor, v.list->items.end());
        v.list->cursor = v.list->items.size();
        return rest;
      }
      return v.list->items;
    case Kind::Dict:
      if (v.dict->kind == DictKind::Dict) {
        std::vector<Value> keys;
        for (const auto& kv : v.dict->items) keys.push_back(key_value(kv.first));
        return keys;
      }
      break;
    default: break;
  }
  raise("'" + type_name(v) + "' object is not iterable");
}

bool py_contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Kind::Undefined: return false;
    case Kind::String:
      if (!item.is_string())
        raise("'in <string>' requires string as left operand, not " + type_name(item));
      return container.s.find(item.s) != std::string::npos;
    case Kind::List: {
      auto& l = *container.list;
      size_t start = l.kind == ListKind::Generator ? l.cursor : 0;
      for (size_t k = start; k < l.items.size(); ++k) {
        if (py_eq(l.items[k], item)) {
          if (l.kind == ListKind::Generator) l.cursor = k + 1;
          return true;
        }
      }
      if (l.kind == ListKind::Generator) l.cursor = l.items.size();
      return false;
    }
    case Kind::Dict:
      if (container.dict->kind == DictKind::Dict) {
        if (item.is_undefined()) return false;
        return container.dict->find(dict_key(item)) != nullptr;
      }
      break;
    default: break;
  }
  raise("argument of type '" + type_name(container) + "' is not iterable");
}

// ---------------------------------------------------------------------------------------------
// comparisons
bool py_eq(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::Float || b.kind == Kind::Float) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::Undefined:
    case Kind::None: return true;
    case Kind::String: return a.s == b.s;
    case Kind::List: {
      if (a.list == b.list) return true;
      auto ka = a.list->kind, kb = b.list->kind;
      if (ka == ListKind::Generator || kb == ListKind::Generator) return false;
      if (ka != kb || a.list->wrapper != b.list->wrapper) return false;
      if (a.list->items.size() != b.list->items.size()) return false;
      for (size_t k = 0; k < a.list->items.size(); ++k)
        if (!py_eq(a.list->items[k], b.list->items[k])) return false;
      return true;
    }
    case Kind::Dict: {
      if (a.dict == b.dict) return true;
      if (a.dict->kind != DictKind::Dict || b.dict->kind != DictKind::Dict) return false;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* other = b.dict->find(k);
        if (!other || !py_eq(v, *other)) return false;
      }
      return true;
    }
    case Kind::Callable: return a.fn == b.fn;
    default: return false;
  }
}

bool py_lt(const Value& a, const Value& b) {
  if (a.is_undefined()) raise(a.s);
  if (b.is_undefined()) raise(b.s);
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::Float || b.kind == Kind::Float) return a.as_double() < b.as_double();
    return a.as_int() < b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.s < b.s;  // UTF-8 byte order is code point order
  if (a.is_list() && b.is_list() && a.list->kind == b.list->kind &&
      (a.list->kind == ListKind::List || a.list->kind == ListKind::Tuple)) {
    const auto &x = a.list->items, &y = b.list->items;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k)
      if (!py_eq(x[k], y[k])) return py_lt(x[k], y[k]);
    return x.size() < y.size();
  }
  raise("'<' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
}

// ---------------------------------------------------------------------------------------------
// arithmetic
[[noreturn]] static void unsupported_operands(const std::string& op, const Value& a, const Value& b) {
  raise("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
}

// Python integers are unbounded; this interpreter refuses what does not fit in 64 bits.
template <typename Op>
static int64_t checked(int64_t x, int64_t y, Op op) {
  int64_t r = 0;
  if (op(x, y, &r)) raise("integer overflow (Python integers are unbounded; this interpreter uses 64 bits)");
  return r;
}
static bool add_ovf(int64_t x, int64_t y, int64_t* r) { return __builtin_add_overflow(x, y, r); }
static bool sub_ovf(int64_t x, int64_t y, int64_t* r) { return __builtin_sub_overflow(x, y, r); }
static bool mul_ovf(int64_t x, int64_t y, int64_t* r) { return __builtin_mul_overflow(x, y, r); }

static Value repeat(const Value& seq, int64_t n) {
  // Checked before anything is built ('x' * 10**12 must not try to allocate it); an empty
  // sequence repeated stays empty without looping n times.
  const size_t unit = seq.is_string() ? seq.s.size() : seq.list->items.size();
  if (unit == 0) n = 0;
  if (n > 0) {
    size_t total = 0;
    if (__builtin_mul_overflow(unit, size_t(n), &total)) total = SIZE_MAX;
    if (seq.is_string()) check_template_bytes(total);
    else check_template_items(total);
  }
  if (seq.is_string()) {
    std::string out;
    for (int64_t k = 0; k < n; ++k) out += seq.s;
    Value r = Value::string(out);
    r.markup = seq.markup;
    return r;
  }
  std::vector<Value> out;
  for (int64_t k = 0; k < n; ++k) out.insert(out.end(), seq.list->items.begin(), seq.list->items.end());
  return Value::make_list(std::move(out), seq.list->kind);
}

Value binary_op(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) raise(a.s);
  if (b.is_undefined()) raise(b.s);
  bool both_int = a.is_integral() && b.is_integral();
  bool both_num = a.is_number() && b.is_number();
  if (op == "+") {
    if (both_int) return Value::integer(checked(a.as_int(), b.as_int(), add_ovf));
    if (both_num) return Value::real(a.as_double() + b.as_double());
    if (a.is_string() && b.is_string()) {
      check_template_bytes(a.s.size() + b.s.size());
      if (a.markup || b.markup)
        return markup_string((a.markup ? a.s : html_escape(a.s)) + (b.markup ? b.s : html_escape(b.s)));
      return Value::string(a.s + b.s);
    }
    if (a.is_list() && b.is_list() && a.list->kind == b.list->kind &&
        (a.list->kind == ListKind::List || a.list->kind == ListKind::Tuple)) {
      check_template_items(a.list->items.size() + b.list->items.size());
      std::vector<Value> items = a.list->items;
      items.insert(items.end(), b.list->items.begin(), b.list->items.end());
      return Value::make_list(std::move(items), a.list->kind);
    }
    if (a.is_string()) raise("can only concatenate str (not \"" + type_name(b) + "\") to str");
    if (a.is_list() && a.list->kind == ListKind::List)
      raise("can only concatenate list (not \"" + type_name(b) + "\") to list");
    unsupported_operands("+", a, b);
  }
  if (op == "-") {
    if (both_int) return Value::integer(checked(a.as_int(), b.as_int(), sub_ovf));
    if (both_num) return Value::real(a.as_double() - b.as_double());
    unsupported_operands("-", a, b);
  }
  if (op == "*") {
    if (both_int) return Value::integer(checked(a.as_int(), b.as_int(), mul_ovf));
    if (both_num) return Value::real(a.as_double() * b.as_double());
    auto is_seq = [](const Value& v) {
      return v.is_string() || (v.is_list() && (v.list->kind == ListKind::List || v.list->kind == ListKind::Tuple));
    };
    if (is_seq(a) && b.is_integral()) return repeat(a, b.as_int());
    if (is_seq(b) && a.is_integral()) return repeat(b, a.as_int());
    unsupported_operands("*", a, b);
  }
  if (op == "/") {
    if (!both_num) unsupported_operands("/", a, b);
    if (b.as_double() == 0) raise("division by zero");
    return Value::real(a.as_double() / b.as_double());
  }
  if (op == "//" || op == "%") {
    if (a.is_string() && op == "%")
      raise("unsupported: printf-style string formatting with '%' (use ~ or the format filter)");
    if (!both_num) unsupported_operands(op, a, b);
    if (both_int) {
      int64_t x = a.as_int(), y = b.as_int();
      if (y == 0) raise(op == "%" ? "integer modulo by zero" : "integer division or modulo by zero");
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {
        q -= 1;
        m += y;
      }
      return Value::integer(op == "%" ? m : q);
    }
    double x = a.as_double(), y = b.as_double();
    if (y == 0) raise("float divmod()");
    // CPython float_divmod: keeps the remainder's sign equal to the divisor's.
    double mod = std::fmod(x, y);
    double div = (x - mod) / y;
    if (mod != 0) {
      if ((y < 0) != (mod < 0)) {
        mod += y;
        div -= 1.0;
      }
    } else {
      mod = std::copysign(0.0, y);
    }
    double floordiv;
    if (div != 0) {
      floordiv = std::floor(div);
      if (div - floordiv > 0.5) floordiv += 1.0;
    } else {
      floordiv = std::copysign(0.0, x / y);
    }
    return Value::real(op == "%" ? mod : floordiv);
  }
  if (op == "**") {
    if (!both_num) unsupported_operands("** or pow()", a, b);
    if (both_int && b.as_int() >= 0) {
      // Square and multiply: O(log e) steps. A loop of e multiplications never overflows for a
      // base of 0, 1 or -1, so `0 ** 50111101012` ran for minutes (fuzz_chat_template's slow
      // unit, tests/fuzz/regressions/chat_template/huge-exponent.jinja). Squaring the base
      // overflows only where the result would, unless the base is 0 or +-1, which square safely.
      int64_t base = a.as_int(), e = b.as_int(), acc = 1;
      while (e > 0) {
        if (e & 1) acc = checked(acc, base, mul_ovf);
        e >>= 1;
        if (e > 0) base = checked(base, base, mul_ovf);
      }
      return Value::integer(acc);
    }
    double x = a.as_double(), y = b.as_double();
    if (x == 0 && y < 0) raise("0.0 cannot be raised to a negative power");
    if (x < 0 && y != std::floor(y)) raise("unsupported: fractional power of a negative number (complex result)");
    return Value::real(std::pow(x, y));
  }
  raise("unknown operator " + op);
}

// ---------------------------------------------------------------------------------------------
// JSON
Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u > uint64_t(INT64_MAX)) raise(fmt::format("context integer {} exceeds 64 bits", u));
      return Value::integer(int64_t(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return Value::make_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = Value::make_dict();
      for (auto it = j.begin(); it != j.end(); ++it) d.dict->items.emplace_back(it.key(), from_json(it.value()));
      return d;
    }
    default: raise("context holds a binary or discarded JSON value");
  }
}

static void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (char32_t c : utf8_decode(s)) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || (ensure_ascii && c >= 0x7f)) {
          if (c >= 0x10000) {
            char32_t v = c - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", uint32_t(0xd800 | (v >> 10)), uint32_t(0xdc00 | (v & 0x3ff)));
          } else {
            out += fmt::format("\\u{:04x}", uint32_t(c));
          }
        } else {
          utf8_append(out, c);
        }
    }
  }
  out += '"';
}

static void json_value(std::string& out, const Value& v, const JsonOptions& o, int level) {
  const std::string item_sep = o.separators ? o.separators->first : (o.indent ? "," : ", ");
  const std::string key_sep = o.separators ? o.separators->second : ": ";
  auto newline = [&](int lvl) {
    out += '\n';
    for (int k = 0; k < lvl; ++k) out += *o.indent;
  };
  switch (v.kind) {
    case Kind::None: out += "null"; return;
    case Kind::Bool: out += v.b ? "true" : "false"; return;
    case Kind::Int: out += std::to_string(v.i); return;
    case Kind::Float:
      if (std::isnan(v.f)) out += "NaN";
      else if (std::isinf(v.f)) out += v.f < 0 ? "-Infinity" : "Infinity";
      else out += float_repr(v.f);
      return;
    case Kind::String: json_string(out, v.s, o.ensure_ascii); return;
    case Kind::List:
      if (v.list->kind == ListKind::List || v.list->kind == ListKind::Tuple) {
        const auto& items = v.list->items;
        if (items.empty()) {
          out += "[]";
          return;
        }
        out += '[';
        for (size_t k = 0; k < items.size(); ++k) {
          if (k) out += item_sep;
          if (o.indent) newline(level + 1);
          json_value(out, items[k], o, level + 1);
        }
        if (o.indent) newline(level);
        out += ']';
        return;
      }
      break;
    case Kind::Dict:
      if (v.dict->kind == DictKind::Dict) {
        std::vector<const std::pair<std::string, Value>*> items;
        for (const auto& kv : v.dict->items) items.push_back(&kv);
        if (o.sort_keys)
          std::stable_sort(items.begin(), items.end(),
                           [](auto* x, auto* y) { return py_lt(key_value(x->first), key_value(y->first)); });
        if (items.empty()) {
          out += "{}";
          return;
        }
        out += '{';
        for (size_t k = 0; k < items.size(); ++k) {
          if (k) out += item_sep;
          if (o.indent) newline(level + 1);
          // json.dumps writes non-str keys as their JSON text, always quoted.
          Value key = key_value(items[k]->first);
          std::string key_text = key.is_string() ? key.s
                                 : key.is_none() ? "null"
                                 : key.kind == Kind::Float
                                     ? (std::isnan(key.f) ? "NaN" : std::isinf(key.f) ? (key.f < 0 ? "-Infinity" : "Infinity") : float_repr(key.f))
                                     : to_str(key);
          json_string(out, key_text, o.ensure_ascii);
          out += key_sep;
          json_value(out, items[k]->second, o, level + 1);
        }
        if (o.indent) newline(level);
        out += '}';
        return;
      }
      break;
    default: break;
  }
  raise("Object of type " + type_name(v) + " is not JSON serializable");
}

std::string to_json(const Value& v, const JsonOptions& options) {
  std::string out;
  json_value(out, v, options, 0);
  return out;
}

}  // namespace turbospark::chat_template_detail
