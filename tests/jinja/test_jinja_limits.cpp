// The Jinja engine's bounds (lora_trainer/jinja/limits.hpp): a template that loops, recurses or
// grows a string, a list or its output without end stops with a TemplateError naming the template, the
// line, the limit and how to raise it, in about a second, instead of running until killed; a raised
// limit lets it render. Values nested past any bound (a context variable, a list built around itself)
// are errors or are freed, never a stack overflow; 64-bit integer arithmetic that Python would take into
// big integers is an error, not a wrapped number or a trap.
#include "catch.hpp"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/jinja/jinja.hpp"

using lt::test::Contains;
using ojson = nlohmann::ordered_json;

namespace {

struct Outcome {
  bool rendered = false;
  std::string text, error, limit;
};

Outcome run(const std::string& src, const lt::jinja::Limits& limits = {}, const ojson& ctx = ojson::object()) {
  Outcome o;
  try {
    lt::jinja::Template t(src, "my_template");
    lt::jinja::RenderOptions options;
    options.limits = limits;
    o.text = t.render(ctx, nullptr, options).text;
    o.rendered = true;
  } catch (const lt::jinja::TemplateError& e) {
    o.error = e.what();
    o.limit = e.limit;
  }
  return o;
}

}  // namespace

TEST_CASE("Jinja: a render's work, output, strings, lists and macro depth are bounded, each limit named", "[jinja]") {
  // Each on line 3, so that the line is checked too; the limit that stops it, or "" for another error.
  // Under limits lower than the defaults (steps 2,000,000, strings of 4 MiB, lists of 100,000), to keep
  // the test short; the defaults stop the first one too.
  const std::vector<std::pair<std::string, std::string>> bombs = {
      {"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"},
      {"{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}x{% endfor %}{% endfor %}{% endfor %}", "steps"},
      {"{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}", "steps"},
      {"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "depth"},
      {"{% macro a(n) %}{{ b(n) }}{% endmacro %}{% macro b(n) %}{{ a(n) }}{% endmacro %}{{ a(0) }}", "depth"},
      {"{{ 'x' * 10**12 }}", "string"},
      {"{{ ['x'] * 10**12 }}", "list"},
      {"{{ [1] * 10**6 }}", "list"},
      {"{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "string"},
      {"{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "string"},
      {"{{ ('x' * 100000)|center(10**12) }}", "string"},
      {"{{ ('x' * 100000)|indent(10**12, true) }}", "string"},
      {"{{ (['xxxxxxxxxx'] * 10000)|join('y' * 10000) }}", "string"},
      {"{{ 'y'.join(['x' * 100000] * 100000) }}", "string"},
      {"{{ ('x' * 1000000)|replace('x', 'yyyyyyyyyyyyyyyyyyyy') }}", "string"},
      {"{{ ('x' * 1000000).replace('', 'yyyyyyyyyyyyyyyyyyyy') }}", "string"},
      {"{{ ('{0}' * 1000).format('x' * 100000) }}", "string"},
      {"{% set a = ['x' * 1000] * 100 %}{% set b = [a] * 100 %}{% set c = [b] * 100 %}{{ c }}", "string"},
      {"{% set a = ['x' * 1000] * 100 %}{% set b = [a] * 100 %}{% set c = [b] * 100 %}{{ c|tojson(indent=2) }}", "string"},
      {"{{ ('ab' * 1000000).split('b') }}", "list"},
      {"{{ ('x' * 1000000)|list }}", "list"},
      {"{% set s = 'x' * 3000000 %}{% for i in range(100000) %}{% if 'y' in s %}{% endif %}{% endfor %}", "steps"},
      {"{% set s = 'x' * 3000000 %}{% for i in range(100000) %}{{ s|length }}{% endfor %}", "steps"},
      {"{% set l = range(100000)|list %}{% for i in range(100000) %}{% if -1 in l %}{% endif %}{% endfor %}", "steps"},
      {"{% set l = range(100000)|list %}{% for i in range(100000) %}{{ l|first }}{% endfor %}", "steps"},
      {"{{ (range(100000)|list)|unique|length }}", "steps"},
      {"{% for i in range(100000) %}{% for j in range(100000) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}{% endfor %}{% endfor %}", "steps"},
      {"{{ range(10**12)|length }}", ""},  // jinja2's sandbox allows 100,000 items
      {"{{ 2 ** 4000000000000000000 }}", ""},
      {"{{ 9223372036854775807 + 1 }}", ""},
  };
  lt::jinja::Limits quick;
  quick.steps = 2000000;
  quick.string = 1 << 22;
  quick.list = 100000;
  for (const auto& [bomb, limit] : bombs) {
    INFO(bomb);
    const Outcome o = run("a\nb\n" + bomb, quick);
    REQUIRE_FALSE(o.rendered);
    CHECK(o.limit == limit);
    CHECK_THAT(o.error, Contains("my_template line 3: "));
    if (!limit.empty()) CHECK_THAT(o.error, Contains("the limit " + limit) && Contains("--chat-limit " + limit + "=N"));
  }
  for (const size_t k : {0, 5, 13}) CHECK(run(bombs[k].first).limit == bombs[k].second);  // and with every default
  // The output: a loop that prints, past a limit given lower than its default (256 MiB).
  lt::jinja::Limits small;
  small.output = 1 << 20;
  const Outcome o = run("{% for i in range(100000) %}\n{{ 'x' * 1000 }}{% endfor %}", small);
  CHECK(o.limit == "output");
  CHECK_THAT(o.error, Contains("my_template line 2: the rendered text is longer than the limit output (1048576 bytes)") &&
                          Contains("--chat-limit output=N"));
  // ...and the text a {% set %} block or a macro writes aside counts against it too.
  CHECK(run("{% set x %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endset %}", small).limit == "output");
  CHECK(run("{% macro m() %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endmacro %}{{ m() }}", small).limit == "output");
}

TEST_CASE("Jinja: a raised limit lets a template render that its default stops", "[jinja]") {
  const std::string loop = "{% for i in range(3000) %}{{ i }}{% endfor %}";
  lt::jinja::Limits limits;
  limits.steps = 1000;
  CHECK(run(loop, limits).limit == "steps");
  limits.set("steps=1000000");
  CHECK(run(loop, limits).rendered);

  const std::string deep = "{% macro f(n) %}{% if n < 250 %}{{ f(n + 1) }}{% else %}{{ n }}{% endif %}{% endmacro %}{{ f(0) }}";
  CHECK(run(deep).limit == "depth");  // 200 by default: jinja2 itself stops near 190
  limits.set("depth=300");
  CHECK(run(deep, limits).text == "250");

  const std::string big = "{{ ('x' * 70000000)|length }}";
  CHECK(run(big).limit == "string");
  lt::jinja::Limits more;
  more.set("string=80000000");
  CHECK(run(big, more).text == "70000000");
  CHECK(run("{{ ([0] * 2000000)|length }}").limit == "list");
  more.set("list=3000000");
  CHECK(run("{{ ([0] * 2000000)|length }}", more).text == "2000000");

  // NAME=N, a positive integer; anything else names the option and the names.
  for (const std::string bad : {"steps", "steps=", "steps=-1", "steps=0", "steps=1e9", "steps=99999999999999999999", "time=5", "=5"})
    CHECK_THROWS_WITH(limits.set(bad), Contains("--chat-limit " + bad) && (Contains("steps, output, string, list, depth") ||
                                                                          Contains("positive integer")));
}

TEST_CASE("Jinja: recursion past the stack and values nested past any bound are errors, never a crash", "[jinja]") {
  // A macro raised past its depth whose every level nests expressions: stopped by the stack guard.
  const std::string nested = std::string(150, '[') + "f(n + 1)" + std::string(150, ']');
  lt::jinja::Limits limits;
  limits.depth = 1000000;
  limits.steps = 1000000000;
  const Outcome o = run("{% macro f(n) %}{{ (" + nested + ")|length }}{% endmacro %}\n{{ f(0) }}", limits);
  CHECK(o.limit == "stack");
  CHECK_THAT(o.error, Contains("my_template line 1") && Contains("deeper than the stack allows"));

  // A context value nested 100,000 deep (nlohmann builds it without recursion) is refused where the
  // engine reads it, naming the variable.
  ojson deep = ojson::array();
  for (int i = 0; i < 600; ++i) deep = ojson::array({std::move(deep)});
  const Outcome v = run("{{ x }}", {}, ojson{{"x", deep}});
  CHECK_THAT(v.error, Contains("my_template: the variable 'x'") && Contains("nested more than 512 levels deep"));
  ojson fine = ojson::array();
  for (int i = 0; i < 500; ++i) fine = ojson::array({std::move(fine)});
  CHECK(run("{{ x|length }}", {}, ojson{{"x", fine}}).text == "1");

  // A list built around itself 100,000 times is freed a level at a time; a namespace holding itself is
  // emptied at the end of the render (no leak for LeakSanitizer to find).
  CHECK(run("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}done").text == "done");
  CHECK(run("{% set ns = namespace() %}{% set ns.me = ns %}{% set ns.l = [ns, ns] %}{{ ns.me.me.l|length }}").text == "2");

  // 64-bit integers: Python's would grow; this engine's stop with an error (and never trap).
  for (const std::string e : {"9223372036854775807 + 1", "-9223372036854775807 - 2", "4611686018427387904 * 2", "2 ** 63",
                              "(-9223372036854775807 - 1) // -1", "-(-9223372036854775807 - 1)", "(1e300)|int",
                              "'99999999999999999999'|int", "(-9223372036854775807 - 1)|abs", "'%d' % 1e300"}) {
    INFO(e);
    CHECK_THAT(run("{{ " + e + " }}").error, Contains("my_template line 1") && (Contains("64 bit") || Contains("64-bit")));
  }
  CHECK(run("{{ 2 ** 62 }}|{{ (-2) ** 63 }}|{{ (-9223372036854775807 - 1) % -1 }}|{{ (-9223372036854775807 - 1) is divisibleby(-1) }}")
            .text == "4611686018427387904|-9223372036854775808|0|True");
  CHECK(run("{{ range(0, 10, 4611686018427387904)|list }}|{{ range(-9223372036854775807 - 1, 9223372036854775807, "
            "4611686018427387904)|list|length }}|{{ [1, 2, 3][::-9223372036854775807 - 1] }}")
            .text == "[0]|4|[3]");
}
