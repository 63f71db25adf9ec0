// The Jinja engine's syntax tree (jinja.hpp): the expressions and statements a template parses to
// (parser.cpp builds them) and how each runs (render.cpp evaluates them, render.hpp).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lora_trainer/jinja/builtins.hpp"
#include "lora_trainer/jinja/limits.hpp"
#include "lora_trainer/jinja/value.hpp"

namespace lt::jinja {

namespace detail {
struct Scope;  // render.hpp
}  // namespace detail

struct Node {
  virtual ~Node() = default;
  int line = 0;
  virtual void run(detail::Scope& sc) const = 0;
};

namespace detail {

struct Expr {
  virtual ~Expr() = default;
  // Every expression evaluated is a step of work, and recursion is checked against the stack (limits.hpp).
  Value eval(Scope& sc) const {
    step();
    check_stack();
    return do_eval(sc);
  }
  virtual Value do_eval(Scope& sc) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct CallArgs {
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

// --- expressions ---

struct Literal : Expr {
  Value v;
  explicit Literal(Value v) : v(std::move(v)) {}
  Value do_eval(Scope&) const override;
};

struct Name : Expr {
  std::string name;
  explicit Name(std::string n) : name(std::move(n)) {}
  Value do_eval(Scope& sc) const override;
};

struct ListExpr : Expr {
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value do_eval(Scope& sc) const override;
};

struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value do_eval(Scope& sc) const override;
};

struct GetAttr : Expr {
  ExprPtr obj;
  std::string attr;
  Value do_eval(Scope& sc) const override;
};

struct GetItem : Expr {
  ExprPtr obj, key;
  Value do_eval(Scope& sc) const override;
};

struct Slice : Expr {
  ExprPtr obj, start, stop, step;
  Value do_eval(Scope& sc) const override;
};

struct Call : Expr {
  ExprPtr fn;
  CallArgs a;
  Value do_eval(Scope& sc) const override;
};

struct Filter : Expr {
  ExprPtr value;
  std::string name;
  FilterFn f;
  CallArgs a;
  Value do_eval(Scope& sc) const override;
};

struct Test : Expr {
  ExprPtr value;
  TestFn f;
  CallArgs a;
  bool negated = false;
  Value do_eval(Scope& sc) const override;
};

struct Unary : Expr {
  char op;  // '!' not, '-', '+'
  ExprPtr e;
  Value do_eval(Scope& sc) const override;
};

struct Binary : Expr {
  std::string op;
  ExprPtr l, r;
  Value do_eval(Scope& sc) const override;
};

struct Conditional : Expr {
  ExprPtr cond, yes, no;  // no: may be null (Undefined)
  Value do_eval(Scope& sc) const override;
};

// --- statements ---

struct TextNode : Node {
  std::string text;
  void run(Scope& sc) const override;
};

struct OutputNode : Node {
  ExprPtr e;
  void run(Scope& sc) const override;
};

struct IfNode : Node {
  std::vector<std::pair<ExprPtr, Body>> branches;  // else: a null condition
  void run(Scope& sc) const override;
};

struct ForNode : Node {
  std::vector<std::string> targets;
  ExprPtr iter, filter;
  Body body, else_body;
  void run(Scope& sc) const override;
};

struct SetNode : Node {
  std::vector<std::string> targets;  // or one namespace attribute: `ns_name`.`attr`
  std::string ns_name, attr;
  ExprPtr value;
  Body block;  // {% set x %}...{% endset %}
  void run(Scope& sc) const override;
};

struct FilterBlockNode : Node {  // {% filter name(args) %}...{% endfilter %}
  FilterFn f;
  CallArgs a;
  Body body;
  void run(Scope& sc) const override;
};

struct LoopControl : Node {
  bool is_break;
  void run(Scope&) const override;
};

struct GenerationNode : Node {
  Body body;
  void run(Scope& sc) const override;
};

struct MacroNode : Node {
  std::string name;
  std::vector<std::pair<std::string, ExprPtr>> params;  // default: may be null
  Body body;
  void run(Scope& sc) const override;
};

// The template: its statements.
struct Root : Node {
  Body body;
  void run(Scope& sc) const override;
};

}  // namespace detail
}  // namespace lt::jinja
