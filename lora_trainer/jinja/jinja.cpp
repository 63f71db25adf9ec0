// The Jinja engine (jinja.hpp): the syntax tree, its parser and the render. Values and operators are in
// jinja/value.hpp, the lexer in jinja/lexer.hpp, filters, tests and methods in jinja/builtins.hpp.
#include "lora_trainer/jinja/jinja.hpp"

#include <algorithm>
#include <initializer_list>
#include <ctime>
#include <sstream>
#include <unordered_map>

#include "lora_trainer/jinja/builtins.hpp"
#include "lora_trainer/jinja/lexer.hpp"
#include "lora_trainer/jinja/value.hpp"

namespace lt::jinja {

namespace {

using namespace detail;

// Control flow of {% break %} and {% continue %}.
struct BreakLoop {};
struct ContinueLoop {};

// ---------------------------------------------------------------------------------------------------
// Syntax tree

struct Scope;

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

}  // namespace

struct Node {
  virtual ~Node() = default;
  int line = 0;
  virtual void run(Scope& sc) const = 0;
};

namespace {

using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

// Where a render writes, and its variables.
struct Renderer {
  std::string out;
  int capture = 0;  // > 0 while `out` is a macro's, a {% set %} block's or a {% filter %} block's own text
  std::vector<std::pair<size_t, size_t>> generation;
  std::function<std::string(const std::string&)> strftime_now;
  std::string name;
  std::unordered_map<std::string, Value> globals;
  std::unordered_map<const Dict*, size_t> message_index;  // the context's messages, by identity
  std::vector<int64_t> message_starts;                    // Rendered::message_starts
  // Every namespace made, so that one holding itself (ns.x = [ns]) is emptied, and freed, at the end.
  std::vector<std::weak_ptr<Dict>> namespaces;
  ~Renderer() {
    for (auto& w : namespaces)
      if (auto d = w.lock()) d->clear();
  }
};

// The variables of a template, a for loop or a macro call. Shared: a macro sees the frames around its
// definition as they are when it is called (itself, and macros and names set later at the top level
// included), as jinja2's closures do.
using Frame = std::unordered_map<std::string, Value>;

struct Scope {
  Renderer* r;
  std::vector<std::shared_ptr<Frame>> frames;

  Value lookup(const std::string& n) const {
    for (auto it = frames.rbegin(); it != frames.rend(); ++it) {
      auto f = (*it)->find(n);
      if (f != (*it)->end()) return f->second;
    }
    auto g = r->globals.find(n);
    return g != r->globals.end() ? g->second : Value::undefined(n);
  }
  void set(const std::string& n, Value v) { (*frames.back())[n] = std::move(v); }
  void push() { frames.push_back(std::make_shared<Frame>()); }
};

// Text written aside while alive (a macro's output, a {% set %} or {% filter %} block's): `out` is the
// block's own, and the render's is back after.
struct Capture {
  Renderer& r;
  std::string saved;
  explicit Capture(Renderer& renderer) : r(renderer) {
    std::swap(saved, r.out);
    ++r.capture;
  }
  std::string take() {  // the block's text; the render's is back
    std::swap(saved, r.out);
    --r.capture;
    done = true;
    return std::move(saved);
  }
  ~Capture() {
    if (!done) { std::swap(saved, r.out); --r.capture; }
  }
  bool done = false;
};

template <typename F>
void at_line(const Scope& sc, int line, F&& f);

// Every statement run is a step of work, checked against the limits at its line.
void run_body(const Body& body, Scope& sc) {
  for (const auto& n : body) {
    at_line(sc, n->line, [] {
      step();
      check_stack();
    });
    n->run(sc);
  }
}

// Text written to the output: counted, and bounded by the limit `output`.
void write(Renderer& r, const std::string& text) {
  charge_bytes(text.size());
  check_output(plus(r.out.size(), text.size()));
  r.out += text;
}

// Runs `f` for the statement at `line`: an EvalError becomes a TemplateError naming the template and line.
template <typename F>
void at_line(const Scope& sc, int line, F&& f) {
  try {
    f();
  } catch (const EvalError& e) {
    const std::string where = sc.r->name + " line " + std::to_string(line);
    throw TemplateError(e.raised ? where + ": the template raised an error: " + e.message : where + ": " + e.message,
                        e.message, e.raised, e.limit);
  }
}

// --- expressions ---

struct Literal : Expr {
  Value v;
  explicit Literal(Value v) : v(std::move(v)) {}
  Value do_eval(Scope&) const override { return v; }
};

struct Name : Expr {
  std::string name;
  explicit Name(std::string n) : name(std::move(n)) {}
  Value do_eval(Scope& sc) const override { return sc.lookup(name); }
};

struct ListExpr : Expr {
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value do_eval(Scope& sc) const override {
    List l;
    for (const auto& e : items) l.push_back(e->eval(sc));
    return Value::of_list(std::move(l), tuple);
  }
};

struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value do_eval(Scope& sc) const override {
    Dict d;
    for (const auto& [k, v] : items) {
      Value key = k->eval(sc);
      if (!key.is_string()) fail("dict keys other than strings are not supported");
      Value val = v->eval(sc);
      auto it = std::find_if(d.begin(), d.end(), [&](const auto& kv) { return kv.first == key.s; });
      if (it != d.end()) it->second = val;
      else d.emplace_back(key.s, val);
    }
    return Value::of_dict(std::move(d));
  }
};


struct GetAttr : Expr {
  ExprPtr obj;
  std::string attr;
  Value do_eval(Scope& sc) const override { return get_attr(obj->eval(sc), attr); }
};

struct GetItem : Expr {
  ExprPtr obj, key;
  Value do_eval(Scope& sc) const override { return get_item(obj->eval(sc), key->eval(sc)); }
};

struct Slice : Expr {
  ExprPtr obj, start, stop, step;
  Value do_eval(Scope& sc) const override;
};
void eval_args(const CallArgs& a, Scope& sc, Args& args, Kwargs& kwargs) {
  for (const auto& e : a.args) args.push_back(e->eval(sc));
  for (const auto& [k, e] : a.kwargs) kwargs.emplace_back(k, e->eval(sc));
}

struct Call : Expr {
  ExprPtr fn;
  CallArgs a;
  Value do_eval(Scope& sc) const override {
    Value f = fn->eval(sc);
    Args args;
    Kwargs kwargs;
    eval_args(a, sc, args, kwargs);
    return call(f, args, kwargs);
  }
};


struct Filter : Expr {
  ExprPtr value;
  std::string name;
  FilterFn f;
  CallArgs a;
  Value do_eval(Scope& sc) const override {
    Value v = value->eval(sc);
    Args args;
    Kwargs kwargs;
    eval_args(a, sc, args, kwargs);
    return f(std::move(v), args, kwargs);
  }
};

struct Test : Expr {
  ExprPtr value;
  TestFn f;
  CallArgs a;
  bool negated = false;
  Value do_eval(Scope& sc) const override {
    Value v = value->eval(sc);
    Args args;
    Kwargs kwargs;
    eval_args(a, sc, args, kwargs);
    return Value::boolean(f(v, args) != negated);
  }
};

struct Unary : Expr {
  char op;  // '!' not, '-', '+'
  ExprPtr e;
  Value do_eval(Scope& sc) const override {
    Value v = e->eval(sc);
    if (op == '!') return Value::boolean(!truthy(v));
    if (v.is_undefined()) undefined_error(v);
    if (!v.is_number()) fail(std::string("bad operand type for unary ") + op + ": '" + type_name(v) + "'");
    if (v.kind == Value::Kind::Float) return Value::real(op == '-' ? -v.f : v.f);
    if (op == '-') return binary("-", Value::integer(0), v);  // -(-2**63) overflows
    return Value::integer(v.integer_value());
  }
};


struct Binary : Expr {
  std::string op;
  ExprPtr l, r;
  Value do_eval(Scope& sc) const override {
    if (op == "and") { Value x = l->eval(sc); return truthy(x) ? r->eval(sc) : x; }
    if (op == "or") { Value x = l->eval(sc); return truthy(x) ? x : r->eval(sc); }
    return binary(op, l->eval(sc), r->eval(sc));
  }
};

struct Conditional : Expr {
  ExprPtr cond, yes, no;  // no: may be null (Undefined)
  Value do_eval(Scope& sc) const override {
    if (truthy(cond->eval(sc))) return yes->eval(sc);
    return no ? no->eval(sc) : Value::undefined();
  }
};

Value Slice::do_eval(Scope& sc) const {
  Value v = obj->eval(sc);
  auto ev = [&](const ExprPtr& e) { return e ? e->eval(sc) : Value::none(); };
  return slice(v, ev(start), ev(stop), ev(step));
}

// --- statements ---

struct TextNode : Node {
  std::string text;
  void run(Scope& sc) const override {
    at_line(sc, line, [&] { write(*sc.r, text); });
  }
};

struct OutputNode : Node {
  ExprPtr e;
  void run(Scope& sc) const override {
    at_line(sc, line, [&] { write(*sc.r, to_str(e->eval(sc))); });
  }
};

struct IfNode : Node {
  std::vector<std::pair<ExprPtr, Body>> branches;  // else: a null condition
  void run(Scope& sc) const override {
    for (const auto& [cond, body] : branches) {
      bool take = true;
      if (cond) at_line(sc, line, [&] { take = truthy(cond->eval(sc)); });
      if (take) { run_body(body, sc); return; }
    }
  }
};

// Assigns `v` to the target names (one name, or a tuple of names unpacking a sequence).
void assign(Scope& sc, const std::vector<std::string>& names, const Value& v) {
  if (names.size() == 1) { sc.set(names[0], v); return; }
  List items = iterate(v);
  if (items.size() != names.size())
    fail("cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(names.size()) + " names");
  for (size_t k = 0; k < names.size(); ++k) sc.set(names[k], items[k]);
}

struct ForNode : Node {
  std::vector<std::string> targets;
  ExprPtr iter, filter;
  Body body, else_body;
  void run(Scope& sc) const override {
    List items;
    at_line(sc, line, [&] { items = iterate(iter->eval(sc)); });
    sc.push();
    if (filter) {
      List kept;
      for (const auto& x : items) {
        bool keep = false;
        at_line(sc, line, [&] {
          assign(sc, targets, x);
          keep = truthy(filter->eval(sc));
          if (keep) kept.push_back(x);
        });
      }
      items = std::move(kept);
    }
    const int64_t n = static_cast<int64_t>(items.size());
    Renderer& r = *sc.r;
    for (int64_t k = 0; k < n; ++k) {
      const Value& item = items[static_cast<size_t>(k)];
      if (r.capture == 0 && item.kind == Value::Kind::Dict && !r.message_index.empty()) {
        auto m = r.message_index.find(item.dict.get());
        if (m != r.message_index.end()) r.message_starts[m->second] = static_cast<int64_t>(r.out.size());
      }
      at_line(sc, line, [&] {
        step();  // an iteration with an empty body is work too
        Dict loop{{"index", Value::integer(k + 1)},
                  {"index0", Value::integer(k)},
                  {"revindex", Value::integer(n - k)},
                  {"revindex0", Value::integer(n - k - 1)},
                  {"first", Value::boolean(k == 0)},
                  {"last", Value::boolean(k == n - 1)},
                  {"length", Value::integer(n)},
                  {"depth", Value::integer(1)},
                  {"depth0", Value::integer(0)},
                  {"previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : Value::undefined("previtem")},
                  {"nextitem", k + 1 < n ? items[static_cast<size_t>(k + 1)] : Value::undefined("nextitem")}};
        loop.emplace_back("cycle", Value::function([k](Args& args, Kwargs&) {
          if (args.empty()) fail("loop.cycle() needs at least one value");
          return args[static_cast<size_t>(k) % args.size()];
        }));
        sc.set("loop", Value::of_dict(std::move(loop), true));
        assign(sc, targets, item);
      });
      try {
        run_body(body, sc);
      } catch (const BreakLoop&) {
        break;
      } catch (const ContinueLoop&) {
        continue;
      }
    }
    sc.frames.pop_back();
    if (n == 0) run_body(else_body, sc);
  }
};

struct SetNode : Node {
  std::vector<std::string> targets;  // or one namespace attribute: `ns_name`.`attr`
  std::string ns_name, attr;
  ExprPtr value;
  Body block;  // {% set x %}...{% endset %}
  void run(Scope& sc) const override {
    at_line(sc, line, [&] {
      Value v;
      if (value) {
        v = value->eval(sc);
      } else {
        Capture text(*sc.r);
        run_body(block, sc);
        v = Value::string(text.take());
      }
      if (!ns_name.empty()) {
        Value ns = sc.lookup(ns_name);
        if (ns.kind != Value::Kind::Namespace) fail("cannot assign attribute on non-namespace object '" + ns_name + "'");
        for (auto& [k, x] : *ns.dict)
          if (k == attr) { x = v; return; }
        ns.dict->emplace_back(attr, v);
        return;
      }
      assign(sc, targets, v);
    });
  }
};

struct FilterBlockNode : Node {  // {% filter name(args) %}...{% endfilter %}
  FilterFn f;
  CallArgs a;
  Body body;
  void run(Scope& sc) const override {
    Capture text(*sc.r);
    run_body(body, sc);
    std::string saved = text.take();
    at_line(sc, line, [&] {
      Args args;
      Kwargs kwargs;
      eval_args(a, sc, args, kwargs);
      write(*sc.r, to_str(f(Value::string(std::move(saved)), args, kwargs)));
    });
  }
};

struct LoopControl : Node {
  bool is_break;
  void run(Scope&) const override {
    if (is_break) throw BreakLoop{};
    throw ContinueLoop{};
  }
};

struct GenerationNode : Node {
  Body body;
  void run(Scope& sc) const override {
    const size_t begin = sc.r->out.size();
    run_body(body, sc);
    sc.r->generation.emplace_back(begin, sc.r->out.size());
  }
};

struct MacroNode : Node {
  std::string name;
  std::vector<std::pair<std::string, ExprPtr>> params;  // default: may be null
  Body body;
  void run(Scope& sc) const override {
    const MacroNode* self = this;
    Renderer* r = sc.r;
    // The frames around the definition, by reference (weak: a frame holds the macro, which must not
    // keep the frame alive). One that has ended (a loop's, when the macro was stored away) is gone.
    std::vector<std::weak_ptr<Frame>> outer(sc.frames.begin(), sc.frames.end());
    sc.set(name, Value::function([self, r, outer](Args& args, Kwargs& kwargs) {
      Budget* b = active_budget();
      if (b && b->depth >= b->limits.depth) over_depth(*b, self->name);
      struct Depth {
        Budget* b;
        explicit Depth(Budget* x) : b(x) { if (b) ++b->depth; }
        ~Depth() { if (b) --b->depth; }
      } depth(b);
      Scope inner{r, {}};
      for (const auto& w : outer)
        if (auto f = w.lock()) inner.frames.push_back(std::move(f));
      inner.push();
      if (args.size() > self->params.size()) fail("macro '" + self->name + "' takes no more than " + std::to_string(self->params.size()) + " arguments");
      for (size_t k = 0; k < self->params.size(); ++k) {
        const auto& [pname, dflt] = self->params[k];
        auto kw = std::find_if(kwargs.begin(), kwargs.end(), [&](const auto& p) { return p.first == pname; });
        if (k < args.size()) inner.set(pname, args[k]);
        else if (kw != kwargs.end()) inner.set(pname, kw->second);
        else inner.set(pname, dflt ? dflt->eval(inner) : Value::undefined(pname));
      }
      for (const auto& [k, v] : kwargs)
        if (std::none_of(self->params.begin(), self->params.end(), [&](const auto& p) { return p.first == k; }))
          fail("macro '" + self->name + "' takes no keyword argument '" + k + "'");
      Capture text(*r);
      run_body(self->body, inner);
      Value v = Value::string(text.take());
      v.markup = true;
      return v;
    }));
  }
};

// ---------------------------------------------------------------------------------------------------
// Parser

class Parser {
 public:
  Parser(const std::vector<Segment>& segs, std::string name) : segs_(segs), name_(std::move(name)) {}

  Body parse_all() {
    Body b = parse_body({});
    if (pos_ < segs_.size()) error(segs_[pos_].line, "unexpected '" + first_word(segs_[pos_].text) + "'");
    return b;
  }
  bool saw_generation() const { return saw_generation_; }

 private:
  const std::vector<Segment>& segs_;
  std::string name_;
  size_t pos_ = 0;
  // The tokens of the tag being parsed.
  std::vector<Token> toks_;
  size_t t_ = 0;
  int line_ = 0;
  int loop_depth_ = 0;
  bool saw_generation_ = false;
  int nesting_ = 0;  // expressions within expressions, bounded (the parser recurses)

  [[noreturn]] void error(int line, const std::string& msg) const {
    throw TemplateError(name_ + " line " + std::to_string(line) + ": " + msg, msg, false);
  }
  [[noreturn]] void error(const std::string& msg) const { error(line_, msg); }

  static std::string first_word(const std::string& s) {
    std::istringstream in(s);
    std::string w;
    in >> w;
    return w;
  }

  void start(const Segment& s) {
    line_ = s.line;
    toks_ = tokenize(s.text, [&](const std::string& m) { error(m); });
    t_ = 0;
  }
  const Token& peek(size_t ahead = 0) const { return toks_[std::min(t_ + ahead, toks_.size() - 1)]; }
  bool at_op(const char* op) const { return peek().kind == Token::Kind::Op && peek().text == op; }
  bool at_name(const char* n) const { return peek().kind == Token::Kind::Name && peek().text == n; }
  Token next() { Token t = peek(); if (t_ < toks_.size() - 1) ++t_; return t; }
  std::string describe(const Token& t) const { return t.kind == Token::Kind::End ? "the end of the tag" : "'" + t.text + "'"; }
  void expect_op(const char* op) {
    if (!at_op(op)) error(std::string("expected '") + op + "', found " + describe(peek()));
    next();
  }
  std::string expect_name() {
    if (peek().kind != Token::Kind::Name) error("expected a name, found " + describe(peek()));
    return next().text;
  }
  void expect_end() {
    if (peek().kind != Token::Kind::End) error("unexpected " + describe(peek()) + " at the end of the tag");
  }

  // Nodes up to a statement whose first word is in `ends` (left unconsumed), or the end.
  Body parse_body(const std::vector<std::string>& ends) {
    Body body;
    while (pos_ < segs_.size()) {
      const Segment& s = segs_[pos_];
      if (s.kind == Segment::Kind::Text) {
        auto n = std::make_unique<TextNode>();
        n->line = s.line;
        n->text = s.text;
        body.push_back(std::move(n));
        ++pos_;
        continue;
      }
      start(s);
      if (s.kind == Segment::Kind::Output) {
        auto n = std::make_unique<OutputNode>();
        n->line = s.line;
        n->e = parse_expr();
        expect_end();
        body.push_back(std::move(n));
        ++pos_;
        continue;
      }
      const std::string word = peek().kind == Token::Kind::Name ? peek().text : "";
      if (std::find(ends.begin(), ends.end(), word) != ends.end()) return body;
      if (word == "endraw") { ++pos_; continue; }
      ++pos_;
      next();
      body.push_back(parse_statement(word, s.line));
    }
    if (!ends.empty()) error(segs_.empty() ? 1 : segs_.back().line, "the template ends inside a block: expected {% " + ends.back() + " %}");
    return body;
  }

  // Consumes the statement `word` that closes a block (after parse_body stopped at it).
  void close(const char* word) {
    start(segs_[pos_]);
    next();
    expect_end();
    (void)word;
    ++pos_;
  }

  NodePtr parse_statement(const std::string& word, int line) {
    Nest nest(*this);
    if (word == "if") return parse_if(line);
    if (word == "for") return parse_for(line);
    if (word == "set") return parse_set(line);
    if (word == "macro") return parse_macro(line);
    if (word == "filter") {
      auto n = std::make_unique<FilterBlockNode>();
      n->line = line;
      const std::string fname = expect_name();
      auto it = filters().find(fname);
      if (it == filters().end()) error("unknown or unsupported filter '" + fname + "'");
      n->f = it->second;
      if (at_op("(")) { next(); n->a = parse_call_args(); }
      expect_end();
      n->body = parse_body({"endfilter"});
      close("endfilter");
      return n;
    }
    if (word == "generation") {
      expect_end();
      auto n = std::make_unique<GenerationNode>();
      n->line = line;
      saw_generation_ = true;
      n->body = parse_body({"endgeneration"});
      close("endgeneration");
      return n;
    }
    if (word == "break" || word == "continue") {
      expect_end();
      if (loop_depth_ == 0) error(line, "{% " + word + " %} outside a for loop");
      auto n = std::make_unique<LoopControl>();
      n->line = line;
      n->is_break = word == "break";
      return n;
    }
    if (word.empty()) error(line, "a statement tag with no statement");
    if (word == "else" || word == "elif" || word.compare(0, 3, "end") == 0)
      error(line, "unexpected {% " + word + " %}: no block that it closes is open here");
    error(line, "unknown or unsupported statement '" + word +
                    "' (supported: if, for, set, macro, filter, generation, break, continue, raw)");
  }

  NodePtr parse_if(int line) {
    auto n = std::make_unique<IfNode>();
    n->line = line;
    ExprPtr cond = parse_expr();
    expect_end();
    while (true) {
      Body body = parse_body({"elif", "else", "endif"});
      n->branches.emplace_back(std::move(cond), std::move(body));
      start(segs_[pos_]);
      const std::string w = next().text;
      ++pos_;
      if (w == "endif") { expect_end(); break; }
      if (w == "else") {
        expect_end();
        n->branches.emplace_back(nullptr, parse_body({"endif"}));
        close("endif");
        break;
      }
      cond = parse_expr();  // elif
      expect_end();
    }
    return n;
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    const bool paren = at_op("(");
    if (paren) next();
    names.push_back(expect_name());
    while (at_op(",")) { next(); names.push_back(expect_name()); }
    if (paren) expect_op(")");
    return names;
  }

  NodePtr parse_for(int line) {
    auto n = std::make_unique<ForNode>();
    n->line = line;
    n->targets = parse_targets();
    if (!at_name("in")) error("expected 'in' in the for loop, found " + describe(peek()));
    next();
    n->iter = parse_expr(false);
    if (at_name("if")) { next(); n->filter = parse_expr(false); }
    if (at_name("recursive")) error("recursive for loops are not supported");
    expect_end();
    ++loop_depth_;
    n->body = parse_body({"else", "endfor"});
    --loop_depth_;
    start(segs_[pos_]);
    const std::string w = next().text;
    ++pos_;
    expect_end();
    if (w == "else") {
      n->else_body = parse_body({"endfor"});
      close("endfor");
    }
    return n;
  }

  NodePtr parse_set(int line) {
    auto n = std::make_unique<SetNode>();
    n->line = line;
    if (peek().kind == Token::Kind::Name && peek(1).kind == Token::Kind::Op && peek(1).text == ".") {
      n->ns_name = next().text;
      next();
      n->attr = expect_name();
    } else {
      n->targets = parse_targets();
    }
    if (at_op("=")) {
      next();
      n->value = parse_tuple_or_expr();
      expect_end();
      return n;
    }
    if (!n->ns_name.empty() || n->targets.size() != 1) error("a {% set %} block assigns one name");
    if (at_op("|")) error("filters on {% set %} blocks are not supported");
    expect_end();
    n->block = parse_body({"endset"});
    close("endset");
    return n;
  }

  NodePtr parse_macro(int line) {
    auto n = std::make_unique<MacroNode>();
    n->line = line;
    n->name = expect_name();
    expect_op("(");
    while (!at_op(")")) {
      std::string p = expect_name();
      ExprPtr dflt;
      if (at_op("=")) { next(); dflt = parse_expr(); }
      n->params.emplace_back(p, std::move(dflt));
      if (!at_op(")")) expect_op(",");
    }
    next();
    expect_end();
    const int saved = loop_depth_;
    loop_depth_ = 0;
    n->body = parse_body({"endmacro"});
    loop_depth_ = saved;
    close("endmacro");
    return n;
  }

  // --- expressions (jinja2's precedence) ---

  ExprPtr parse_tuple_or_expr() {
    ExprPtr first = parse_expr();
    if (!at_op(",")) return first;
    auto t = std::make_unique<ListExpr>();
    t->tuple = true;
    t->items.push_back(std::move(first));
    while (at_op(",")) {
      next();
      if (peek().kind == Token::Kind::End) break;
      t->items.push_back(parse_expr());
    }
    return t;
  }

  // Counts one level of the parser's recursion while alive: templates nested past 600 levels are refused.
  struct Nest {
    Parser& p;
    explicit Nest(Parser& parser) : p(parser) {
      if (++p.nesting_ > 600) p.error("blocks or expressions nested too deep (the parser allows 600 levels)");
    }
    ~Nest() { --p.nesting_; }
  };
  // A chain the parser builds in a loop (a or b or c..., x.a.b..., x|f|g..., 1 if c else 2 if d...) makes
  // a tree as deep as the chain, and rendering and freeing a tree recurse: each link counts one level too.
  struct Deepen {
    Parser& p;
    int links = 0;
    explicit Deepen(Parser& parser) : p(parser) {}
    void link() {
      ++links;
      if (++p.nesting_ > 600) p.error("blocks or expressions nested too deep (the parser allows 600 levels)");
    }
    ~Deepen() { p.nesting_ -= links; }
  };

  ExprPtr parse_expr(bool with_condexpr = true) {
    Nest nest(*this);
    ExprPtr e = parse_or();
    if (!with_condexpr) return e;
    Deepen chain(*this);
    while (at_name("if")) {
      chain.link();
      next();
      auto c = std::make_unique<Conditional>();
      c->cond = parse_or();
      c->yes = std::move(e);
      if (at_name("else")) { next(); c->no = parse_expr(); }
      e = std::move(c);
    }
    return e;
  }

  ExprPtr make_binary(const std::string& op, ExprPtr l, ExprPtr r) {
    auto b = std::make_unique<Binary>();
    b->op = op;
    b->l = std::move(l);
    b->r = std::move(r);
    return b;
  }

  // A left-associative level of binary operators (words such as `or`, or symbols such as `+`) over the
  // next level's operands: jinja2's parse_or, parse_and, parse_math1, parse_concat, parse_math2, parse_pow.
  template <class Operand>
  ExprPtr left_assoc(std::initializer_list<const char*> ops, bool words, Operand operand) {
    ExprPtr e = operand();
    Deepen chain(*this);
    while (true) {
      const char* op = nullptr;
      for (const char* o : ops)
        if (words ? at_name(o) : at_op(o)) op = o;
      if (!op) return e;
      chain.link();
      next();
      e = make_binary(op, std::move(e), operand());
    }
  }
  ExprPtr parse_or() { return left_assoc({"or"}, true, [&] { return parse_and(); }); }
  ExprPtr parse_and() { return left_assoc({"and"}, true, [&] { return parse_not(); }); }
  ExprPtr parse_not() {
    Nest nest(*this);
    if (at_name("not")) {
      next();
      auto u = std::make_unique<Unary>();
      u->op = '!';
      u->e = parse_not();
      return u;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    ExprPtr e = parse_math1();
    Deepen chain(*this);
    while (true) {
      const Token& t = peek();
      std::string op;
      if (t.kind == Token::Kind::Op && (t.text == "==" || t.text == "!=" || t.text == "<" || t.text == ">" || t.text == "<=" || t.text == ">="))
        op = t.text;
      else if (at_name("in"))
        op = "in";
      else if (at_name("not") && peek(1).kind == Token::Kind::Name && peek(1).text == "in")
        op = "not in";
      else
        return e;
      chain.link();
      next();
      if (op == "not in") next();
      e = make_binary(op, std::move(e), parse_math1());
    }
  }
  ExprPtr parse_math1() { return left_assoc({"+", "-"}, false, [&] { return parse_concat(); }); }
  ExprPtr parse_concat() { return left_assoc({"~"}, false, [&] { return parse_math2(); }); }
  ExprPtr parse_math2() { return left_assoc({"*", "/", "//", "%"}, false, [&] { return parse_pow(); }); }
  ExprPtr parse_pow() { return left_assoc({"**"}, false, [&] { return parse_unary(); }); }
  ExprPtr parse_unary(bool with_filter = true) {
    Nest nest(*this);
    ExprPtr e;
    if (at_op("-") || at_op("+")) {
      auto u = std::make_unique<Unary>();
      u->op = next().text[0];
      u->e = parse_unary(false);
      e = std::move(u);
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filters(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    Token t = next();
    switch (t.kind) {
      case Token::Kind::Name:
        if (t.text == "true" || t.text == "True") return std::make_unique<Literal>(Value::boolean(true));
        if (t.text == "false" || t.text == "False") return std::make_unique<Literal>(Value::boolean(false));
        if (t.text == "none" || t.text == "None") return std::make_unique<Literal>(Value::none());
        return std::make_unique<Name>(t.text);
      case Token::Kind::String: {
        std::string s = t.text;
        while (peek().kind == Token::Kind::String) s += next().text;  // adjacent literals join
        return std::make_unique<Literal>(Value::string(s));
      }
      case Token::Kind::Int: return std::make_unique<Literal>(Value::integer(t.i));
      case Token::Kind::Float: return std::make_unique<Literal>(Value::real(t.f));
      case Token::Kind::Op:
        if (t.text == "(") {
          if (at_op(")")) { next(); auto l = std::make_unique<ListExpr>(); l->tuple = true; return l; }
          ExprPtr e = parse_expr();
          if (at_op(",")) {
            auto l = std::make_unique<ListExpr>();
            l->tuple = true;
            l->items.push_back(std::move(e));
            while (at_op(",")) {
              next();
              if (at_op(")")) break;
              l->items.push_back(parse_expr());
            }
            e = std::move(l);
          }
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          auto l = std::make_unique<ListExpr>();
          while (!at_op("]")) {
            l->items.push_back(parse_expr());
            if (!at_op("]")) expect_op(",");
          }
          next();
          return l;
        }
        if (t.text == "{") {
          auto d = std::make_unique<DictExpr>();
          while (!at_op("}")) {
            ExprPtr k = parse_expr();
            expect_op(":");
            d->items.emplace_back(std::move(k), parse_expr());
            if (!at_op("}")) expect_op(",");
          }
          next();
          return d;
        }
        break;
      default: break;
    }
    error("unexpected " + describe(t) + " in an expression");
  }

  CallArgs parse_call_args() {  // after '('
    CallArgs a;
    while (!at_op(")")) {
      if (peek().kind == Token::Kind::Name && peek(1).kind == Token::Kind::Op && peek(1).text == "=") {
        std::string k = next().text;
        next();
        a.kwargs.emplace_back(k, parse_expr());
      } else {
        if (at_op("*") || at_op("**")) error("*args and **kwargs in calls are not supported");
        a.args.push_back(parse_expr());
      }
      if (!at_op(")")) expect_op(",");
    }
    next();
    return a;
  }

  ExprPtr parse_postfix(ExprPtr e) {
    Deepen chain(*this);
    while (true) {
      chain.link();
      if (at_op(".")) {
        next();
        auto g = std::make_unique<GetAttr>();
        g->obj = std::move(e);
        if (peek().kind == Token::Kind::Int) {  // foo.0: an index
          auto gi = std::make_unique<GetItem>();
          gi->obj = std::move(g->obj);
          gi->key = std::make_unique<Literal>(Value::integer(next().i));
          e = std::move(gi);
          continue;
        }
        g->attr = expect_name();
        e = std::move(g);
      } else if (at_op("[")) {
        next();
        ExprPtr a, b, c;
        bool is_slice = false;
        if (!at_op(":")) a = parse_expr();
        if (at_op(":")) {
          is_slice = true;
          next();
          if (!at_op("]") && !at_op(":")) b = parse_expr();
          if (at_op(":")) { next(); if (!at_op("]")) c = parse_expr(); }
        }
        expect_op("]");
        if (is_slice) {
          auto s = std::make_unique<Slice>();
          s->obj = std::move(e);
          s->start = std::move(a);
          s->stop = std::move(b);
          s->step = std::move(c);
          e = std::move(s);
        } else {
          auto g = std::make_unique<GetItem>();
          g->obj = std::move(e);
          g->key = std::move(a);
          e = std::move(g);
        }
      } else if (at_op("(")) {
        next();
        auto c = std::make_unique<Call>();
        c->fn = std::move(e);
        c->a = parse_call_args();
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_filters(ExprPtr e) {
    Deepen chain(*this);
    while (true) {
      chain.link();
      if (at_op("|")) {
        next();
        auto f = std::make_unique<Filter>();
        f->name = expect_name();
        auto it = filters().find(f->name);
        if (it == filters().end()) error("unknown or unsupported filter '" + f->name + "'");
        f->f = it->second;
        f->value = std::move(e);
        if (at_op("(")) { next(); f->a = parse_call_args(); }
        e = std::move(f);
      } else if (at_name("is")) {
        next();
        auto t = std::make_unique<Test>();
        if (at_name("not")) { next(); t->negated = true; }
        std::string name;
        if (peek().kind == Token::Kind::Name) name = next().text;
        else if (at_op("==") || at_op("!=") || at_op("<") || at_op(">") || at_op("<=") || at_op(">=")) name = next().text;
        else error("expected a test name after 'is', found " + describe(peek()));
        if (name == "none" || name == "None") name = "none";
        if (name == "true" || name == "True") name = "true";
        if (name == "false" || name == "False") name = "false";
        auto it = tests().find(name);
        if (it == tests().end()) error("unknown or unsupported test '" + name + "'");
        t->f = it->second;
        t->value = std::move(e);
        if (at_op("(")) {
          next();
          t->a = parse_call_args();
        } else if (peek().kind == Token::Kind::String || peek().kind == Token::Kind::Int || peek().kind == Token::Kind::Float ||
                   (peek().kind == Token::Kind::Name && !at_name("and") && !at_name("or") && !at_name("if") && !at_name("else") &&
                    !at_name("is") && !at_name("in") && !at_name("not"))) {
          t->a.args.push_back(parse_primary());  // `is divisibleby 3`, `is sameas x`
        }
        e = std::move(t);
      } else if (at_op("(") ) {
        next();
        auto c = std::make_unique<Call>();
        c->fn = std::move(e);
        c->a = parse_call_args();
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
};

// Globals: raise_exception, namespace, range, dict, strftime_now.
void add_globals(Renderer& r) {
  r.globals["raise_exception"] = Value::function([](Args& a, Kwargs&) -> Value {
    throw EvalError{a.empty() ? std::string("(no message)") : to_str(a[0]), true, ""};
  });
  Renderer* rp = &r;
  r.globals["namespace"] = Value::function([rp](Args& a, Kwargs& kw) {
    Dict d;
    for (const auto& x : a) {
      if (!x.is_mapping()) fail("namespace() takes keyword arguments or a dict");
      for (const auto& kv : *x.dict) d.push_back(kv);
    }
    for (const auto& kv : kw) d.push_back(kv);
    Value ns = Value::of_dict(std::move(d), true);
    rp->namespaces.push_back(ns.dict);
    return ns;
  });
  r.globals["dict"] = Value::function([](Args& a, Kwargs& kw) {
    Dict d;
    for (const auto& x : a)
      if (x.is_mapping())
        for (const auto& kv : *x.dict) d.push_back(kv);
    for (const auto& kv : kw) d.push_back(kv);
    return Value::of_dict(std::move(d));
  });
  r.globals["range"] = Value::function([](Args& a, Kwargs&) {
    if (a.empty() || a.size() > 3) fail("range() takes 1 to 3 integers");
    int64_t b = 0, e, st = 1;
    if (a.size() == 1) e = int_arg(a[0], 0);
    else { b = int_arg(a[0], 0); e = int_arg(a[1], 0); if (a.size() == 3) st = int_arg(a[2], 1); }
    if (st == 0) fail("range() step must not be zero");
    // Counted before it is made (a step near 2**63 must not overflow), and bounded as jinja2's sandbox
    // bounds it (MAX_RANGE).
    const uint64_t dist = st > 0 ? (e > b ? static_cast<uint64_t>(e) - static_cast<uint64_t>(b) : 0)
                                 : (b > e ? static_cast<uint64_t>(b) - static_cast<uint64_t>(e) : 0);
    const uint64_t mag = st > 0 ? static_cast<uint64_t>(st) : static_cast<uint64_t>(-(st + 1)) + 1;
    const uint64_t n = dist == 0 ? 0 : (dist - 1) / mag + 1;
    if (n > 100000) fail("range() of " + std::to_string(n) + " items: the sandbox allows at most 100000 (as jinja2's does)");
    List l;
    for (uint64_t k = 0; k < n; ++k)  // b + k * st, in unsigned arithmetic: the sum fits, a partial product may not
      l.push_back(Value::integer(static_cast<int64_t>(static_cast<uint64_t>(b) + k * static_cast<uint64_t>(st))));
    return Value::of_list(std::move(l));
  });
  r.globals["strftime_now"] = Value::function([rp](Args& a, Kwargs&) {
    const std::string fmt = a.empty() ? "" : to_str(a[0]);
    if (rp->strftime_now) return Value::string(rp->strftime_now(fmt));
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[256];
    const size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
    return Value::string(std::string(buf, n));
  });
}

struct Root : Node {
  Body body;
  void run(Scope& sc) const override { run_body(body, sc); }
};

}  // namespace

Template::Template(const std::string& source, std::string name) : name_(std::move(name)) {
  const std::vector<Segment> segs = lex(source, name_);
  auto root = std::make_shared<Root>();
  Parser parser(segs, name_);
  root->body = parser.parse_all();
  has_generation_ = parser.saw_generation();
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

}  // namespace lt::jinja
