// Python's str, dict and list methods as chat templates call them (.strip(), .split(),
// .startswith(), .get(), .items(), ...), and attribute / item / slice lookup as jinja2's
// ImmutableSandboxedEnvironment resolves `obj.name` and `obj[key]`: a real attribute
// (method) first for `.`, the item first for `[]`, undefined instead of an error when both
// miss, and mutating methods (list.append, dict.update) refused as the sandbox refuses them.
//
// Case mapping covers ASCII, Latin-1, Latin Extended-A, basic Greek and Cyrillic; text in
// scripts without case passes through; other cased letters are refused, not guessed.
#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <set>

#include "formats/chat_template_detail.h"

namespace turbospark::chat_template_detail {
static std::string object_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  return type_name(v) + " object";
}

Value missing_attribute(const Value& obj, const std::string& name) {
  return Value::undefined(fmt::format("'{}' has no attribute '{}'", object_type_repr(obj), name));
}

static Value missing_element(const Value& obj, const Value& key) {
  return Value::undefined(fmt::format("{} has no element {}", object_type_repr(obj), to_repr(key)));
}

void require_defined(const Value& v) {
  if (v.is_undefined()) raise(v.s);
}

const std::string& require_string(const Value& v, const std::string& what) {
  require_defined(v);
  if (!v.is_string()) raise(fmt::format("{} expects a string, got '{}'", what, type_name(v)));
  return v.s;
}

int64_t require_int(const Value& v, const std::string& what) {
  require_defined(v);
  if (!v.is_integral()) raise(fmt::format("'{}' object cannot be interpreted as an integer ({})", type_name(v), what));
  return v.as_int();
}

// ---- case conversion ----
// Python's str.upper()/lower() for ASCII, Latin-1, Latin Extended-A, basic Greek and
// Cyrillic; scripts without case pass through; any other cased letter is refused rather
// than converted wrongly.
static bool caseless(char32_t c) {
  if (c < 0xc0) return c != 0xb5;
  if (c == 0x3a2) return true;  // unassigned: Python leaves it as is
  if (c >= 0x180 && c < 0x250) return false;           // Latin Extended-B
  if (c >= 0x250 && c < 0x370) return c >= 0x2b0;      // IPA has case pairs, modifiers do not
  if (c >= 0x370 && c < 0x530) return false;
  if (c >= 0x530 && c < 0x590) return false;           // Armenian
  if (c >= 0x10a0 && c < 0x1100) return false;         // Georgian
  if (c >= 0x13a0 && c < 0x1400) return false;         // Cherokee
  if (c >= 0x1c80 && c < 0x1cc0) return false;
  if (c >= 0x1d00 && c < 0x2000) return false;         // phonetic ext, Latin ext additional, Greek ext
  if (c >= 0x2100 && c < 0x2190) return false;         // letterlike, roman numerals
  if (c >= 0x24b6 && c < 0x24ea) return false;         // circled letters
  if (c >= 0x2c00 && c < 0x2d30) return false;
  if (c >= 0xa640 && c < 0xa6a0) return false;
  if (c >= 0xa720 && c < 0xa800) return false;
  if (c >= 0xab70 && c < 0xabc0) return false;
  if (c >= 0xfb00 && c < 0xfb18) return false;         // ligatures
  if (c >= 0xff21 && c < 0xff5b) return false;         // fullwidth Latin
  if (c >= 0x10400 && c < 0x10500) return false;
  if (c >= 0x10c80 && c < 0x10d00) return false;
  if (c >= 0x118a0 && c < 0x11900) return false;
  if (c >= 0x16e40 && c < 0x16ea0) return false;
  if (c >= 0x1e900 && c < 0x1e960) return false;
  return c >= 0x180 || c == 0xd7 || c == 0xf7;  // the ranges above have case; × and ÷ do not
}

[[noreturn]] static void unsupported_case(char32_t c) {
  raise(fmt::format("unsupported: case conversion of U+{:04X} (only ASCII, Latin-1, Latin Extended-A, basic Greek "
                    "and Cyrillic are mapped)",
                    uint32_t(c)));
}

// Appends the upper (to_upper) or lower case of c; returns whether c is a cased letter.
bool map_case(char32_t c, bool to_upper, std::u32string& out) {
  auto emit = [&](char32_t x) {
    out.push_back(x);
    return true;
  };
  if (c < 0x80) {
    if (c >= 'a' && c <= 'z') return emit(to_upper ? c - 32 : c);
    if (c >= 'A' && c <= 'Z') return emit(to_upper ? c : c + 32);
    out.push_back(c);
    return false;
  }
  if (c >= 0xe0 && c <= 0xfe && c != 0xf7) return emit(to_upper ? c - 32 : c);
  if (c >= 0xc0 && c <= 0xde && c != 0xd7) return emit(to_upper ? c : c + 32);
  if (c == 0xdf) {
    if (!to_upper) return emit(c);
    out.push_back('S');
    return emit('S');
  }
  if (c == 0xff) return emit(to_upper ? 0x178 : c);
  if (c == 0xb5) return emit(to_upper ? 0x39c : c);
  if (c >= 0x100 && c < 0x180) {
    if (c == 0x130) {
      if (to_upper) return emit(c);
      out.push_back('i');
      return emit(0x307);
    }
    if (c == 0x131) return emit(to_upper ? 'I' : c);
    if (c == 0x138) return emit(c);
    if (c == 0x149) {
      if (!to_upper) return emit(c);
      out.push_back(0x2bc);
      return emit('N');
    }
    if (c == 0x178) return emit(to_upper ? c : 0xff);
    if (c == 0x17f) return emit(to_upper ? 'S' : c);
    bool odd_upper = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e);
    bool is_upper = odd_upper ? (c & 1) : !(c & 1);
    if (to_upper) return emit(is_upper ? c : c - 1);
    return emit(is_upper ? c + 1 : c);
  }
  // Greek: accented capitals and their small letters, then the plain alphabet.
  static const std::pair<char32_t, char32_t> kGreekPairs[] = {
      {0x386, 0x3ac}, {0x388, 0x3ad}, {0x389, 0x3ae}, {0x38a, 0x3af}, {0x38c, 0x3cc},
      {0x38e, 0x3cd}, {0x38f, 0x3ce}, {0x3aa, 0x3ca}, {0x3ab, 0x3cb}};
  for (auto [upper, lower] : kGreekPairs) {
    if (c == upper) return emit(to_upper ? upper : lower);
    if (c == lower) return emit(to_upper ? upper : lower);
  }
  if (c == 0x390 || c == 0x3b0) {  // iota / upsilon with dialytika and tonos: three code points
    if (!to_upper) return emit(c);
    out.push_back(c == 0x390 ? 0x399 : 0x3a5);
    out.push_back(0x308);
    return emit(0x301);
  }
  if (c == 0xaa || c == 0xba) return emit(c);  // ordinal indicators: lowercase, no upper form
  if (c >= 0x391 && c <= 0x3a9 && c != 0x3a2) {
    if (!to_upper && c == 0x3a3) unsupported_case(c);  // lower() picks final sigma by context
    return emit(to_upper ? c : c + 32);
  }
  if (c >= 0x3b1 && c <= 0x3c9) return emit(to_upper ? (c == 0x3c2 ? 0x3a3 : c - 32) : c);
  if (c >= 0x410 && c <= 0x42f) return emit(to_upper ? c : c + 32);
  if (c >= 0x430 && c <= 0x44f) return emit(to_upper ? c - 32 : c);
  if (c >= 0x400 && c <= 0x40f) return emit(to_upper ? c : c + 80);
  if (c >= 0x450 && c <= 0x45f) return emit(to_upper ? c - 80 : c);
  if (caseless(c)) {
    out.push_back(c);
    return false;
  }
  unsupported_case(c);
}

std::string change_case(const std::string& s, bool to_upper) {
  std::u32string out;
  for (char32_t c : utf8_decode(s)) map_case(c, to_upper, out);
  return utf8_encode(out);
}

// str.title(): a cased letter after a cased letter is lowered, any other is raised.
static std::string py_title(const std::string& s) {
  std::u32string out;
  bool prev_cased = false;
  for (char32_t c : utf8_decode(s)) {
    if (c == 0xdf && !prev_cased) {
      out += U"Ss";  // titlecase of sharp s
      prev_cased = true;
      continue;
    }
    prev_cased = map_case(c, !prev_cased, out);
  }
  return utf8_encode(out);
}

std::string py_capitalize(const std::string& s) {
  std::u32string u = utf8_decode(s), out;
  for (size_t k = 0; k < u.size(); ++k) {
    if (k == 0 && u[k] == 0xdf) {
      out += U"Ss";  // titlecase of sharp s
      continue;
    }
    map_case(u[k], k == 0, out);
  }
  return utf8_encode(out);
}

// ---- splitting ----
static std::vector<std::string> split_whitespace(const std::string& s, int64_t maxsplit, bool from_right) {
  std::u32string u = utf8_decode(s);
  std::vector<std::string> parts;
  if (!from_right) {
    size_t k = 0;
    while (true) {
      while (k < u.size() && is_py_space(u[k])) ++k;
      if (k >= u.size()) break;
      if (maxsplit >= 0 && int64_t(parts.size()) == maxsplit) {
        parts.push_back(utf8_encode(u.substr(k)));  // the rest keeps its trailing whitespace
        break;
      }
      size_t b = k;
      while (k < u.size() && !is_py_space(u[k])) ++k;
      parts.push_back(utf8_encode(u.substr(b, k - b)));
    }
    return parts;
  }
  int64_t k = int64_t(u.size());
  while (true) {
    while (k > 0 && is_py_space(u[k - 1])) --k;
    if (k <= 0) break;
    if (maxsplit >= 0 && int64_t(parts.size()) == maxsplit) {
      parts.push_back(utf8_encode(u.substr(0, k)));  // the rest keeps its leading whitespace
      break;
    }
    int64_t e = k;
    while (k > 0 && !is_py_space(u[k - 1])) --k;
    parts.push_back(utf8_encode(u.substr(k, e - k)));
  }
  std::reverse(parts.begin(), parts.end());
  return parts;
}

static std::vector<std::string> split_sep(const std::string& s, const std::string& sep, int64_t maxsplit, bool from_right) {
  if (sep.empty()) raise("empty separator");
  std::vector<std::string> parts;
  if (!from_right) {
    size_t start = 0;
    while (maxsplit < 0 || int64_t(parts.size()) < maxsplit) {
      size_t f = s.find(sep, start);
      if (f == std::string::npos) break;
      parts.push_back(s.substr(start, f - start));
      start = f + sep.size();
    }
    parts.push_back(s.substr(start));
    return parts;
  }
  size_t end = s.size();
  while (maxsplit < 0 || int64_t(parts.size()) < maxsplit) {
    if (end < sep.size()) break;
    size_t f = s.rfind(sep, end - sep.size());
    if (f == std::string::npos) break;
    parts.push_back(s.substr(f + sep.size(), end - f - sep.size()));
    end = f;
  }
  parts.push_back(s.substr(0, end));
  std::reverse(parts.begin(), parts.end());
  return parts;
}

std::vector<std::string> py_splitlines(const std::string& s, bool keepends) {
  std::u32string u = utf8_decode(s);
  std::vector<std::string> lines;
  size_t b = 0;
  for (size_t k = 0; k < u.size(); ++k) {
    char32_t c = u[k];
    bool brk = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e ||
               c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!brk) continue;
    size_t e = k + 1;
    if (c == '\r' && k + 1 < u.size() && u[k + 1] == '\n') e = k + 2;
    lines.push_back(utf8_encode(u.substr(b, (keepends ? e : k) - b)));
    b = e;
    k = e - 1;
  }
  if (b < u.size()) lines.push_back(utf8_encode(u.substr(b)));
  return lines;
}

static Value string_list(const std::vector<std::string>& parts) {
  std::vector<Value> items;
  for (const auto& p : parts) items.push_back(Value::string(p));
  return Value::make_list(std::move(items));
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts the replacement before every character and at the end.
    std::u32string u = utf8_decode(s);
    int64_t done = 0;
    for (char32_t c : u) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      utf8_append(out, c);
    }
    if (count < 0 || done < count) out += repl;
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t f = s.find(old, start);
    if (f == std::string::npos) break;
    out.append(s, start, f - start);
    out += repl;
    start = f + old.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  return out;
}

// Python slice bounds (PySlice_AdjustIndices).
static std::vector<int64_t> slice_indices(int64_t len, const Value& start_v, const Value& stop_v, const Value& step_v) {
  auto get = [](const Value& v, int64_t fallback) -> int64_t {
    if (v.is_none() || v.is_undefined()) return fallback;
    if (!v.is_integral()) raise("slice indices must be integers or None");
    return v.as_int();
  };
  int64_t step = get(step_v, 1);
  if (step == 0) raise("slice step cannot be zero");
  int64_t start = get(start_v, step < 0 ? len - 1 : 0);
  int64_t stop = get(stop_v, step < 0 ? -len - 1 : len);
  auto adjust = [&](int64_t& x) {
    if (x < 0) {
      x += len;
      if (x < 0) x = step < 0 ? -1 : 0;
    } else if (x >= len) {
      x = step < 0 ? len - 1 : len;
    }
  };
  adjust(start);
  adjust(stop);
  std::vector<int64_t> idx;
  if (step > 0) {
    for (int64_t k = start; k < stop; k += step) idx.push_back(k);
  } else {
    for (int64_t k = start; k > stop; k += step) idx.push_back(k);
  }
  return idx;
}

// ---- str.format ----
static std::string py_format(const std::string& fmt_str, const CallArgs& args) {
  std::string out;
  size_t auto_index = 0;
  for (size_t k = 0; k < fmt_str.size(); ++k) {
    char c = fmt_str[k];
    if (c == '{' && k + 1 < fmt_str.size() && fmt_str[k + 1] == '{') {
      out += '{';
      ++k;
    } else if (c == '}' && k + 1 < fmt_str.size() && fmt_str[k + 1] == '}') {
      out += '}';
      ++k;
    } else if (c == '{') {
      size_t e = fmt_str.find('}', k);
      if (e == std::string::npos) raise("Single '{' encountered in format string");
      std::string field = fmt_str.substr(k + 1, e - k - 1);
      if (field.find_first_of(":!.[") != std::string::npos)
        raise(fmt::format("unsupported: format field '{{{}}}' (only {{}}, {{0}} and {{name}} are implemented)", field));
      const Value* v = nullptr;
      if (field.empty() || std::all_of(field.begin(), field.end(), ::isdigit)) {
        size_t index = field.empty() ? auto_index++ : std::stoul(field);
        if (index >= args.positional.size()) raise(fmt::format("Replacement index {} out of range", index));
        v = &args.positional[index];
      } else {
        for (const auto& [name, val] : args.keyword)
          if (name == field) v = &val;
        if (!v) raise(fmt::format("KeyError: '{}'", field));
      }
      out += to_str(*v);
      k = e;
    } else if (c == '}') {
      raise("Single '}' encountered in format string");
    } else {
      out += c;
    }
  }
  return out;
}

// printf-style formatting for the `format` filter: %s, %r, %d/%i, %% and %.Nf.
// ---- methods ----
const std::set<std::string> kStrMethods = {
    "startswith", "endswith", "strip",    "lstrip",     "rstrip",       "split",     "rsplit",   "replace",
    "upper",      "lower",    "title",    "capitalize", "swapcase",     "find",      "rfind",    "index",
    "rindex",     "count",    "join",     "format",     "isdigit",      "isalpha",   "isalnum",  "isspace",
    "isupper",    "islower",  "isdecimal", "isnumeric", "splitlines",   "partition", "rpartition",
    "removeprefix", "removesuffix", "zfill", "ljust",   "rjust",        "center",    "casefold", "encode",
    "expandtabs", "format_map", "isascii", "isidentifier", "isprintable", "istitle", "maketrans", "translate"};
const std::set<std::string> kStrUnsupported = {"casefold", "encode",      "expandtabs", "format_map", "isidentifier",
                                               "isprintable", "istitle",  "maketrans",  "translate",  "swapcase"};
const std::set<std::string> kDictMethods = {"get", "keys", "values", "items", "copy"};

const std::set<std::string> kDictMutators = {"pop", "popitem", "update", "setdefault", "clear", "fromkeys"};

const std::set<std::string> kListMethods = {"index", "count", "copy"};

const std::set<std::string> kListMutators = {"append", "extend", "insert", "pop", "remove", "reverse", "sort", "clear"};

static bool ascii_only(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

static Value string_method(const Value& self, const std::string& name, CallArgs& args) {
  const std::string& s = self.s;
  const std::string what = "str." + name;
  if (kStrUnsupported.count(name)) raise(fmt::format("unsupported string method '{}'", name));
  if (name == "startswith" || name == "endswith") {
    auto a = bind_args(args, {"prefix", "start", "end"}, what);
    if (!a[0]) raise(what + "() takes at least 1 argument (0 given)");
    std::u32string u = utf8_decode(s);
    std::vector<int64_t> idx = slice_indices(int64_t(u.size()), arg_or(a[1], Value::none()), arg_or(a[2], Value::none()),
                                             Value::none());
    std::string sub = idx.empty() ? "" : utf8_encode(std::u32string_view(u).substr(idx.front(), idx.size()));
    std::vector<Value> candidates;
    if (a[0]->is_list() && a[0]->list->kind == ListKind::Tuple) {
      candidates = a[0]->list->items;
    } else {
      candidates.push_back(*a[0]);
    }
    for (const auto& c : candidates) {
      const std::string& p = require_string(c, what);
      bool hit = name == "startswith" ? sub.compare(0, p.size(), p) == 0 && sub.size() >= p.size()
                                      : sub.size() >= p.size() && sub.compare(sub.size() - p.size(), p.size(), p) == 0;
      if (hit) return Value::boolean(true);
    }
    return Value::boolean(false);
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    auto a = bind_args(args, {"chars"}, what);
    std::optional<std::u32string> chars;
    if (a[0] && !a[0]->is_none()) chars = utf8_decode(require_string(*a[0], what));
    return Value::string(py_strip(s, chars, name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    auto a = bind_args(args, {"sep", "maxsplit"}, what);
    int64_t maxsplit = a[1] ? require_int(*a[1], what) : -1;
    if (!a[0] || a[0]->is_none()) return string_list(split_whitespace(s, maxsplit, name == "rsplit"));
    return string_list(split_sep(s, require_string(*a[0], what), maxsplit, name == "rsplit"));
  }
  if (name == "replace") {
    auto a = bind_args(args, {"old", "new", "count"}, what);
    if (!a[0] || !a[1]) raise(what + "() takes at least 2 arguments");
    int64_t count = a[2] ? require_int(*a[2], what) : -1;
    return Value::string(py_replace(s, require_string(*a[0], what), require_string(*a[1], what), count));
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    bind_args(args, {}, what);
    if (name == "upper") return Value::string(change_case(s, true));
    if (name == "lower") return Value::string(change_case(s, false));
    if (name == "title") return Value::string(py_title(s));
    return Value::string(py_capitalize(s));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    auto a = bind_args(args, {"sub", "start", "end"}, what);
    if (!a[0]) raise(what + "() takes at least 1 argument (0 given)");
    if (a[1] || a[2]) raise(fmt::format("unsupported: start/end arguments of str.{}", name));
    const std::string& sub = require_string(*a[0], what);
    if (name == "count") {
      if (sub.empty()) return Value::integer(int64_t(utf8_decode(s).size()) + 1);
      int64_t n = 0;
      for (size_t f = s.find(sub); f != std::string::npos; f = s.find(sub, f + sub.size())) ++n;
      return Value::integer(n);
    }
    size_t f = (name == "find" || name == "index") ? s.find(sub) : s.rfind(sub);
    if (f == std::string::npos) {
      if (name == "index" || name == "rindex") raise("substring not found");
      return Value::integer(-1);
    }
    return Value::integer(int64_t(utf8_decode(s.substr(0, f)).size()));
  }
  if (name == "join") {
    auto a = bind_args(args, {"iterable"}, what);
    if (!a[0]) raise(what + "() takes exactly one argument (0 given)");
    std::string out;
    size_t k = 0;
    for (const Value& v : iterate(*a[0])) {
      if (!v.is_string()) raise(fmt::format("sequence item {}: expected str instance, {} found", k, type_name(v)));
      if (k++) out += s;
      out += v.s;
    }
    return Value::string(out);
  }
  if (name == "format") return Value::string(py_format(s, args));
  if (name == "splitlines") {
    auto a = bind_args(args, {"keepends"}, what);
    return string_list(py_splitlines(s, a[0] && truthy(*a[0])));
  }
  if (name == "partition" || name == "rpartition") {
    auto a = bind_args(args, {"sep"}, what);
    if (!a[0]) raise(what + "() takes exactly one argument (0 given)");
    const std::string& sep = require_string(*a[0], what);
    if (sep.empty()) raise("empty separator");
    size_t f = name == "partition" ? s.find(sep) : s.rfind(sep);
    std::vector<Value> parts;
    if (f == std::string::npos) {
      parts = name == "partition"
                  ? std::vector<Value>{Value::string(s), Value::string(""), Value::string("")}
                  : std::vector<Value>{Value::string(""), Value::string(""), Value::string(s)};
    } else {
      parts = {Value::string(s.substr(0, f)), Value::string(sep), Value::string(s.substr(f + sep.size()))};
    }
    return Value::make_list(std::move(parts), ListKind::Tuple);
  }
  if (name == "removeprefix" || name == "removesuffix") {
    auto a = bind_args(args, {"affix"}, what);
    if (!a[0]) raise(what + "() takes exactly one argument (0 given)");
    const std::string& p = require_string(*a[0], what);
    if (name == "removeprefix" && s.compare(0, p.size(), p) == 0 && s.size() >= p.size())
      return Value::string(s.substr(p.size()));
    if (name == "removesuffix" && !p.empty() && s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0)
      return Value::string(s.substr(0, s.size() - p.size()));
    return self;
  }
  if (name == "zfill" || name == "ljust" || name == "rjust" || name == "center") {
    auto a = bind_args(args, {"width", "fillchar"}, what);
    if (!a[0]) raise(what + "() takes at least 1 argument (0 given)");
    int64_t width = require_int(*a[0], what);
    std::u32string u = utf8_decode(s);
    std::u32string fill = U" ";
    if (a[1]) fill = utf8_decode(require_string(*a[1], what));
    if (fill.size() != 1) raise("The fill character must be exactly one character long");
    int64_t pad = width - int64_t(u.size());
    if (pad <= 0) return self;
    if (name == "zfill") {
      size_t sign = (!u.empty() && (u[0] == '+' || u[0] == '-')) ? 1 : 0;
      u.insert(sign, std::u32string(pad, U'0'));
    } else if (name == "ljust") {
      u.append(pad, fill[0]);
    } else if (name == "rjust") {
      u.insert(0, std::u32string(pad, fill[0]));
    } else {
      // CPython's pad(): left = pad/2 + (pad & width & 1)
      int64_t left = pad / 2 + (pad & width & 1);
      u = std::u32string(left, fill[0]) + u + std::u32string(pad - left, fill[0]);
    }
    return Value::string(utf8_encode(u));
  }
  // is* predicates: exact for ASCII text, refused otherwise.
  bind_args(args, {}, what);
  if (!ascii_only(s)) raise(fmt::format("unsupported: str.{}() of non-ASCII text", name));
  if (s.empty() && name != "isascii") return Value::boolean(false);
  auto all = [&](auto pred) {
    return Value::boolean(std::all_of(s.begin(), s.end(), [&](char c) { return pred(static_cast<unsigned char>(c)); }));
  };
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric") return all(::isdigit);
  if (name == "isalpha") return all(::isalpha);
  if (name == "isalnum") return all(::isalnum);
  if (name == "isspace") return Value::boolean(std::all_of(s.begin(), s.end(), [](char c) { return is_py_space(c); }));
  if (name == "isascii") return Value::boolean(true);
  if (name == "isupper" || name == "islower") {
    bool any_cased = false;
    for (char c : s) {
      if (isalpha(static_cast<unsigned char>(c))) {
        any_cased = true;
        if (name == "isupper" ? islower(static_cast<unsigned char>(c)) : isupper(static_cast<unsigned char>(c)))
          return Value::boolean(false);
      }
    }
    return Value::boolean(any_cased);
  }
  raise(fmt::format("unsupported string method '{}'", name));
}

// markupsafe.Markup methods return Markup and escape their string arguments; the result
// keeps the flag and arguments that escaping would change are refused.
bool escape_changes(const Value& v) {
  if (v.is_string()) return !v.markup && v.s.find_first_of("&<>\"'") != std::string::npos;
  if (v.is_list())
    for (const auto& item : v.list->items)
      if (escape_changes(item)) return true;
  return false;
}

Value keep_markup(const Value& source, Value result) {
  if (!(source.is_string() && source.markup)) return result;
  if (result.is_string()) result.markup = true;
  if (result.is_list())
    for (auto& item : result.list->items)
      if (item.is_string()) item.markup = true;
  return result;
}

const std::set<std::string> kMarkupMethods = {"strip", "lstrip", "rstrip", "replace", "upper", "lower", "title",
                                              "capitalize", "center", "ljust", "rjust", "zfill", "removeprefix",
                                              "removesuffix", "format", "join", "split", "rsplit", "splitlines",
                                              "partition", "rpartition"};

Value call_str_method(const Value& self, const std::string& name, CallArgs& args) {
  if (self.markup && kMarkupMethods.count(name)) {
    bool changes = false;
    for (const auto& a : args.positional) changes = changes || escape_changes(a);
    for (const auto& kv : args.keyword) changes = changes || escape_changes(kv.second);
    if (name == "join" && !args.positional.empty() && args.positional[0].is_list())
      changes = changes || escape_changes(args.positional[0]);
    if (changes) raise(fmt::format("unsupported: Markup.{}() with arguments that HTML escaping changes", name));
    return keep_markup(self, string_method(self, name, args));
  }
  return string_method(self, name, args);
}

static Value dict_method(const Value& self, const std::string& name, CallArgs& args) {
  const std::string what = "dict." + name;
  if (name == "get") {
    auto a = bind_args(args, {"key", "default"}, what);
    if (!a[0]) raise("get expected at least 1 argument, got 0");
    if (!a[0]->is_undefined())
      if (const Value* v = self.dict->find(dict_key(*a[0]))) return *v;
    return arg_or(a[1], Value::none());
  }
  bind_args(args, {}, what);
  if (name == "copy") {
    Value d = Value::make_dict();
    d.dict->items = self.dict->items;
    return d;
  }
  std::vector<Value> items;
  for (const auto& [k, v] : self.dict->items) {
    if (name == "keys") items.push_back(key_value(k));
    else if (name == "values") items.push_back(v);
    else items.push_back(tuple2(key_value(k), v));
  }
  return Value::make_list(std::move(items), ListKind::View, "dict_" + name);
}

static Value list_method(const Value& self, const std::string& name, CallArgs& args) {
  const std::string what = "list." + name;
  if (name == "copy") {
    bind_args(args, {}, what);
    return Value::make_list(self.list->items);
  }
  auto a = bind_args(args, {"value"}, what);
  if (!a[0]) raise(what + "() takes exactly one argument (0 given)");
  int64_t n = 0;
  for (size_t k = 0; k < self.list->items.size(); ++k) {
    if (py_eq(self.list->items[k], *a[0])) {
      if (name == "index") return Value::integer(int64_t(k));
      ++n;
    }
  }
  if (name == "index") raise(fmt::format("{} is not in list", to_repr(*a[0])));
  return Value::integer(n);
}

static Value bound_method(const Value& self, const std::string& name, Value (*impl)(const Value&, const std::string&, CallArgs&)) {
  return Value::callable(name, [self, name, impl](Evaluator&, CallArgs& args) { return impl(self, name, args); });
}

static Value unsafe_attribute(const Value& obj, const std::string& name) {
  return Value::undefined(fmt::format("access to attribute '{}' of '{}' object is unsafe.", name, type_name(obj)));
}

Value get_attr(const Value& obj, const std::string& name) {
  require_defined(obj);
  if (!name.empty() && name[0] == '_') return unsafe_attribute(obj, name);
  switch (obj.kind) {
    case Kind::String:
      if (kStrMethods.count(name)) return bound_method(obj, name, call_str_method);
      break;
    case Kind::List:
      if (obj.list->kind == ListKind::List || obj.list->kind == ListKind::Tuple) {
        if (kListMethods.count(name) && !(name == "copy" && obj.list->kind == ListKind::Tuple))
          return bound_method(obj, name, list_method);
        if (obj.list->kind == ListKind::List && kListMutators.count(name)) return unsafe_attribute(obj, name);
      }
      break;
    case Kind::Dict:
      if (obj.dict->kind == DictKind::Dict) {
        if (kDictMethods.count(name)) return bound_method(obj, name, dict_method);
        if (kDictMutators.count(name)) return unsafe_attribute(obj, name);
      }
      if (const Value* v = obj.dict->find(name)) return *v;
      break;
    default: break;
  }
  return missing_attribute(obj, name);
}

Value get_item(const Value& obj, const Value& key) {
  require_defined(obj);
  if (obj.is_plain_dict() && !key.is_undefined()) {
    if (const Value* v = obj.dict->find(dict_key(key))) return *v;
    if (key.is_string()) return get_attr(obj, key.s);
    return missing_element(obj, key);
  }
  if (key.is_integral()) {
    int64_t k = key.as_int();
    if (obj.is_string()) {
      std::u32string u = utf8_decode(obj.s);
      int64_t n = int64_t(u.size());
      if (k < 0) k += n;
      if (k < 0 || k >= n) return missing_element(obj, key);
      return keep_markup(obj, Value::string(utf8_encode(u.substr(size_t(k), 1))));
    }
    if (obj.is_list() && obj.list->kind != ListKind::Generator &&
        (obj.list->kind != ListKind::View || obj.list->wrapper.rfind("range", 0) == 0)) {
      int64_t n = int64_t(obj.list->items.size());
      if (k < 0) k += n;
      if (k < 0 || k >= n) return missing_element(obj, key);
      return obj.list->items[size_t(k)];
    }
    return missing_element(obj, key);
  }
  if (key.is_string()) return get_attr(obj, key.s);
  return missing_element(obj, key);
}

Value get_slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  require_defined(obj);
  if (obj.is_string()) {
    std::u32string u = utf8_decode(obj.s), out;
    for (int64_t k : slice_indices(int64_t(u.size()), start, stop, step)) out.push_back(u[size_t(k)]);
    return keep_markup(obj, Value::string(utf8_encode(out)));
  }
  if (obj.is_list() && (obj.list->kind == ListKind::List || obj.list->kind == ListKind::Tuple)) {
    std::vector<Value> out;
    for (int64_t k : slice_indices(int64_t(obj.list->items.size()), start, stop, step))
      out.push_back(obj.list->items[size_t(k)]);
    return Value::make_list(std::move(out), obj.list->kind);
  }
  return Value::undefined(fmt::format("'{}' object is not subscriptable", type_name(obj)));
}

}  // namespace turbospark::chat_template_detail
