#!/usr/bin/env python3
"""Checks `tokenize --format chat` against Python's jinja2: text, ids and loss masks of every record.

    python3 scripts/chat_check.py MODEL_DIR CONVERSATIONS.jsonl [--loss-on assistant|last|all] [--binary B]

For each record of CONVERSATIONS.jsonl it compares what `lora_trainer tokenize --format chat --show`
prints with an independent computation:
  text  the conversation rendered by jinja2 set up as transformers' apply_chat_template sets it up
        (scripts/jinja_golden.py's environment, with strftime_now giving today's date as lora_trainer does);
  ids   the project's ids spell that text back byte for byte (tokenizer.json's byte-level alphabet and
        added tokens, decoded here);
  mask  the assistant turns found here by rendering prefixes (or {% generation %} spans), trailing
        whitespace dropped, mapped onto those tokens: a token counts if one of its bytes is in a turn.
Prints one line per mismatch and a summary; exit status 1 on any mismatch. Needs jinja2 (Debian:
python3-jinja2).
"""
import argparse
import json
import os
import subprocess
import sys
from datetime import datetime

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jinja_golden import GEN_END, GEN_START, environment  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def byte_decoder():
    """GPT-2's byte-level alphabet: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(model_dir):
    tok = json.load(open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8"))
    dec = byte_decoder()
    table = {i: bytes(dec[ch] for ch in piece) if all(ch in dec for ch in piece) else piece.encode()
             for piece, i in tok["model"]["vocab"].items()}  # a special token may sit in the vocabulary as it is
    for a in tok.get("added_tokens", []):
        table[a["id"]] = a["content"].encode()
    return table


def chat_template(model_dir):
    path = os.path.join(model_dir, "chat_template.jinja")
    cfg = json.load(open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8"))
    special = {}
    for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = cfg.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            special[k] = v
    if os.path.exists(path):
        return open(path, encoding="utf-8").read(), special
    t = cfg["chat_template"]
    if isinstance(t, list):
        t = next(x["template"] for x in t if x["name"] == "default")
    return t, special


def spans(env, source, special, record, loss_on):
    msgs = record.get("messages") or [{"role": "user", "content": record["prompt"]},
                                      {"role": "assistant", "content": record["completion"]}]
    variables = dict(special, **{k: record[k] for k in ("tools", "documents") if k in record})
    tmpl = env.from_string(source)

    def render(m, gen):
        return tmpl.render(messages=m, add_generation_prompt=gen, **variables)

    marked = render(msgs, False)
    full = marked.replace(GEN_START, "").replace(GEN_END, "").encode()
    if loss_on == "all":
        return full, [(0, len(full))]
    if GEN_START in marked:  # the template's {% generation %} spans
        out, pos, text = [], 0, b""
        while (s := marked.find(GEN_START, pos)) >= 0:
            e = marked.find(GEN_END, s)
            text += marked[pos:s].encode()
            b = len(text)
            text += marked[s + len(GEN_START):e].encode()
            out.append((b, len(text)))
            pos = e + len(GEN_END)
        return full, out[-1:] if loss_on == "last" else out
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if loss_on == "last":
        turns = turns[-1:]
    out = []
    for i in turns:
        before = render(msgs[:i], True).encode() if i else b""
        through = render(msgs[:i + 1], False).encode()
        assert through.startswith(before) and full.startswith(through), "prefixes do not line up"
        e = len(through)
        while e > len(before) and through[e - 1:e].isspace():
            e -= 1
        if e > len(before):
            out.append((len(before), e))
    return full, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("conversations")
    ap.add_argument("--loss-on", default="assistant", choices=["assistant", "last", "all"])
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "lora_trainer"))
    args = ap.parse_args()
    out = subprocess.run([args.binary, "tokenize", args.conversations, "--format", "chat", "--tokenizer", "hf:" + args.model_dir,
                          "--name", "chat_check", "--loss-on", args.loss_on, "--show"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit("chat_check: lora_trainer refused the input:\n" + out.stdout + out.stderr)
    shown = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    records = [json.loads(line) for line in open(args.conversations, encoding="utf-8") if line.strip()]
    env = environment()
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # as lora_trainer: today's date
    source, special = chat_template(args.model_dir)
    table = token_bytes(args.model_dir)
    bad = 0
    for k, (rec, got) in enumerate(zip(records, shown)):
        text, turns = spans(env, source, special, rec, args.loss_on)
        pieces = [table[i] for i in got["ids"]]
        mask, pos = [], 0
        for p in pieces:
            mask.append(int(any(b < pos + len(p) and pos < e for b, e in turns)))
            pos += len(p)
        problems = []
        if got["text"].encode() != text:
            problems.append("text differs from jinja2's")
        if b"".join(pieces) != text:
            problems.append("ids do not spell the text")
        if got["mask"] != mask:
            problems.append("mask differs (%d vs %d tokens counted)" % (sum(got["mask"]), sum(mask)))
        if problems:
            bad += 1
            print("%s: %s" % (got["where"], "; ".join(problems)))
    if len(shown) != len(records):
        bad += 1
        print("chat_check: %d records, %d shown" % (len(records), len(shown)))
    counted = sum(sum(s["mask"]) for s in shown)
    total = sum(len(s["mask"]) for s in shown)
    print("chat_check: %d records, %d tokens, %d counted in the loss (%s): %s" %
          (len(records), total, counted, args.loss_on, "all equal" if not bad else "%d differ" % bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
