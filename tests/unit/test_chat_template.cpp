// Chat-template interpreter: real templates against goldens rendered by Python jinja2 in
// transformers' configuration (tools/chat_templates/make_goldens.py), then the language
// corners those templates lean on, then the refusals. Every expected string in the second
// part was produced by jinja2 3.1.6 with the same configuration.
#include <ctime>

#include "core/error.h"
#include "formats/chat_template.h"
#include "test_util.h"

namespace turbospark {
namespace {

using nlohmann::ordered_json;

std::string data_dir() { return testing::source_dir() + "/tests/data/chat_templates/"; }

std::string render(const std::string& source, const std::string& context_json = "{}") {
  return ChatTemplate::parse(source, "test").render(ordered_json::parse(context_json));
}

// The turbospark::Error message a template produces, or "" when it renders.
std::string error_of(const std::string& source, const std::string& context_json = "{}") {
  try {
    render(source, context_json);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<ChatMessage> to_messages(const ordered_json& list) {
  std::vector<ChatMessage> out;
  for (const auto& m : list) {
    ChatMessage msg;
    for (auto it = m.begin(); it != m.end(); ++it) {
      if (it.key() == "role") {
        msg.role = it.value().get<std::string>();
      } else if (it.key() == "content" && it.value().is_string()) {
        msg.content = it.value().get<std::string>();
      } else {
        msg.fields[it.key()] = it.value();
      }
    }
    out.push_back(std::move(msg));
  }
  return out;
}

std::string today(const std::string& format) {
  std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[64];
  return std::string(buf, std::strftime(buf, sizeof buf, format.c_str(), &local));
}

// ---------------------------------------------------------------------------------------------
// Real templates: byte-identical to jinja2.

TEST(ChatTemplateGolden, RealTemplatesMatchJinja2) {
  const ordered_json goldens = ordered_json::parse(read_text_file(data_dir() + "goldens.json"));
  ASSERT_EQ(goldens["jinja2_version"], "3.1.6");
  const std::string marker = goldens["strftime_marker"]["marker"];
  const std::string date = today(goldens["strftime_marker"]["format"]);

  std::map<std::string, ChatTemplate> templates;
  for (auto it = goldens["templates"].begin(); it != goldens["templates"].end(); ++it) {
    templates.emplace(it.key(),
                      ChatTemplate::parse(read_text_file(data_dir() + it.value()["file"].get<std::string>()), it.key()));
  }
  std::map<std::string, int> passed;
  int cases = 0;
  for (const auto& c : goldens["cases"]) {
    const std::string name = c["template"];
    SCOPED_TRACE(name + " / " + c["conversation"].get<std::string>() +
                 (c["add_generation_prompt"].get<bool>() ? " / generation prompt" : ""));
    ++cases;
    auto messages = to_messages(goldens["conversations"][c["conversation"].get<std::string>()]);
    const ChatTemplate& t = templates.at(name);
    if (c.contains("expected_error")) {
      try {
        apply_chat_template(t, messages, c["add_generation_prompt"], c["extra"]);
        ADD_FAILURE() << "rendered, but jinja2 raised: " << c["expected_error"];
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(c["expected_error"].get<std::string>()), std::string::npos) << e.what();
        ++passed[name];
      }
      continue;
    }
    std::string expected = c["expected"];
    for (size_t p; (p = expected.find(marker)) != std::string::npos;) expected.replace(p, marker.size(), date);
    const std::string got = apply_chat_template(t, messages, c["add_generation_prompt"], c["extra"]);
    EXPECT_EQ(got, expected);
    if (got == expected) ++passed[name];
  }
  EXPECT_GE(cases, 50);
  for (const auto& [name, t] : templates) EXPECT_GE(passed[name], 3) << name;
}

TEST(ChatTemplateGolden, ContextLikeTransformers) {
  ordered_json ctx = chat_template_context({{"user", "hi", {}}}, true, {{"bos_token", "<s>"}});
  EXPECT_EQ(ctx.dump(), R"({"messages":[{"role":"user","content":"hi"}],"tools":null,"documents":null,)"
                        R"("add_generation_prompt":true,"bos_token":"<s>"})");
  // A tool-call turn with null content and ordered arguments.
  ChatMessage call{"assistant", "", ordered_json::parse(R"({"content": null, "tool_calls": [{"function":
      {"name": "f", "arguments": {"z": 1, "a": "é"}}}]})")};
  const auto t = ChatTemplate::parse(
      "{% for m in messages %}{{ m.content is none }}{{ m.tool_calls[0].function.arguments | tojson }}{% endfor %}",
      "t");
  EXPECT_EQ(apply_chat_template(t, {call}, false), R"(True{"z": 1, "a": "é"})");
}

// ---------------------------------------------------------------------------------------------
// Whitespace control: trim_blocks, lstrip_blocks, "-" and "+" markers.

TEST(ChatTemplateWhitespace, TrimAndLstripBlocks) {
  EXPECT_EQ(render("{% if true %}\n  a\n{% endif %}\nb"), "  a\nb");
  EXPECT_EQ(render("x\n    {% if true %}\ny\n    {% endif %}\nz"), "x\ny\nz");
  EXPECT_EQ(render("  {{ 'v' }}\n"), "  v");       // {{ }} is never lstripped; last newline dropped
  EXPECT_EQ(render("a  {% if true %}b{% endif %}"), "a  b");  // lstrip only at line start
  EXPECT_EQ(render("{# c #}\nx"), "x");
  EXPECT_EQ(render("a\r\nb\rc"), "a\nb\nc");
  EXPECT_EQ(render("a\n\n"), "a\n");
}

TEST(ChatTemplateWhitespace, Markers) {
  EXPECT_EQ(render("a \n {%- if true -%} \n b {%- endif %}"), "ab");
  EXPECT_EQ(render("a\n  {{- 'v' -}}\n  c"), "avc");
  EXPECT_EQ(render("a\n  {%+ if true %}b{% endif +%}\nc"), "a\n  b\nc");
  EXPECT_EQ(render("{{ {'a': {'b': 1}} }}"), "{'a': {'b': 1}}");  // "}}" inside braces is not an end
  EXPECT_EQ(render("{% raw %}{{ x }}{% endraw %}"), "{{ x }}");
}

// ---------------------------------------------------------------------------------------------
// Statements, scoping, loops, macros.

TEST(ChatTemplateStatements, ScopesFollowJinja2) {
  // A set inside a loop body is gone after the loop (and in the next iteration).
  EXPECT_EQ(render("{% set x = 1 %}{% for i in [1,2] %}{{ x }}{% set x = 5 %}{{ x }}{% endfor %}{{ x }}"), "15151");
  EXPECT_EQ(render("{% if true %}{% set y = 2 %}{% endif %}{{ y }}"), "2");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for i in [1,2,3] %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"),
            "6");
  EXPECT_EQ(render("{% macro m() %}{{ y }}{% endmacro %}{% set y = 3 %}{{ m() }}{% set y = 4 %}{{ m() }}"), "34");
  EXPECT_EQ(render("{% set s %}  {{ 1 + 1 }} {% endset %}[{{ s }}]{% set t | upper %}ab{% endset %}{{ t }}"), "[  2 ]AB");
  EXPECT_EQ(render("{% with a = 1 %}{{ a }}{% endwith %}[{{ a }}]"), "1[]");
  EXPECT_EQ(render("{% set a, b = 1, 2 %}{{ b }}{{ a }}"), "21");
}

TEST(ChatTemplateStatements, Loops) {
  EXPECT_EQ(render("{% for x in 'ab' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }}"
                   "{{ loop.length }}{{ loop.cycle('o', 'e') }};{% endfor %}"),
            "102TrueFalse2o;211FalseTrue2e;");
  EXPECT_EQ(render("{% for x in [1,2,3,4] if x != 2 %}{{ x }}{{ loop.last }}{% endfor %}"), "1False3False4True");
  EXPECT_EQ(render("{% for x in [] %}a{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for x in [1,2,3] %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% if x == 3 %}{% break %}"
                   "{% endif %}{% endfor %}"),
            "13");
  EXPECT_EQ(render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", R"({"d": {"z": 1, "a": 2}})"), "z=1;a=2;");
  EXPECT_EQ(render("{% for m in ms[::-1] %}{{ m }}{% endfor %}", R"({"ms": [1, 2, 3]})"), "321");
}

TEST(ChatTemplateStatements, Macros) {
  const std::string m = "{% macro g(name, greeting='Hello', p='!') %}{{ greeting }}, {{ name }}{{ p }}{% endmacro %}";
  EXPECT_EQ(render(m + "{{ g('A') }} {{ g('B', 'Hi') }} {{ g(name='C', p='?') }}"), "Hello, A! Hi, B! Hello, C?");
  EXPECT_EQ(render("{% macro v(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ v(1, 2, k=3) }}"), "1(2,){'k': 3}");
  EXPECT_EQ(render("{% macro r(n) %}{% if n %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(3) }}"), "321");
  EXPECT_NE(error_of("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}").find("takes not more than 1 argument"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Values print as Python prints them.

TEST(ChatTemplateValues, PythonStrAndRepr) {
  EXPECT_EQ(render("{{ 1 }} {{ 1.0 }} {{ 1e20 }} {{ 0.1 + 0.2 }} {{ 1/3 }} {{ 10/2 }} {{ -7//2 }} {{ -7 % 3 }} {{ 2**10 }}"),
            "1 1.0 1e+20 0.30000000000000004 0.3333333333333333 5.0 -4 2 1024");
  EXPECT_EQ(render("{{ [1, 'a', \"b'c\", none, true, 2.5, (1,), {'k': [1]}] }}"),
            "[1, 'a', \"b'c\", None, True, 2.5, (1,), {'k': [1]}]");
  EXPECT_EQ(render("{{ none }} {{ true }} {{ x }} {{ 'a' ~ 1 ~ none ~ x }}"), "None True  a1None");
  EXPECT_EQ(render("{{ d.items() }} {{ d.keys() }}", R"({"d": {"b": 1, "a": null}})"),
            "dict_items([('b', 1), ('a', None)]) dict_keys(['b', 'a'])");
  EXPECT_EQ(render("{{ {1: 'one', 2.0: 'two'}[2] }}{{ {1: 'x'} | tojson }}"), "two{\"1\": \"x\"}");
}

TEST(ChatTemplateValues, ToJsonIsTransformersJsonDumps) {
  const std::string ctx = R"({"d": {"b": 1, "a": [1.5, "é\"\n", null, true]}})";
  EXPECT_EQ(render("{{ d | tojson }}", ctx), R"({"b": 1, "a": [1.5, "é\"\n", null, true]})");
  EXPECT_EQ(render("{{ d | tojson(indent=2) }}", ctx),
            "{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    \"é\\\"\\n\",\n    null,\n    true\n  ]\n}");
  EXPECT_EQ(render("{{ d | tojson(separators=(',', ':'), sort_keys=true) }}", ctx), R"({"a":[1.5,"é\"\n",null,true],"b":1})");
  EXPECT_EQ(render("{{ 'é<>' | tojson(ensure_ascii=true) }}"), R"("\u00e9<>")");
  EXPECT_EQ(render("{{ [] | tojson(indent=4) }}{{ {} | tojson }}"), "[]{}");
}

TEST(ChatTemplateValues, StringMethods) {
  EXPECT_EQ(render("{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ ' a b '.split(none, 1) }} {{ 'a,b,c'.rsplit(',', 1) }}"),
            "['a', 'b', '', 'c'] ['a', 'b'] ['a', 'b '] ['a,b', 'c']");
  EXPECT_EQ(render("[{{ '\\n x \\n'.strip() }}][{{ 'xxaxx'.lstrip('x') }}][{{ 'a\\n\\n'.rstrip('\\n') }}]"), "[x][axx][a]");
  EXPECT_EQ(render("{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}{{ 'a-b'.replace('-', '+') }}"),
            "TrueTruea+b");
  EXPECT_EQ(render("{{ '{} {x}'.format(1, x=2) }} {{ 'hello world'.title() }} {{ 'hELLO' | capitalize }}"), "1 2 Hello World Hello");
  EXPECT_EQ(render("{{ s[:2] }}|{{ s[-1] }}|{{ s | length }}|{{ s[::-1] }}", R"({"s": "日本語"})"), "日本|語|3|語本日");
  EXPECT_EQ(render("{{ d.get('a') }} {{ d.get('z', 'dflt') }} {{ d.get('z') }}", R"({"d": {"a": 1}})"), "1 dflt None");
}

TEST(ChatTemplateValues, Filters) {
  const std::string ms = R"({"ms": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})";
  EXPECT_EQ(render("{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='content') | join(',') }}", ms), "u");
  EXPECT_EQ(render("{{ ms | rejectattr('role', 'eq', 'user') | list | length }}", ms), "1");
  EXPECT_EQ(render("{{ x | default('d') }} {{ none | default('d') }} {{ '' | default('d', true) }}"), "d None d");
  EXPECT_EQ(render("{{ [3, 1, 2] | sort }} {{ ['b', 'A'] | sort }} {{ [1, 2, 1] | unique | list }} {{ [1, 2] | last }}"),
            "[1, 2, 3] ['A', 'b'] [1, 2] 2");
  EXPECT_EQ(render("{{ '42' | int }} {{ '4.7' | int }} {{ 'x' | int }} {{ 2.5 | round }} {{ 2.675 | round(2) }} {{ -3 | abs }}"),
            "42 4 0 2.0 2.67 3");
  EXPECT_EQ(render("{{ '  t  ' | trim }}|{{ 'a\\nb' | indent(2) }}|{{ 'x' | upper }}{{ 'ÀB' | lower }}"), "t|a\n  b|Xàb");
  EXPECT_EQ(render("{{ d | dictsort }} {% for k, v in d | items %}{{ k }}{% endfor %}", R"({"d": {"b": 1, "A": 2}})"),
            "[('A', 2), ('b', 1)] bA");
}

TEST(ChatTemplateValues, UndefinedAndTests) {
  EXPECT_EQ(render("[{{ x }}]{{ x is defined }}{{ x is undefined }}{{ x | length }}{% for i in x %}i{% endfor %}"),
            "[]FalseTrue0");
  EXPECT_EQ(render("{{ n is none }}{{ n.foo is defined }}{{ 'a' is string }}{{ d is mapping }}{{ 1 is number }}"
                   "{{ true is boolean }}{{ [] is iterable }}{{ 3 is odd }}{{ 6 is divisibleby 3 }}",
                   R"({"n": null, "d": {}})"),
            "TrueFalseTrueTrueTrueTrueTrueTrueTrue");
  EXPECT_EQ(render("{{ ms[5] }}{{ d.missing }}{{ 'x' if false }}", R"({"ms": [], "d": {}})"), "");
  EXPECT_EQ(render("{{ 'b' in d }}{{ 'q' not in d }}{{ 'ell' in 'hello' }}{{ 1 in [1] }}", R"({"d": {"b": 0}})"),
            "TrueTrueTrueTrue");
}

TEST(ChatTemplateValues, GeneratorsAndMarkup) {
  // select() returns a generator: always truthy, consumed by the first pass.
  EXPECT_EQ(render("{% set g = [1, 2, 3] | select('odd') %}{% if [] | select %}T{% endif %}{{ g | first }}{{ g | list }}"
                   "{{ g | list }}"),
            "T1[3][]");
  // markupsafe: Markup + str escapes the str.
  EXPECT_EQ(render("{{ 'a'|safe + '<b>' }}|{{ '<x>' | e }}|{{ '<x>' ~ 'y' | safe }}"), "a&lt;b&gt;|&lt;x&gt;|<x>y");
}

// ---------------------------------------------------------------------------------------------
// Errors: unsupported constructs are named with their line; template errors surface.

TEST(ChatTemplateErrors, RaiseException) {
  const std::string e = error_of("{% if messages | length == 0 %}\n{{ raise_exception('No messages provided.') }}{% endif %}",
                                 R"({"messages": []})");
  EXPECT_EQ(e, "chat template test: raise_exception: No messages provided. at line 2");
}

TEST(ChatTemplateErrors, UnsupportedConstructsAreNamed) {
  EXPECT_EQ(error_of("a\nb\n{{ d | xmlattr }}"), "chat template test: unsupported filter 'xmlattr' at line 3");
  EXPECT_EQ(error_of("{{ x | nosuchfilter }}"), "chat template test: unknown filter 'nosuchfilter' at line 1");
  EXPECT_EQ(error_of("\n{% include 'other.jinja' %}"), "chat template test: unsupported tag '{% include %}' at line 2");
  EXPECT_EQ(error_of("{% call m() %}{% endcall %}"), "chat template test: unsupported tag '{% call %}' at line 1");
  EXPECT_EQ(error_of("{{ x is escaped }}"), "chat template test: unsupported test 'escaped' at line 1");
  EXPECT_EQ(error_of("{{ f(*args) }}"), "chat template test: unsupported: '*' argument unpacking in a call at line 1");
  EXPECT_EQ(error_of("{{ '%s' % 1 }}"),
            "chat template test: unsupported: printf-style string formatting with '%' (use ~ or the format filter) at line 1");
  EXPECT_EQ(error_of("{{ 'x'.casefold() }}"), "chat template test: unsupported string method 'casefold' at line 1");
  EXPECT_EQ(error_of("{{ 'ǅ' | upper }}"),
            "chat template test: unsupported: case conversion of U+01C5 (only ASCII, Latin-1, Latin Extended-A, basic Greek "
            "and Cyrillic are mapped) at line 1");
  // Like jinja2, an unknown filter inside an if branch only fails when that branch runs.
  EXPECT_EQ(render("{% if false %}{{ x | from_json }}{% endif %}ok"), "ok");
  EXPECT_EQ(error_of("{% if true %}\n{{ x | from_json }}{% endif %}"), "chat template test: unknown filter 'from_json' at line 2");
}

TEST(ChatTemplateErrors, SyntaxErrorsNameTheLine) {
  EXPECT_EQ(error_of("{% for m in messages %}\n{{ m }}\n"),
            "chat template test: unexpected end of template, expected 'else' or 'endfor' to close the 'for' from line 1 "
            "at line 2");
  EXPECT_EQ(error_of("ok\n{{ a + }}"), "chat template test: unexpected '}}' at line 2");
  EXPECT_EQ(error_of("{% endif %}"), "chat template test: unknown tag 'endif' at line 1");
  EXPECT_EQ(error_of("{% break %}"), "chat template test: 'break' outside of a for loop at line 1");
  EXPECT_EQ(error_of("{# open comment"), "chat template test: Missing end of comment tag at line 1");
  EXPECT_EQ(error_of("{{ 'abc }}"), "chat template test: unterminated string literal at line 1");
}

TEST(ChatTemplateErrors, RuntimeErrorsLikeJinja2) {
  EXPECT_EQ(error_of("\n{{ x.y }}"), "chat template test: 'x' is undefined at line 2");
  EXPECT_EQ(error_of("{{ 'a' + 1 }}"), "chat template test: can only concatenate str (not \"int\") to str at line 1");
  EXPECT_EQ(render("[{{ m.content.z }}]", R"({"m": {"content": null}})"), "[]");  // None.z is undefined...
  EXPECT_EQ(error_of("{{ m.content.z.w }}", R"({"m": {"content": null}})"),  // ...and using it raises
            "chat template test: 'None' has no attribute 'z' at line 1");
  EXPECT_EQ(error_of("{% set l = [] %}{{ l.append(1) }}"),
            "chat template test: access to attribute 'append' of 'list' object is unsafe. at line 1");
  EXPECT_EQ(error_of("{{ x | tojson }}"), "chat template test: Object of type Undefined is not JSON serializable at line 1");
}

TEST(ChatTemplateApi, JsonOverloadAndReuse) {
  const auto t = ChatTemplate::parse("{{ a }}-{{ b | default(1) }}", "t");
  EXPECT_EQ(t.render(nlohmann::json{{"a", 1}}), "1-1");
  EXPECT_EQ(t.render(ordered_json{{"a", "x"}, {"b", 2}}), "x-2");
  EXPECT_EQ(t.name(), "t");
}

}  // namespace
}  // namespace turbospark

namespace turbospark {
namespace {

// Templates come inside model files from strangers: what they may build is bounded, so that
// parsing, rendering and freeing one never overflows the stack (libFuzzer found
// '{{ - - - ... }}' of ~1300 operators doing so; tests/fuzz/regressions/chat_template/), and
// each limit is named in the error. Real templates stay far inside them.
TEST(ChatTemplateLimits, DeepOrHugeTemplatesAreRefusedByName) {
  std::string unary = "{{ ";
  for (int i = 0; i < 100000; ++i) unary += "- ";  // without the bound: a stack overflow
  EXPECT_NE(error_of(unary + "1 }}").find("nesting deeper than 100 levels"), std::string::npos);
  std::string parens = "{{ " + std::string(300, '(') + "1" + std::string(300, ')') + " }}";
  EXPECT_NE(error_of(parens).find("nesting deeper than 100 levels"), std::string::npos);
  std::string nots = "{{ ";
  for (int i = 0; i < 500; ++i) nots += "not ";
  EXPECT_NE(error_of(nots + "x }}").find("nesting deeper than 100 levels"), std::string::npos);
  std::string sum = "{{ 1";
  for (int i = 0; i < 3000; ++i) sum += " + 1";
  EXPECT_NE(error_of(sum + " }}").find("more than 1024 expression nodes"), std::string::npos);
  std::string ifs;
  for (int i = 0; i < 300; ++i) ifs += "{% if true %}";
  EXPECT_NE(error_of(ifs + "x").find("nesting deeper than 100 levels"), std::string::npos);
  // Deep recursion through macros and expressions together: bounded at evaluation.
  EXPECT_NE(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").find("recursion depth"),
            std::string::npos);
  // Inside the limits, all of these render.
  std::string ok = "{{ 1";
  for (int i = 0; i < 300; ++i) ok += " + 1";
  EXPECT_EQ(render(ok + " }}"), "301");
  EXPECT_EQ(render("{{ " + std::string(20, '(') + "7" + std::string(20, ')') + " }}"), "7");
}

// What a template builds is bounded too (a template comes inside a downloaded GGUF): loop
// iterations over the whole render, the output and any string, lists; refused by name, before
// the memory is taken or the time spent.
// Integer powers by squaring: exponents of billions with a base of 0 or +-1 (which never
// overflow) answer at once (a loop of e multiplications took minutes: fuzz_chat_template's slow
// unit, now a regression input), and overflow is still refused exactly where Python's result
// leaves 64 bits.
TEST(ChatTemplateLimits, IntegerPowersTakeLogarithmicTime) {
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(render("{{ 0 ** 50111101012 }}"), "0");
  EXPECT_EQ(render("{{ 1 ** 9223372036854775807 }}"), "1");
  EXPECT_EQ(render("{{ (-1) ** 9223372036854775807 }}"), "-1");
  EXPECT_EQ(render("{{ (-1) ** 9223372036854775806 }}"), "1");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  EXPECT_EQ(render("{{ 3 ** 5 }} {{ 2 ** 0 }} {{ 0 ** 0 }} {{ 7 ** 1 }}"), "243 1 1 7");
  EXPECT_EQ(render("{{ 2 ** 62 }}"), "4611686018427387904");
  EXPECT_EQ(render("{{ (-2) ** 63 }}"), "-9223372036854775808");
  EXPECT_NE(error_of("{{ 2 ** 63 }}").find("integer overflow"), std::string::npos);
  EXPECT_NE(error_of("{{ 3 ** 40 }}").find("integer overflow"), std::string::npos);
  EXPECT_NE(error_of("{{ 10 ** 1000000000000 }}").find("integer overflow"), std::string::npos);
}

TEST(ChatTemplateLimits, RunawayOutputLoopsAndValuesAreRefusedByName) {
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(error_of("{% for i in range(2000) %}{% for j in range(2000) %}{% endfor %}{% endfor %}")
                .find("more than 1000000 loop iterations"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 'x' * 1000000000000 }}").find("larger than the limit of 16 MiB"), std::string::npos);
  EXPECT_NE(error_of("{{ [1, 2] * 1000000000000 }}").find("longer than the limit of 1048576 items"), std::string::npos);
  EXPECT_NE(error_of("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}")
                .find("larger than the limit of 16 MiB"),
            std::string::npos);
  EXPECT_NE(error_of("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}")
                .find("larger than the limit of 16 MiB"),
            std::string::npos);
  EXPECT_NE(error_of("{% for i in range(99999) %}{{ 'y' * 1000 }}{% endfor %}").find("larger than the limit of 16 MiB"),
            std::string::npos);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  // Inside the limits these render.
  EXPECT_EQ(render("{{ ('ab' * 3) ~ ([1] * 2)|length }}"), "ababab2");
  EXPECT_EQ(render("[{{ '' * 1000000000000 }}{{ ([] * 1000000000000)|length }}]"), "[0]");
  EXPECT_EQ(render("{% for i in range(1000) %}{% for j in range(999) %}{% endfor %}{% endfor %}ok"), "ok");
}

}  // namespace
}  // namespace turbospark
