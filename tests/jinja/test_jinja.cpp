// The Jinja engine (lora_trainer/jinja/jinja.hpp) renders as Python's jinja2 does in transformers'
// apply_chat_template environment: byte for byte on 12 chat templates (11 of real models, one with
// {% generation %}) x 60 conversations, the spans of {% generation %} blocks, the templates' own
// raise_exception messages, and ~90 one-line probes of printing, arithmetic, filters, tests, methods,
// loops and whitespace control. The expected renders were made with jinja2 by scripts/jinja_golden.py
// (tests/data/chat_templates/). Errors name the template and the line.
#include "catch.hpp"

#include <nlohmann/json.hpp>
#include <zlib.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/jinja/jinja.hpp"

using lt::test::Contains;
using ojson = nlohmann::ordered_json;

namespace {

const std::string kDir = "tests/data/chat_templates/";

std::vector<ojson> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in);
  std::vector<ojson> rows;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) rows.push_back(ojson::parse(line));
  return rows;
}

std::string render(const lt::jinja::Template& t, const ojson& ctx) {
  return t.render(ctx, [](const std::string&) { return std::string("26 Nov 2026"); }).text;
}

// Compares a render with a golden row: {"bytes", "crc32", "generation"} or {"error": message|null}.
void check_row(const lt::jinja::Template& t, const ojson& ctx, const ojson& want) {
  if (want.contains("error")) {
    try {
      render(t, ctx);
      FAIL("rendered, but jinja2 raised an error");
    } catch (const lt::jinja::TemplateError& e) {
      if (!want["error"].is_null()) {
        CHECK(e.raised);
        CHECK(e.message == want["error"].get<std::string>());
      }
    }
    return;
  }
  const lt::jinja::Rendered r = t.render(ctx, [](const std::string&) { return std::string("26 Nov 2026"); });
  const auto crc = crc32(0L, reinterpret_cast<const Bytef*>(r.text.data()), static_cast<uInt>(r.text.size()));
  CHECK(r.text.size() == want["bytes"].get<size_t>());
  CHECK(crc == want["crc32"].get<uint64_t>());
  std::vector<std::pair<size_t, size_t>> spans;
  for (const auto& s : want["generation"]) spans.emplace_back(s[0].get<size_t>(), s[1].get<size_t>());
  CHECK(r.generation == spans);
}

}  // namespace

TEST_CASE("Jinja renders real chat templates byte for byte as jinja2 does (transformers' environment)", "[jinja]") {
  const auto conversations = read_jsonl(kDir + "conversations.jsonl");
  const auto golden = read_jsonl(kDir + "golden.jsonl");
  const ojson special = ojson::parse(lt::read_file(kDir + "special_tokens.json"));
  REQUIRE(conversations.size() >= 50);
  std::map<std::string, lt::jinja::Template> templates;
  std::map<std::string, int> rendered;
  for (const auto& g : golden) {
    const std::string name = g["template"];
    if (!templates.count(name)) templates.emplace(name, lt::jinja::Template(lt::read_file(kDir + name + ".jinja"), name));
    ojson ctx = conversations.at(g["conversation"].get<size_t>());
    if (special.contains(name))
      for (auto it = special[name].begin(); it != special[name].end(); ++it) ctx[it.key()] = it.value();
    INFO(name << " x conversation " << g["conversation"]);
    check_row(templates.at(name), ctx, g);
    if (!g.contains("error")) ++rendered[name];
  }
  CHECK(templates.size() == 12);
  for (const auto& [name, n] : rendered) {
    INFO(name);
    CHECK(n >= 40);  // most conversations render; the rest exercise the templates' own checks
  }
}

TEST_CASE("Jinja probes: printing, arithmetic, filters, tests, methods, loops and whitespace as jinja2", "[jinja]") {
  const ojson ctx = ojson::parse(lt::read_file(kDir + "probe_context.json"));
  const auto probes = read_jsonl(kDir + "probes.jsonl");
  REQUIRE(probes.size() > 80);
  for (const auto& p : probes) {
    const std::string src = p["template"];
    INFO("template: " << src);
    if (p.contains("error") && p["error"].is_null()) {  // jinja2 refused it (syntax, undefined, type)
      CHECK_THROWS_AS([&] { lt::jinja::Template t(src, "probe"); render(t, ctx); }(), lt::jinja::TemplateError);
      continue;
    }
    lt::jinja::Template t(src, "probe");
    if (p.contains("error")) {
      check_row(t, ctx, p);
      continue;
    }
    const lt::jinja::Rendered r = t.render(ctx, [](const std::string&) { return std::string("26 Nov 2026"); });
    CHECK(r.text == p["text"].get<std::string>());
    CHECK(r.generation.size() == p["generation"].size());
  }
}

TEST_CASE("Jinja errors name the template and the line, and what was wrong", "[jinja]") {
  auto parse_error = [](const std::string& src) {
    try {
      lt::jinja::Template t(src, "my_template");
      render(t, ojson::object());
    } catch (const lt::jinja::TemplateError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  CHECK_THAT(parse_error("a\nb\n{{ x | nosuch }}"), Contains("my_template line 3") && Contains("unknown or unsupported filter 'nosuch'"));
  CHECK_THAT(parse_error("{% if x %}\n{% for y in z %}\n"), Contains("my_template line") && Contains("endfor"));
  CHECK_THAT(parse_error("\n{% endif %}"), Contains("line 2") && Contains("endif"));
  CHECK_THAT(parse_error("{% include 'x' %}"), Contains("unsupported statement 'include'"));
  CHECK_THAT(parse_error("{{ 'never closed }}"), Contains("line 1"));
  CHECK_THAT(parse_error("x\n\n{{ raise_exception('Roles must alternate') }}"),
             Contains("my_template line 3") && Contains("the template raised an error: Roles must alternate"));
  CHECK_THAT(parse_error("\n{{ missing.attr }}"), Contains("line 2") && Contains("'missing' is undefined"));
  CHECK_THAT(parse_error("{{ [1].append(2) }}"), Contains("unsafe"));

  // A hostile template: chains the parser builds in a loop (each link one level deeper in the tree that
  // rendering and freeing recurse over), nesting, and values built around themselves in a loop: refused
  // past 600 levels (the parser) or 512 (a value), never a stack overflow.
  auto chain = [](const std::string& head, const std::string& link, int n) {
    std::string s = "{{ " + head;
    for (int i = 0; i < n; ++i) s += link;
    return s + " }}";
  };
  for (const auto& [head, link] : std::vector<std::pair<std::string, std::string>>{
           {"1", " or 1"}, {"1", " and 1"}, {"1", " + 1"}, {"'a'", " ~ 'a'"}, {"2", " * 1"}, {"1", " ** 1"}, {"1", " < 1"},
           {"1", " if 1"}, {"x", ".a"}, {"x", "[0]"}, {"x", "()"}, {"x", "|trim"}, {"x", " is defined"}}) {
    INFO(head << link);
    CHECK_THAT(parse_error(chain(head, link, 100000)), Contains("my_template line 1") && Contains("nested too deep"));
    CHECK_THAT(parse_error(chain(head, link, 50)), !Contains("nested too deep"));  // real templates' chains are short
  }
  CHECK_THAT(parse_error("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}"), Contains("nested too deep"));
  CHECK_THAT(parse_error("{{ " + std::string(100000, '-') + "1 }}"), Contains("nested too deep"));
  const std::string deep = "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}";
  for (const std::string& use : {"{{ ns.x }}", "{{ ns.x|tojson }}", "{{ ns.x == ns.x }}", "{{ ns.x < ns.x }}"})
    CHECK_THAT(parse_error(deep + use), Contains("a value nested more than 512 levels deep"));
}
