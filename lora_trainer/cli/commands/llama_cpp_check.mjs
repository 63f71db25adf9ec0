// The llama.cpp side of `check-export` / `export --format gguf --check` (export_check.hpp): the real
// llama.cpp, prebuilt in the npm package node-llama-cpp, reads the exported model.gguf as a user's
// llama.cpp chat does and reports what it computes. The launcher carries this file in its binary, writes
// it into a temporary directory and runs it with node:
//
//   node llama_cpp_check.mjs REQUEST.json > RESPONSE.json
//
// REQUEST: {"model": "OUT/model.gguf", "package_dirs": [directories holding node_modules/node-llama-cpp],
//           "threads": N, "stops": [end-of-turn ids], "logits": "FILE",
//           "cases": [{"messages": [{"role", "content"}, ...]  (a conversation: rendered through the file's
//                                                               own tokenizer.chat_template)
//                      or "text": "..."                         (a plain prompt: tokenized as it is),
//                      "sequence": [ids], "first": K}]}
// RESPONSE: {"template": the file's tokenizer.chat_template or null, "vocab_size": V, "system_info",
//            "eog": [for each stop id: whether llama.cpp ends a generation at it],
//            "cases": [{"prompt_tokens": [ids: the prompt as llama.cpp's chat renders and tokenizes it]}]}
//            and FILE: the next-token logits after each position K.. of each case's sequence, float32
//            rows of V, the cases one after another.
// {"probe": true, "package_dirs": [...]} only asks whether node-llama-cpp loads (exit 0, else 4).
// Exit status 4 with a line on stderr when node-llama-cpp is not installed in any of the places; 1 with
// a line saying what failed when llama.cpp cannot read the file or its chat cannot use its template.
import fs from "node:fs";
import path from "node:path";
import {createRequire} from "node:module";
import {pathToFileURL} from "node:url";

const request = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));

async function loadPackage() {
    for (const dir of request.package_dirs) {
        try {
            const require = createRequire(path.join(path.resolve(dir), "package.json"));
            return await import(pathToFileURL(require.resolve("node-llama-cpp")).href);
        } catch (e) {
            // the next place
        }
    }
    try {
        return await import("node-llama-cpp");
    } catch (e) {
        console.error("node-llama-cpp is not installed in " + request.package_dirs.join(", ") + " nor on node's module path");
        process.exit(4);
    }
}

const {getLlama, LlamaLogLevel, JinjaTemplateChatWrapper} = await loadPackage();
if (request.probe) process.exit(0);  // only whether the package is there: before the launcher's own work
// What failed, in one line (the first of the error's message), for the launcher's message.
function fail(what, e) {
    console.error(what + ": " + String(e?.message ?? e).split("\n")[0]);
    process.exit(1);
}
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath: request.model}).catch((e) => fail("llama.cpp could not load the file", e));
const template = model.fileInfo.metadata.tokenizer?.chat_template ?? null;
const longest = Math.max(1, ...request.cases.map((c) => c.sequence.length));
const context = await model.createContext({
    contextSize: Math.max(64, longest + 8),
    batchSize: Math.max(64, longest + 8),
    threads: request.threads,
});
const sequence = context.getSequence();
const response = {template, vocab_size: null, system_info: llama.systemInfo, eog: request.stops.map((t) => model.isEogToken(t)),
                  cases: []};
const logits = fs.openSync(request.logits, "w");
for (const c of request.cases) {
    let promptTokens;
    if (c.messages) {
        if (template == null) {
            console.error(request.model + " carries no tokenizer.chat_template: llama.cpp's chat cannot render the conversation");
            process.exit(5);
        }
        // As a LlamaChatSession renders a prompt: the history, the user's message, the model's turn opened.
        let contextText;
        try {
            const wrapper = new JinjaTemplateChatWrapper({
                template,
                reasoning: null,
                trimLeadingWhitespaceInResponses: false,
                convertUnsupportedSystemMessagesToUserMessages: false,
            });
            const history = c.messages.map((m) => m.role === "system" ? {type: "system", text: m.content}
                : m.role === "user" ? {type: "user", text: m.content} : {type: "model", response: [m.content]});
            history.push({type: "model", response: []});
            contextText = wrapper.generateContextState({chatHistory: history}).contextText;
        } catch (e) {
            fail("llama.cpp's chat (node-llama-cpp's JinjaTemplateChatWrapper) cannot use the file's tokenizer.chat_template", e);
        }
        promptTokens = Array.from(contextText.tokenize(model.tokenizer));
    } else {
        promptTokens = Array.from(model.tokenize(c.text, true));
    }
    response.cases.push({prompt_tokens: promptTokens});
    await sequence.clearHistory();
    const out = await sequence.controlledEvaluate(c.sequence.map((t, i) => i >= c.first ? [t, {generateNext: {logits: true}}] : t));
    for (let i = c.first; i < c.sequence.length; ++i) {
        const next = out[i].next.logits;  // Map token -> logit, every token of the vocabulary
        const row = new Float32Array(next.size);
        for (const [token, value] of next) row[token] = value;
        response.vocab_size = row.length;
        fs.writeSync(logits, Buffer.from(row.buffer));
    }
}
fs.closeSync(logits);
process.stdout.write(JSON.stringify(response));
await context.dispose();
await model.dispose();
await llama.dispose();
