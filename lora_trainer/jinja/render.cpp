// The Jinja engine's render (jinja.hpp): how each expression and statement of the syntax tree (ast.hpp)
// runs, and the globals. Values and operators are in value.hpp, filters, tests and methods in builtins.hpp.
#include "lora_trainer/jinja/render.hpp"

#include <algorithm>
#include <ctime>

#include "lora_trainer/jinja/ast.hpp"
#include "lora_trainer/jinja/builtins.hpp"
#include "lora_trainer/jinja/jinja.hpp"
#include "lora_trainer/jinja/limits.hpp"

namespace lt::jinja::detail {

namespace {

// Control flow of {% break %} and {% continue %}.
struct BreakLoop {};
struct ContinueLoop {};

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

void eval_args(const CallArgs& a, Scope& sc, Args& args, Kwargs& kwargs) {
  for (const auto& e : a.args) args.push_back(e->eval(sc));
  for (const auto& [k, e] : a.kwargs) kwargs.emplace_back(k, e->eval(sc));
}

// Assigns `v` to the target names (one name, or a tuple of names unpacking a sequence).
void assign(Scope& sc, const std::vector<std::string>& names, const Value& v) {
  if (names.size() == 1) { sc.set(names[0], v); return; }
  List items = iterate(v);
  if (items.size() != names.size())
    fail("cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(names.size()) + " names");
  for (size_t k = 0; k < names.size(); ++k) sc.set(names[k], items[k]);
}

}  // namespace

// --- expressions ---

Value Literal::do_eval(Scope&) const { return v; }

Value Name::do_eval(Scope& sc) const { return sc.lookup(name); }

Value ListExpr::do_eval(Scope& sc) const {
  List l;
  for (const auto& e : items) l.push_back(e->eval(sc));
  return Value::of_list(std::move(l), tuple);
}

Value DictExpr::do_eval(Scope& sc) const {
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

Value GetAttr::do_eval(Scope& sc) const { return get_attr(obj->eval(sc), attr); }

Value GetItem::do_eval(Scope& sc) const { return get_item(obj->eval(sc), key->eval(sc)); }

Value Slice::do_eval(Scope& sc) const {
  Value v = obj->eval(sc);
  auto ev = [&](const ExprPtr& e) { return e ? e->eval(sc) : Value::none(); };
  return slice(v, ev(start), ev(stop), ev(step));
}

Value Call::do_eval(Scope& sc) const {
  Value f = fn->eval(sc);
  Args args;
  Kwargs kwargs;
  eval_args(a, sc, args, kwargs);
  return call(f, args, kwargs);
}

Value Filter::do_eval(Scope& sc) const {
  Value v = value->eval(sc);
  Args args;
  Kwargs kwargs;
  eval_args(a, sc, args, kwargs);
  return f(std::move(v), args, kwargs);
}

Value Test::do_eval(Scope& sc) const {
  Value v = value->eval(sc);
  Args args;
  Kwargs kwargs;
  eval_args(a, sc, args, kwargs);
  return Value::boolean(f(v, args) != negated);
}

Value Unary::do_eval(Scope& sc) const {
  Value v = e->eval(sc);
  if (op == '!') return Value::boolean(!truthy(v));
  if (v.is_undefined()) undefined_error(v);
  if (!v.is_number()) fail(std::string("bad operand type for unary ") + op + ": '" + type_name(v) + "'");
  if (v.kind == Value::Kind::Float) return Value::real(op == '-' ? -v.f : v.f);
  if (op == '-') return binary("-", Value::integer(0), v);  // -(-2**63) overflows
  return Value::integer(v.integer_value());
}

Value Binary::do_eval(Scope& sc) const {
  if (op == "and") { Value x = l->eval(sc); return truthy(x) ? r->eval(sc) : x; }
  if (op == "or") { Value x = l->eval(sc); return truthy(x) ? x : r->eval(sc); }
  return binary(op, l->eval(sc), r->eval(sc));
}

Value Conditional::do_eval(Scope& sc) const {
  if (truthy(cond->eval(sc))) return yes->eval(sc);
  return no ? no->eval(sc) : Value::undefined();
}

// --- statements ---

void TextNode::run(Scope& sc) const {
  at_line(sc, line, [&] { write(*sc.r, text); });
}

void OutputNode::run(Scope& sc) const {
  at_line(sc, line, [&] { write(*sc.r, to_str(e->eval(sc))); });
}

void IfNode::run(Scope& sc) const {
  for (const auto& [cond, body] : branches) {
    bool take = true;
    if (cond) at_line(sc, line, [&] { take = truthy(cond->eval(sc)); });
    if (take) { run_body(body, sc); return; }
  }
}

void ForNode::run(Scope& sc) const {
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

void SetNode::run(Scope& sc) const {
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

void FilterBlockNode::run(Scope& sc) const {
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

void LoopControl::run(Scope&) const {
  if (is_break) throw BreakLoop{};
  throw ContinueLoop{};
}

void GenerationNode::run(Scope& sc) const {
  const size_t begin = sc.r->out.size();
  run_body(body, sc);
  sc.r->generation.emplace_back(begin, sc.r->out.size());
}

void MacroNode::run(Scope& sc) const {
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

void Root::run(Scope& sc) const { run_body(body, sc); }

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

}  // namespace lt::jinja::detail
