// Tokenizer for the jinja2 subset, configured as transformers configures jinja2:
// trim_blocks=True (a block or comment tag eats one following "\n"), lstrip_blocks=True
// (whitespace from the start of a line up to a block or comment tag is dropped),
// keep_trailing_newline=False, and "-"/"+" whitespace control on every tag.
//
// The rules are those of jinja2.lexer.Lexer.tokeniter, step for step, because every
// newline a chat template keeps or drops changes the prompt the model sees. Subtleties it
// reproduces: lstrip only applies when the tag's line started in the template text
// (`line_starting`), "{{" tags are never lstripped, "-" strips all Unicode whitespace,
// "}}" inside brackets is two braces rather than a tag end (`balance`), and "\r\n" / "\r"
// in the source become "\n" before anything else happens.
#include <cstring>
#include <fmt/format.h>

#include "formats/chat_template_detail.h"

namespace turbospark::chat_template_detail {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

// Byte length of the code point at `pos` when it is Python whitespace, else 0.
size_t space_at(const std::string& s, size_t pos) {
  unsigned char c = s[pos];
  if (c < 0x80) return is_py_space(c) ? 1 : 0;
  size_t n = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (pos + n > s.size()) return 0;
  std::u32string u = utf8_decode(std::string_view(s).substr(pos, n));
  return (u.size() == 1 && is_py_space(u[0])) ? n : 0;
}

size_t skip_spaces(const std::string& s, size_t pos) {
  while (pos < s.size()) {
    size_t n = space_at(s, pos);
    if (!n) break;
    pos += n;
  }
  return pos;
}

// text.rstrip() with Python's whitespace definition.
std::string rstrip_text(const std::string& text) {
  size_t end = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t n = space_at(text, pos);
    if (n) {
      pos += n;
    } else {
      unsigned char c = text[pos];
      pos += c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
      end = std::min(pos, text.size());
    }
  }
  return text.substr(0, end);
}

int count_newlines(const std::string& s, size_t from, size_t to) {
  int n = 0;
  for (size_t k = from; k < to && k < s.size(); ++k) n += s[k] == '\n';
  return n;
}

// (\d+_)*\d+ starting at pos; returns the end, or pos when there is no digit.
size_t scan_digits(const std::string& s, size_t pos) {
  if (pos >= s.size() || !is_digit(s[pos])) return pos;
  size_t p = pos;
  while (true) {
    while (p < s.size() && is_digit(s[p])) ++p;
    if (p + 1 < s.size() && s[p] == '_' && is_digit(s[p + 1])) {
      ++p;
      continue;
    }
    return p;
  }
}

// jinja2's float_re; returns the end of the match or npos.
size_t scan_float(const std::string& s, size_t pos) {
  if (pos > 0 && s[pos - 1] == '.') return std::string::npos;
  size_t p = scan_digits(s, pos);
  if (p == pos) return std::string::npos;
  auto exponent = [&](size_t q) -> size_t {
    if (q >= s.size() || (s[q] != 'e' && s[q] != 'E')) return std::string::npos;
    ++q;
    if (q < s.size() && (s[q] == '+' || s[q] == '-')) ++q;
    size_t r = scan_digits(s, q);
    return r == q ? std::string::npos : r;
  };
  size_t frac_end = std::string::npos;
  if (p < s.size() && s[p] == '.') {
    size_t q = scan_digits(s, p + 1);
    if (q != p + 1) frac_end = q;
  }
  if (frac_end != std::string::npos) {
    size_t e = exponent(frac_end);
    if (e != std::string::npos) return e;
  }
  size_t e = exponent(p);
  if (e != std::string::npos) return e;
  return frac_end;
}

// jinja2's integer_re; returns the end of the match or npos, and the value.
size_t scan_integer(const std::string& s, size_t pos, int64_t& value) {
  auto digit_value = [](char c) -> int {
    if (is_digit(c)) return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return 99;
  };
  auto scan_base = [&](size_t p, int base) -> size_t {
    // (_?[digit])+
    size_t start = p;
    value = 0;
    while (p < s.size()) {
      size_t q = p;
      if (s[q] == '_') ++q;
      if (q < s.size() && digit_value(s[q]) < base) {
        if (__builtin_mul_overflow(value, int64_t(base), &value) ||
            __builtin_add_overflow(value, int64_t(digit_value(s[q])), &value))
          throw TemplateError("integer literal too large");
        p = q + 1;
      } else {
        break;
      }
    }
    return p == start ? std::string::npos : p;
  };
  if (s[pos] == '0' && pos + 1 < s.size()) {
    char b = s[pos + 1] | 0x20;
    int base = b == 'b' ? 2 : b == 'o' ? 8 : b == 'x' ? 16 : 0;
    if (base) {
      size_t e = scan_base(pos + 2, base);
      if (e != std::string::npos) return e;
    }
  }
  if (s[pos] >= '1' && s[pos] <= '9') return scan_base(pos, 10);
  if (s[pos] == '0') {
    size_t p = pos + 1;
    while (p < s.size()) {
      size_t q = p + (s[p] == '_' ? 1 : 0);
      if (q < s.size() && s[q] == '0') {
        p = q + 1;
      } else {
        break;
      }
    }
    value = 0;
    return p;
  }
  return std::string::npos;
}

// The body of a string literal, decoded like Python's "unicode-escape" codec (which is how
// jinja2 decodes it).
std::string decode_string(const std::string& body, int line) {
  std::string out;
  for (size_t k = 0; k < body.size(); ++k) {
    char c = body[k];
    if (c != '\\' || k + 1 >= body.size()) {
      out += c;
      continue;
    }
    char e = body[++k];
    auto hex = [&](int n) -> char32_t {
      char32_t v = 0;
      for (int d = 0; d < n; ++d) {
        size_t idx = k + 1 + d;
        char h = idx < body.size() ? body[idx] : 0;
        int dv = is_digit(h) ? h - '0' : (h | 0x20) >= 'a' && (h | 0x20) <= 'f' ? (h | 0x20) - 'a' + 10 : -1;
        if (dv < 0) throw TemplateError(fmt::format("truncated \\{}{} escape in string literal", e, std::string(n, 'X')), line);
        v = v * 16 + dv;
      }
      k += n;
      return v;
    };
    switch (e) {
      case '\n': break;  // line continuation
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'v': out += '\v'; break;
      case 'x': utf8_append(out, hex(2)); break;
      case 'u': utf8_append(out, hex(4)); break;
      case 'U': {
        char32_t v = hex(8);
        if (v > 0x10ffff) throw TemplateError("illegal Unicode character in string literal", line);
        utf8_append(out, v);
        break;
      }
      case 'N': throw TemplateError("unsupported \\N{...} escape in string literal", line);
      default:
        if (e >= '0' && e <= '7') {
          char32_t v = e - '0';
          for (int d = 0; d < 2 && k + 1 < body.size() && body[k + 1] >= '0' && body[k + 1] <= '7'; ++d)
            v = v * 8 + (body[++k] - '0');
          utf8_append(out, v);
        } else if (static_cast<unsigned char>(e) >= 0x80) {
          throw TemplateError("unsupported backslash before a non-ASCII character in string literal", line);
        } else {
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

const char* const kOperators[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[", "]",
                                  "(",  ")",  "{",  "}",  ">",  "<",  "=", ".", ":", "|", ",", ";"};

}  // namespace

std::vector<Token> tokenize(std::string_view raw) {
  std::string src;
  src.reserve(raw.size());
  for (size_t k = 0; k < raw.size(); ++k) {
    if (raw[k] == '\r') {
      src += '\n';
      if (k + 1 < raw.size() && raw[k + 1] == '\n') ++k;
    } else {
      src += raw[k];
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();  // keep_trailing_newline=False

  std::vector<Token> tokens;
  auto emit = [&](Tok type, std::string value, int line) {
    Token t;
    t.type = type;
    t.value = std::move(value);
    t.line = line;
    tokens.push_back(std::move(t));
  };

  const size_t n = src.size();
  size_t pos = 0;
  int line = 1;
  bool line_starting = true;
  while (pos < n) {
    size_t tag = pos;
    while ((tag = src.find('{', tag)) != std::string::npos) {
      if (tag + 1 < n && (src[tag + 1] == '{' || src[tag + 1] == '%' || src[tag + 1] == '#')) break;
      ++tag;
    }
    if (tag == std::string::npos) {
      emit(Tok::Data, src.substr(pos), line);
      break;
    }
    const char kind = src[tag + 1];
    size_t after = tag + 2;
    char sign = 0;
    if (after < n && (src[after] == '-' || src[after] == '+')) sign = src[after++];

    // {% raw %} is matched as one unit, before the plain block start.
    bool raw_block = false;
    if (kind == '%') {
      size_t q = skip_spaces(src, after);
      if (src.compare(q, 3, "raw") == 0) {
        q = skip_spaces(src, q + 3);
        if (src.compare(q, 3, "-%}") == 0) {
          after = skip_spaces(src, q + 3);
          raw_block = true;
        } else if (src.compare(q, 2, "%}") == 0) {
          after = q + 2;
          raw_block = true;
        }
      }
    }

    std::string text = src.substr(pos, tag - pos);
    const int text_newlines = count_newlines(text, 0, text.size());
    if (sign == '-') {
      text = rstrip_text(text);
    } else if (sign != '+' && kind != '{') {
      size_t l_pos = text.rfind('\n');
      l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
      if ((l_pos > 0 || line_starting) && l_pos < text.size() && skip_spaces(text, l_pos) == text.size())
        text.resize(l_pos);
    }
    if (!text.empty()) emit(Tok::Data, std::move(text), line);
    line += text_newlines;
    const int tag_line = line;
    line += count_newlines(src, tag, after);
    line_starting = src[after - 1] == '\n';
    pos = after;

    if (raw_block) {
      // Body up to {%[-+]? endraw [-+]?%}, with the same strip rules as any data.
      size_t q = pos;
      size_t body_end = std::string::npos, end_pos = 0;
      char end_sign = 0;
      while ((q = src.find("{%", q)) != std::string::npos) {
        size_t r = q + 2;
        char s = 0;
        if (r < n && (src[r] == '-' || src[r] == '+')) s = src[r++];
        r = skip_spaces(src, r);
        if (src.compare(r, 6, "endraw") == 0) {
          r = skip_spaces(src, r + 6);
          if (src.compare(r, 3, "+%}") == 0) {
            end_pos = r + 3;
          } else if (src.compare(r, 3, "-%}") == 0) {
            end_pos = skip_spaces(src, r + 3);
          } else if (src.compare(r, 2, "%}") == 0) {
            end_pos = r + 2;
            if (end_pos < n && src[end_pos] == '\n') ++end_pos;
          }
          if (end_pos) {
            body_end = q;
            end_sign = s;
            break;
          }
        }
        ++q;
      }
      if (body_end == std::string::npos) throw TemplateError("Missing end of raw directive", tag_line);
      std::string body = src.substr(pos, body_end - pos);
      if (end_sign == '-') {
        body = rstrip_text(body);
      } else if (end_sign != '+') {
        size_t l_pos = body.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if ((l_pos > 0 || line_starting) && l_pos < body.size() && skip_spaces(body, l_pos) == body.size())
          body.resize(l_pos);
      }
      if (!body.empty()) emit(Tok::Data, body, line);
      line += count_newlines(src, pos, end_pos);
      line_starting = src[end_pos - 1] == '\n';
      pos = end_pos;
      continue;
    }

    if (kind == '#') {
      size_t q = src.find("#}", pos);
      if (q == std::string::npos) throw TemplateError("Missing end of comment tag", tag_line);
      size_t end = q + 2;
      char s = (q > pos && (src[q - 1] == '-' || src[q - 1] == '+')) ? src[q - 1] : 0;
      if (s == '-') {
        end = skip_spaces(src, end);
      } else if (s == 0 && end < n && src[end] == '\n') {
        ++end;
      }
      line += count_newlines(src, pos, end);
      line_starting = src[end - 1] == '\n';
      pos = end;
      continue;
    }

    const bool block = kind == '%';
    emit(block ? Tok::BlockBegin : Tok::VarBegin, "", tag_line);
    std::vector<char> balance;
    while (true) {
      if (pos >= n) throw TemplateError(fmt::format("unexpected end of template, expected '{}'", block ? "%}" : "}}"), line);
      if (balance.empty()) {
        size_t end = 0;
        if (block) {
          if (src.compare(pos, 3, "+%}") == 0) {
            end = pos + 3;
          } else if (src.compare(pos, 3, "-%}") == 0) {
            end = skip_spaces(src, pos + 3);
          } else if (src.compare(pos, 2, "%}") == 0) {
            end = pos + 2;
            if (end < n && src[end] == '\n') ++end;  // trim_blocks
          }
        } else {
          if (src.compare(pos, 3, "-}}") == 0) {
            end = skip_spaces(src, pos + 3);
          } else if (src.compare(pos, 2, "}}") == 0) {
            end = pos + 2;
          }
        }
        if (end) {
          emit(block ? Tok::BlockEnd : Tok::VarEnd, "", line);
          line += count_newlines(src, pos, end);
          line_starting = src[end - 1] == '\n';
          pos = end;
          break;
        }
      }
      if (size_t ws = skip_spaces(src, pos); ws != pos) {
        line += count_newlines(src, pos, ws);
        pos = ws;
        continue;
      }
      const char c = src[pos];
      if (is_digit(c)) {
        size_t e = scan_float(src, pos);
        if (e != std::string::npos) {
          std::string text_num;
          for (size_t k = pos; k < e; ++k)
            if (src[k] != '_') text_num += src[k];
          Token t;
          t.type = Tok::Float;
          t.value = text_num;
          t.fval = std::strtod(text_num.c_str(), nullptr);
          t.line = line;
          tokens.push_back(t);
          pos = e;
          continue;
        }
        int64_t v = 0;
        e = scan_integer(src, pos, v);
        if (e != std::string::npos) {
          Token t;
          t.type = Tok::Integer;
          t.value = src.substr(pos, e - pos);
          t.ival = v;
          t.line = line;
          tokens.push_back(t);
          pos = e;
          continue;
        }
      }
      if (is_name_start(c)) {
        size_t e = pos;
        while (e < n && is_name_char(src[e])) ++e;
        emit(Tok::Name, src.substr(pos, e - pos), line);
        pos = e;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t e = pos + 1;
        while (e < n && src[e] != c) e += src[e] == '\\' ? 2 : 1;
        if (e >= n) throw TemplateError("unterminated string literal", line);
        emit(Tok::String, decode_string(src.substr(pos + 1, e - pos - 1), line), line);
        line += count_newlines(src, pos, e);
        pos = e + 1;
        continue;
      }
      const char* op = nullptr;
      for (const char* candidate : kOperators) {
        if (src.compare(pos, std::strlen(candidate), candidate) == 0) {
          op = candidate;
          break;
        }
      }
      if (!op) throw TemplateError(fmt::format("unexpected char '{}'", c), line);
      char o = op[0];
      if (op[1] == 0 && (o == '(' || o == '[' || o == '{')) {
        balance.push_back(o == '(' ? ')' : o == '[' ? ']' : '}');
      } else if (op[1] == 0 && (o == ')' || o == ']' || o == '}')) {
        if (balance.empty()) throw TemplateError(fmt::format("unexpected '{}'", o), line);
        if (balance.back() != o) throw TemplateError(fmt::format("unexpected '{}', expected '{}'", o, balance.back()), line);
        balance.pop_back();
      }
      emit(Tok::Op, op, line);
      pos += std::strlen(op);
    }
  }
  Token eof;
  eof.type = Tok::Eof;
  eof.line = line;
  tokens.push_back(eof);
  return tokens;
}

}  // namespace turbospark::chat_template_detail
