#!/usr/bin/env python3
"""The Jinja engine's reference renders (tests/data/chat_templates/), made with Python's jinja2.

    python3 scripts/jinja_golden.py            # write conversations.jsonl, golden.jsonl, probes.jsonl
    python3 scripts/jinja_golden.py --check    # render again and compare with the files (exit 1 if not equal)

jinja2 is set up as transformers' apply_chat_template sets it up (ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks and the loop controls; its tojson; raise_exception; strftime_now), with
strftime_now fixed to one date so that renders are reproducible, and {% generation %} recording the
assistant spans as transformers' AssistantTracker does. Needs jinja2 (Debian: python3-jinja2).

Files written (tests/jinja/test_jinja.cpp reads them):
  conversations.jsonl  60 generated conversations (messages, tools, documents, add_generation_prompt,
                       enable_thinking): systems, several turns, tool calls, reasoning, Unicode,
                       whitespace, quotes; some break a template's rules on purpose.
  golden.jsonl         for every template x conversation: the rendered text's CRC-32 and length in
                       UTF-8 bytes, the {% generation %} spans as byte offsets, or the error (the
                       message when the template raised it).
  probes.jsonl         one-line templates over a fixed context, each with its full text or error.
"""
import argparse
import json
import os
import random
import sys
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIR = os.path.join(ROOT, "tests", "data", "chat_templates")
NOW = "26 Nov 2026"
N_CONVERSATIONS = 60

try:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    sys.exit("jinja_golden.py: needs Python's jinja2 (Debian: apt-get install python3-jinja2)")

GEN_START, GEN_END = "\x00gen<", "\x00gen>"


class Generation(Extension):
    """{% generation %}...{% endgeneration %}: renders the body and marks where it is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        return GEN_START + caller() + GEN_END


def environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: NOW
    return env


def render(env, source, context):
    """{"bytes", "crc32", "generation"} or {"error": message or None (not raised by the template)}."""
    try:
        marked = env.from_string(source).render(**context)
    except jinja2.exceptions.TemplateError as e:
        raised = type(e) is jinja2.exceptions.TemplateError  # raise_exception's; syntax/undefined errors are subclasses
        return {"error": str(e) if raised else None}
    except Exception:  # TypeError and the like, from the template's own operations
        return {"error": None}
    text, spans, pos = b"", [], 0
    while True:
        s = marked.find(GEN_START, pos)
        if s < 0:
            text += marked[pos:].encode()
            break
        e = marked.find(GEN_END, s)
        text += marked[pos:s].encode()
        begin = len(text)
        text += marked[s + len(GEN_START):e].encode()
        spans.append([begin, len(text)])
        pos = e + len(GEN_END)
    return {"text": text.decode(), "bytes": len(text), "crc32": zlib.crc32(text), "generation": spans}


# --- conversations -------------------------------------------------------------------------------

TEXTS = [
    "Hello!", "What is 2 + 2?", "  leading and trailing spaces  ", "Line one\nLine two\n\nLine four",
    "Quotes: \"double\" and 'single' and `back`", "Ünïcödé: café, naïve, 東京, emoji 😀, RTL שלום",
    "A backslash \\ and a tab\there", "<b>markup</b> & entities &amp; <|im_end|> look-alikes",
    "Write a Python function:\n```python\ndef f(x):\n    return x * 2\n```", "", "   ", "{\"json\": [1, 2, {\"a\": null}]}",
    "Sure. The answer is 4.", "I can't help with that.", "Long " + "text " * 40, "Trailing newline\n",
]
THINK = ["<think>\nLet me think.\n</think>\n\nThe answer is 4.", "<think>short</think>Done.", "No thinking here."]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather \"now\" in a city – ünïcode",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City"},
                                                          "days": {"type": "integer"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers",
          "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
DOCUMENTS = [{"title": "Doc one", "text": "Paris is the capital of France."}, {"title": "Zwei", "text": "Über Berlin."}]


def conversation(rng, k):
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": rng.choice(["You are helpful.", "Be brief.\nAnswer in French.", TEXTS[5]])})
    turns = rng.randint(1, 4)
    with_tools = rng.random() < 0.25
    for t in range(turns):
        msgs.append({"role": "user", "content": rng.choice(TEXTS)})
        last = t == turns - 1
        if last and rng.random() < 0.4:
            break  # ends on the user: a prompt for generation
        if with_tools and rng.random() < 0.5:
            args = {"city": "Paris", "days": 2} if rng.random() < 0.5 else "{\"city\": \"Paris\"}"
            msgs.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": "c%08d" % k, "type": "function", "function": {"name": "get_weather", "arguments": args}}]})
            msgs.append({"role": "tool", "name": "get_weather", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"})
        m = {"role": "assistant", "content": rng.choice(TEXTS + THINK)}
        if rng.random() < 0.15:
            m["reasoning_content"] = "Step 1: think.\nStep 2: answer."
        msgs.append(m)
    if rng.random() < 0.08:  # against the rules of templates that check alternation
        msgs.insert(len(msgs) - 1 if len(msgs) > 1 else 0, {"role": "user", "content": "Two users in a row"})
    ctx = {"messages": msgs, "add_generation_prompt": msgs[-1]["role"] != "assistant" and rng.random() < 0.8}
    if with_tools:
        ctx["tools"] = TOOLS
    if rng.random() < 0.15:
        ctx["documents"] = DOCUMENTS
    r = rng.random()
    if r < 0.2:
        ctx["enable_thinking"] = False
    elif r < 0.3:
        ctx["enable_thinking"] = True
    return ctx


# --- probes: one-line templates over PROBE_CONTEXT -----------------------------------------------

PROBE_CONTEXT = {"s": "  Hello World  ", "n": None, "t": True, "f": 1.0, "i": 7, "big": 12345678901234567890, "e": 1e-7,
                 "lst": [3, 1, 2], "d": {"b": 1, "a": [1, "x", None, True], "c": {"z": 2.5}},
                 "msgs": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "tool_calls": []}],
                 "u": "ünï \"q\" 'a' \\ </s> \u2028 \x01 😀", "empty": "", "zero": 0}

PROBES = [
    "{{ n }}|{{ t }}|{{ f }}|{{ i }}", "{{ undefined_var }}|", "{{ lst }}", "{{ d }}", "{{ d|string }}", "{{ u }}",
    "{{ d|tojson }}", "{{ d|tojson(indent=2) }}", "{{ d|tojson(separators=(',', ':')) }}", "{{ d|tojson(sort_keys=true) }}",
    "{{ u|tojson }}", "{{ u|tojson(ensure_ascii=true) }}", "{{ f|tojson }}", "{{ e|tojson }}", "{{ big|tojson }}", "{{ 1e20|tojson }}",
    "{{ 0.1+0.2 }}", "{{ 2.5e-5 }}", "{{ 100.0 }}", "{{ 3/2 }}", "{{ 7//2 }}", "{{ 7%3 }}", "{{ -7//2 }}", "{{ -7%3 }}", "{{ 2**10 }}",
    "{{ 1.0 }}|{{ 0.5 }}|{{ 1/3 }}|{{ 10/2 }}|{{ 1e100 }}|{{ 123456789.123 }}|{{ 1e16 }}|{{ 1e15 }}|{{ 0.0001 }}|{{ 0.00001 }}",
    "{{ f * 3 }}|{{ 3.0|string }}|{{ 1.10 }}", "{{ n|tojson }}|{{ t|tojson }}",
    "{{ s|trim }}|{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ s.strip(' H') }}",
    "{{ s.split() }}|{{ 'a,b,,c'.split(',') }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a.b.c'.rsplit('.', 1) }}|{{ ' a  b '.split(None, 1) }}|{{ '  a  b '.rsplit(None, 1) }}|{{ 'a,b,c'.rsplit(',') }}",
    "{{ s.startswith('  He') }}|{{ s.endswith('d  ') }}|{{ 'abc'.startswith(('x','a')) }}",
    "{{ 'hello'.upper() }}|{{ 'HeLLo'.lower() }}|{{ 'hello world'.title() }}|{{ 'hello'.capitalize() }}|{{ 'a-b'.replace('-', '+') }}",
    "{{ 'abc'.find('c') }}|{{ 'aaa'.count('a') }}|{{ '12'.isdigit() }}|{{ 'x=%s' % 'y' }}|{{ '%s-%d' % ('a', 3) }}|{{ '{}-{}'.format(1,2) }}|{{ '{a}!'.format(a='b') }}",
    "{{ lst|length }}|{{ u|length }}|{{ d|length }}|{{ lst|first }}|{{ lst|last }}|{{ lst|sort }}|{{ lst|reverse|list }}|{{ lst|sum }}|{{ lst|max }}|{{ lst|min }}",
    "{{ lst|join(', ') }}|{{ lst|map('string')|join }}|{{ msgs|map(attribute='role')|list }}|{{ msgs|selectattr('role','equalto','user')|list|length }}",
    "{{ msgs|rejectattr('role','equalto','user')|list|length }}|{{ msgs|selectattr('tool_calls','defined')|list|length }}|{{ msgs|selectattr('tool_calls','undefined')|list|length }}",
    "{{ msgs|selectattr('tool_calls')|list|length }}|{{ lst|select('odd')|list }}|{{ lst|reject('even')|list }}|{{ [1,1,2]|unique|list }}",
    "{{ d|items|list }}|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{{ d.keys()|list }}|{{ d.values()|list|length }}|{{ d.get('zz', 'dflt') }}|{{ d.get('b') }}",
    "{{ d|dictsort }}|{{ n|default('dflt') }}|{{ undefined_var|default('dflt') }}|{{ empty|default('dflt', true) }}|{{ '42'|int + 1 }}|{{ 3.7|int }}|{{ 2|float }}|{{ -3|abs }}|{{ 2.567|round(1) }}",
    "{{ lst[::-1] }}|{{ lst[1:] }}|{{ lst[-1] }}|{{ 'abcdef'[1:3] }}|{{ 'abc'[::-1] }}|{{ u[:3] }}|{{ lst[5] }}|{{ lst[:-1] }}|{{ 'abcdef'[::2] }}",
    "{{ 'x' ~ 1 ~ n }}|{{ 'a' + 'b' }}|{{ 'ab' * 2 }}|{{ 'a' in 'cat' }}|{{ 2 in lst }}|{{ 'b' in d }}|{{ 'q' not in d }}",
    "{{ 'yes' if t }}|{{ 'yes' if not t }}|{{ 'y' if t else 'n' }}|{{ n is none }}|{{ undefined_var is defined }}|{{ n is defined }}|{{ n is not none }}",
    "{{ s is string }}|{{ lst is string }}|{{ d is mapping }}|{{ lst is mapping }}|{{ s is iterable }}|{{ d is iterable }}|{{ i is number }}|{{ t is boolean }}|{{ lst is sequence }}|{{ i is integer }}|{{ f is float }}",
    "{{ t is true }}|{{ zero is false }}|{{ i is odd }}|{{ i is even }}|{{ i is divisibleby(7) }}|{{ 1 is in lst }}|{{ 'a' is eq 'a' }}|{{ i is gt 3 }}",
    "{% set ns = namespace(x=1, y='a') %}{% for m in msgs %}{% set ns.x = ns.x + 1 %}{% endfor %}{{ ns.x }}{{ ns.y }}",
    "{% for m in msgs %}{% if loop.first %}F{% endif %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.length }}{% if loop.last %}L{% endif %}{% endfor %}",
    "{% for x in lst %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "{% for x in lst if x > 1 %}{{ x }}{{ loop.index }}{% else %}none{% endfor %}|{% for x in [] %}{{ x }}{% else %}EMPTY{% endfor %}",
    "{% for x in n %}{{ x }}{% endfor %}OK",
    "{% macro m(a, b='B') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}",
    "{% set x %}captured {{ i }}{% endset %}{{ x }}|{% filter upper %}abc{% endfilter %}",
    "{% set a, b = [1, 2] %}{{ a }}{{ b }}|{% set lst2 = lst + [9] %}{{ lst2 }}",
    "{{ raise_exception('boom') }}", "{{ strftime_now('%Y') }}", "{{ lst.append(4) }}",
    "{{ msgs[0].content }}|{{ msgs[0]['role'] }}|{{ msgs[5] }}|{{ d.nokey }}|{{ d.nokey is defined }}",
    "{{ n.content }}", "{{ undefined_var.content }}", "{{ undefined_var + 1 }}",
    "  {% if t %}\n  A\n  {% endif %}\n  {{ i }}\n{# c #}\n  B{%- if t -%}  C  {%- endif %}\nD\n",
    "A\n  {{ i }}\n", "  {{ i }}", "{% if t %}\n  {{ i }}{% endif %}", "x\n    {% if t %}y{% endif %}\n", "x {%+ if t %}y{% endif %}",
    "{% if t %}a{% endif +%}\nb", "{% raw %}{{ not rendered }}{% endraw %}", "line\r\nbreaks\r\n{{ i }}\r\n",
    "{% generation %}gen{% endgeneration %}",
    "{{ {'k': 1, 'j': none}|tojson }}|{{ [1, 'two']|tojson }}|{{ ('a', 'b') }}|{{ ('a',) }}|{{ {'a': 1} }}",
    "{{ '\\n'.join(['a','b']) }}|{{ 'line1\\nline2' }}|{{ \"dq\\\"\" }}|{{ '\\u00e9' }}|{{ '\\t' }}",
    "{{ 1 == 1.0 }}|{{ 'a' < 'b' }}|{{ not '' }}|{{ [] == [] }}|{{ none == none }}|{{ t and 'x' }}|{{ n or 'alt' }}",
    "{{ u|upper }}|{{ 'é'|upper }}|{{ 'ÀÉÎ'|lower }}|{{ 'straße'|upper }}|{{ 'ΑΒΓ'|lower }}|{{ 'привет'|upper }}",
    "{{ lst|batch(2)|list }}|{{ 'a b'|wordcount }}|{{ ' x '|center(7) }}|{{ 'ab'|center(5) }}",
    "{{ d|tojson(indent=2) }}|{{ [1,[2,{'a':[]}],{}]|tojson(indent=2) }}|{{ {}|tojson }}|{{ []|tojson }}",
    "{{ msgs|selectattr('role', 'eq', 'user')|list|length }}|{{ msgs|map(attribute='missing')|list }}|{{ msgs[0].get('content') }}",
    "{%- for m in msgs -%}\n  {{- m.role -}}\n{%- endfor -%}", "{{ -i }}|{{ i > 3 and i < 10 }}|{{ (i ~ '') | length }}",
    "{{ range(3)|list }}|{{ range(1,6,2)|list }}|{% for i in range(2) %}{{ i }}{% endfor %}",
    "{% for a in [[1,2],[3,4]] %}{% for b in a %}{{ loop.index }}{% endfor %}{{ loop.index }}{% endfor %}",
    "{% for m in msgs %}{{ loop.previtem is defined }}{{ loop.nextitem is defined }}{{ loop.cycle('a','b') }}{% endfor %}",
    "{{ t is sameas true }}|{{ 'abc' is lower }}|{{ n | string }}|{{ none }}{{ None }}{{ True }}{{ true }}",
    "{{ s|indent(2) }}|{{ 'a\\nb\\n\\nc'|indent(2, true) }}|{{ 'a\\nb'|indent }}",
    "{{ lst|sort(reverse=true) }}|{{ ['b','A','c']|sort }}|{{ ['b','A','c']|sort(case_sensitive=true) }}|{{ msgs|sort(attribute='role')|map(attribute='role')|join(',') }}",
    "{{ 'a' 'b' }}|{{ [1,2,3][1] }}|{{ {'a':{'b':3}}['a']['b'] }}|{{ (1 + 2) * 3 }}|{{ 2 ** 3 ** 2 }}|{{ 10 - 2 - 3 }}",
    "{{ 'abc' ~ 5 * 2 }}|{{ 1 if zero else 2 if t else 3 }}|{{ not t or t }}|{{ lst|length > 2 }}",
    "{{ }}", "{% if %}x{% endif %}", "{% for x in lst %}", "{% endif %}", "{{ x|nosuchfilter }}", "{{ x is nosuchtest }}", "{{ 'unclosed }}",
    # Macros see themselves and the template's top level as it is when they are called (closures over
    # the frames around their definition): recursion, mutual recursion, later definitions and sets.
    "{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * fact(n - 1)|int }}{% endif %}{% endmacro %}{{ fact(10) }}",
    "{% set tree = {'name': 'a', 'children': [{'name': 'b', 'children': []}, {'name': 'c', 'children': [{'name': 'd', 'children': []}]}]} %}"
    "{% macro walk(node, depth=0) %}{{ '-' * depth }}{{ node.name }};{% for c in node.children %}{{ walk(c, depth + 1) }}{% endfor %}{% endmacro %}{{ walk(tree) }}",
    "{% macro a(n) %}{{ n }}{% if n %}{{ b(n - 1) }}{% endif %}{% endmacro %}{% macro b(n) %}[{{ a(n) }}]{% endmacro %}{{ a(3) }}",
    "{% macro f() %}{{ x }}{% endmacro %}{% set x = 1 %}{{ f() }}{% set x = 2 %}{{ f() }}|{% macro g() %}{{ h() }}{% endmacro %}{% macro h() %}H{% endmacro %}{{ g() }}",
    "{% for i in [1, 2] %}{% macro f(n) %}{{ i }}{% if n %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(2) }}{% endfor %}",
    "{% macro f() %}{{ x }}{% endmacro %}{% for x in [5] %}{{ f() }}{% endfor %}|{% set x = 5 %}{% macro g(x) %}{{ x }}{% endmacro %}{{ g(1) }}{{ x }}",
    "{% macro outer() %}{% macro inner(n) %}{{ n }}{% if n %}{{ inner(n - 1) }}{% endif %}{% endmacro %}{{ inner(2) }}{% endmacro %}{{ outer() }}",
    "{% for i in [1] %}{% set x = 1 %}{% macro f() %}{{ x }}{% endmacro %}{% set x = 2 %}{{ f() }}{% endfor %}",
    "{% macro f(n) %}{% set y = n %}{% if n %}{{ f(n - 1) }}{% endif %}{{ y }}{% endmacro %}{{ f(3) }}",
    "{% macro f(n) %}{% if n < 150 %}{{ f(n + 1) }}{% else %}{{ n }}{% endif %}{% endmacro %}{{ f(0) }}",
    "{% for i in [1, 2] %}{% macro f() %}{{ i }}{% endmacro %}{% endfor %}{{ f() }}",
    # float overflow and 0 to a negative power are errors in Python, not inf
    "{{ 10.0 ** 400 }}", "{{ 2 ** 10000.0 }}", "{{ 0 ** -1 }}", "{{ 0.0 ** -2 }}", "{{ 2 ** -1 }}|{{ 2.0 ** 0.5 }}",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare fresh renders with the files instead of writing them")
    args = ap.parse_args()
    env = environment()
    templates = sorted(f[:-6] for f in os.listdir(DIR) if f.endswith(".jinja"))
    special = json.load(open(os.path.join(DIR, "special_tokens.json"), encoding="utf-8"))
    rng = random.Random(20261126)
    conversations = [conversation(rng, k) for k in range(N_CONVERSATIONS)]
    golden = []
    for name in templates:
        source = open(os.path.join(DIR, name + ".jinja"), encoding="utf-8").read()
        for k, ctx in enumerate(conversations):
            r = render(env, source, dict(ctx, **special.get(name, {})))
            r.pop("text", None)
            golden.append(dict({"template": name, "conversation": k}, **r))
    probes = []
    for p in PROBES:
        try:
            r = render(env, p, PROBE_CONTEXT)
        except jinja2.exceptions.TemplateSyntaxError:
            r = {"error": None}
        probes.append(dict({"template": p}, **r))
    files = {"conversations.jsonl": conversations, "golden.jsonl": golden, "probes.jsonl": probes}
    files["probe_context.json"] = None
    bad = 0
    for fname, rows in files.items():
        path = os.path.join(DIR, fname)
        text = json.dumps(PROBE_CONTEXT, ensure_ascii=False) + "\n" if rows is None else \
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        if args.check:
            old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
            if old != text:
                bad += 1
                print(f"jinja_golden: {fname} differs from jinja2 {jinja2.__version__}'s renders", file=sys.stderr)
        else:
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
    ok = sum(1 for g in golden if "error" not in g)
    print(f"jinja_golden: {len(templates)} templates x {len(conversations)} conversations: {ok} rendered, "
          f"{len(golden) - ok} raised; {len(probes)} probes; jinja2 {jinja2.__version__}" + (" — all equal" if args.check and not bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
