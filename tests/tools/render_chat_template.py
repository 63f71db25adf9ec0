#!/usr/bin/env python3
"""Renders a chat template with Python's jinja2 as transformers' apply_chat_template sets it up, but
without transformers' {% generation %} extension, as a tool that knows only Jinja would: the check that
an export's chat_template.jinja gives the text its job was trained on (tests/formats/test_chat_export.cpp).

  python3 tests/tools/render_chat_template.py REQUEST.json

REQUEST: {"template": FILE, "variables": {"eos_token": ..., ...}, "conversations": [[message, ...], ...]}.
Prints a JSON list of the texts (add_generation_prompt false). Exit 3 when jinja2 is missing (Debian:
python3-jinja2), 1 when a template does not render.
"""
import json
import sys

try:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    print("Python's jinja2 is not installed (Debian: apt-get install python3-jinja2)")
    sys.exit(3)


def main():
    request = json.load(open(sys.argv[1], encoding="utf-8"))

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(open(request["template"], encoding="utf-8").read())
    out = [template.render(messages=m, add_generation_prompt=False, **request.get("variables", {}))
           for m in request["conversations"]]
    print(json.dumps(out, ensure_ascii=False))


if __name__ == "__main__":
    main()
