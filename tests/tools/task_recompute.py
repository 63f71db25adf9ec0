#!/usr/bin/env python3
"""Recomputes `eval --task`'s multiple-choice figures from its own per-token log-probabilities, the way
lm-evaluation-harness computes them, and checks the token split for the byte tokenizer.

    python3 tests/tools/task_recompute.py PER_EXAMPLE.json [--byte]

PER_EXAMPLE.json is what `eval --task FILE --per-example PER_EXAMPLE.json` writes. For every multiple
choice task it re-reads the task file and, per example:
  - each choice's log-likelihood is the sum of its continuation tokens' log-probabilities;
  - the prediction is the argmax of the log-likelihoods (acc) and of the log-likelihoods divided by
    len(choice), the choice's length in Python characters (acc_norm), as lm-evaluation-harness's
    multiple_choice process_results computes them, the first on a tie as numpy's argmax;
  - with --byte (a model of the byte tokenizer: a token a UTF-8 byte, end-of-text 256), the context
    and continuation ids are lm-evaluation-harness's _encode_pair of (question, " " + choice): trailing
    whitespace of the context moved to the continuation, the continuation the tokens of context +
    continuation past those of the context, [256] for an empty context.
Then accuracy and acc_norm over the task. Prints one JSON line a task; exits 1 naming the first
difference.
"""
import json
import sys


def fail(what):
    print("task_recompute.py: " + what, file=sys.stderr)
    sys.exit(1)


def encode_pair_bytes(context, continuation):
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    if context == "":
        return [256], list(continuation.encode("utf-8"))
    whole = list((context + continuation).encode("utf-8"))
    context_enc = list(context.encode("utf-8"))
    return context_enc, whole[len(context_enc):]


def argmax(values):
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    byte = "--byte" in sys.argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    results = json.load(open(args[0]))
    for task in results:
        if task["generation"]:
            continue
        records = [json.loads(line) for line in open(task["file"], encoding="utf-8") if line.strip()]
        if len(records) != len(task["examples"]):
            fail(f"{task['task']}: {len(records)} records, {len(task['examples'])} results")
        right = right_norm = 0
        for n, (record, example) in enumerate(zip(records, task["examples"])):
            choices = record["choices"]
            answer = record["answer"] if isinstance(record["answer"], int) else choices.index(record["answer"])
            lls = []
            for c, (choice, scored) in enumerate(zip(choices, example["choices"])):
                ll = sum(scored["logprobs"])
                if abs(ll - scored["loglikelihood"]) > 1e-9 * max(1.0, abs(ll)):
                    fail(f"{task['task']} example {n} choice {c}: the log-probabilities sum to {ll}, not {scored['loglikelihood']}")
                if len(scored["logprobs"]) != len(scored["continuation"]):
                    fail(f"{task['task']} example {n} choice {c}: {len(scored['logprobs'])} log-probabilities for "
                         f"{len(scored['continuation'])} continuation tokens")
                if byte:
                    context, continuation = encode_pair_bytes(record["question"], " " + choice)
                    if context != scored["context"] or continuation != scored["continuation"]:
                        fail(f"{task['task']} example {n} choice {c}: tokens {scored['context']} | {scored['continuation']}, "
                             f"lm-evaluation-harness's split gives {context} | {continuation}")
                lls.append(ll)
            predicted = argmax(lls)
            predicted_norm = argmax([ll / len(choice) for ll, choice in zip(lls, choices)])
            if predicted != example["predicted"] or predicted_norm != example["predicted_norm"]:
                fail(f"{task['task']} example {n}: predictions {predicted}, {predicted_norm}; eval says "
                     f"{example['predicted']}, {example['predicted_norm']}")
            right += predicted == answer
            right_norm += predicted_norm == answer
        accuracy, accuracy_norm = right / len(records), right_norm / len(records)
        if abs(accuracy - task["accuracy"]) > 1e-12 or abs(accuracy_norm - task["accuracy_norm"]) > 1e-12:
            fail(f"{task['task']}: accuracy {accuracy}, acc_norm {accuracy_norm}; eval says {task['accuracy']}, "
                 f"{task['accuracy_norm']}")
        print(json.dumps({"task": task["task"], "examples": len(records), "accuracy": accuracy, "accuracy_norm": accuracy_norm}))


if __name__ == "__main__":
    main()
