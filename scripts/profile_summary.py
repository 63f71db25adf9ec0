#!/usr/bin/env python3
"""Sums a Chrome trace written by `lora_trainer bench --profile` by operator: self time (the time not
spent in nested operators), total time and calls, largest self time first.

    python3 scripts/profile_summary.py PROFILE-full.trace.json [--top 25]
"""
import argparse
import collections
import json


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    with open(a.trace) as f:
        events = json.load(f)
    if isinstance(events, dict):
        events = events.get("traceEvents", [])
    spans = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            spans[e.get("tid")].append((float(e["ts"]), float(e["dur"]), e["name"]))
    self_us, total_us, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for evs in spans.values():
        evs.sort(key=lambda x: (x[0], -x[1]))
        stack = []  # [end, name, child time]
        def pop():
            end, name, child, dur = stack.pop()
            self_us[name] += dur - child
        for ts, dur, name in evs:
            while stack and ts >= stack[-1][0]:
                pop()
            if stack:
                stack[-1][2] += dur
            stack.append([ts + dur, name, 0.0, dur])
            total_us[name] += dur
            calls[name] += 1
        while stack:
            pop()
    all_self = sum(self_us.values())
    print(f"{'operator':48s} {'self ms':>10s} {'self %':>7s} {'total ms':>10s} {'calls':>7s}")
    for name, us in self_us.most_common(a.top):
        print(f"{name[:48]:48s} {us / 1e3:10.1f} {100 * us / all_self:6.1f}% {total_us[name] / 1e3:10.1f} {calls[name]:7d}")
    print(f"{'(all operators, self)':48s} {all_self / 1e3:10.1f}")


if __name__ == "__main__":
    main()
