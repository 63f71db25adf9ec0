// The Jinja engine's parser (jinja.hpp): a template's segments and tags (lexer.hpp) to its syntax tree
// (ast.hpp). A construct outside the subset chat templates use is refused here, naming the line.
#include "lora_trainer/jinja/parser.hpp"

#include <algorithm>
#include <initializer_list>
#include <sstream>

#include "lora_trainer/jinja/builtins.hpp"
#include "lora_trainer/jinja/jinja.hpp"
#include "lora_trainer/jinja/value.hpp"

namespace lt::jinja::detail {

namespace {

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

}  // namespace

Parsed parse(const std::vector<Segment>& segs, const std::string& name) {
  Parser parser(segs, name);
  Parsed parsed;
  parsed.body = parser.parse_all();
  parsed.has_generation = parser.saw_generation();
  return parsed;
}

}  // namespace lt::jinja::detail
