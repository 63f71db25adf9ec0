// Runs GGUF files in the real llama.cpp (the prebuilt one of the npm package node-llama-cpp) and prints
// what it computes, for the tests to compare with lora_trainer's own numbers.
//
//   node tests/tools/llama_cpp_logits.mjs REQUEST.json > RESPONSE.json
//
// REQUEST: {"model": "model.gguf", "adapter": "adapter.gguf" (optional), "sequences": [[ids...], ...],
//           "texts": ["...", ...] (optional)}
// RESPONSE: {"logits": [sequence][position][vocab] (the next-token logits after each position, as
//           llama.cpp's context computes them, the adapter applied at scale 1 where given),
//           "tokens": [[ids...], ...] (llama.cpp's tokenization of each text: added and special tokens in
//           it matched, as transformers matches them; no BOS added)
// node-llama-cpp: llama_cpp_package.mjs. Exits 3 with a note when the package is absent.
import fs from "node:fs";
import {loadPackage} from "./llama_cpp_package.mjs";

const request = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const {getLlama, LlamaLogLevel} = await loadPackage("llama_cpp_logits.mjs");
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath: request.model});
const longest = Math.max(1, ...(request.sequences ?? []).map((s) => s.length));
const context = await model.createContext({
    contextSize: Math.max(64, longest + 8),
    batchSize: Math.max(64, longest + 8),
    threads: 1,
    lora: request.adapter ? {adapters: [{filePath: request.adapter, scale: 1}]} : undefined,
});
const response = {logits: [], tokens: [], vocab_size: null, system_info: llama.systemInfo};
const sequence = context.getSequence();
for (const ids of request.sequences ?? []) {
    await sequence.clearHistory();
    const out = await sequence.controlledEvaluate(ids.map((t) => [t, {generateNext: {logits: true}}]));
    const rows = out.map((o) => {
        const logits = o.next.logits;  // Map token -> logit, every token of the vocabulary
        const row = new Array(logits.size);
        for (const [token, value] of logits) row[token] = value;
        return row;
    });
    response.vocab_size = rows[0]?.length ?? null;
    response.logits.push(rows);
}
// Added and special tokens in the text are matched, as transformers matches them; no BOS is added.
for (const text of request.texts ?? []) response.tokens.push(Array.from(model.tokenize(text, true)));
process.stdout.write(JSON.stringify(response));
await context.dispose();
await model.dispose();
await llama.dispose();
