// The Jinja engine (jinja.hpp): a template parsed (lexer.hpp, parser.cpp) to its syntax tree (ast.hpp),
// and rendered (render.cpp). Values and operators are in value.hpp, filters, tests and methods in
// builtins.hpp, the bounds of a render in limits.hpp.
#include "lora_trainer/jinja/jinja.hpp"

#include "lora_trainer/jinja/ast.hpp"
#include "lora_trainer/jinja/lexer.hpp"
#include "lora_trainer/jinja/parser.hpp"
#include "lora_trainer/jinja/render.hpp"
#include "lora_trainer/jinja/value.hpp"

namespace lt::jinja {

using namespace detail;

Template::Template(const std::string& source, std::string name) : name_(std::move(name)) {
  const std::vector<Segment> segs = lex(source, name_);
  auto root = std::make_shared<Root>();
  Parsed parsed = parse(segs, name_);
  root->body = std::move(parsed.body);
  has_generation_ = parsed.has_generation;
  root_ = root;
}

Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

Rendered Template::render(const nlohmann::ordered_json& context, const std::function<std::string(const std::string&)>& strftime_now,
                          const RenderOptions& options) const {
  Budget budget;
  budget.limits = options.limits;
  budget.steps = options.steps_spent;
  ActiveBudget active(budget);
  Renderer r;
  r.name = name_;
  r.strftime_now = strftime_now;
  add_globals(r);
  Scope sc{&r, {}};
  sc.push();
  if (context.is_object()) {
    for (auto it = context.begin(); it != context.end(); ++it) {
      try {
        sc.set(it.key(), from_json(it.value()));
      } catch (const EvalError& e) {
        throw TemplateError(name_ + ": the variable '" + it.key() + "': " + e.message, e.message, false, e.limit);
      }
    }
    const Value messages = sc.lookup("messages");
    if (messages.kind == Value::Kind::List) {
      r.message_starts.assign(messages.list->size(), -1);
      for (size_t k = 0; k < messages.list->size(); ++k)
        if ((*messages.list)[k].kind == Value::Kind::Dict) r.message_index.emplace((*messages.list)[k].dict.get(), k);
    }
  }
  try {
    root_->run(sc);
  } catch (const EvalError& e) {  // outside any statement (should not happen)
    throw TemplateError(name_ + ": " + e.message, e.message, e.raised, e.limit);
  }
  return {std::move(r.out), std::move(r.generation), std::move(r.message_starts), budget.steps};
}

std::string without_generation_tags(const std::string& source, const std::string& name) {
  Template checked(source, name);  // a template that does not parse is refused here, not shipped
  std::string out = detail::normalized_source(source);
  const std::vector<detail::Segment> segments = detail::lex(source, name);
  for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
    if (it->kind != detail::Segment::Kind::Statement) continue;
    std::string word = it->text;
    word.erase(0, word.find_first_not_of(" \t\n"));
    word.erase(word.find_last_not_of(" \t\n") + 1);
    if (word == "generation") out.replace(it->begin, it->end - it->begin, " if true ");
    else if (word == "endgeneration") out.replace(it->begin, it->end - it->begin, " endif ");
  }
  return out + "\n";
}

}  // namespace lt::jinja
