// Chats with a GGUF model in the real llama.cpp as a user of node-llama-cpp does: a LlamaChatSession
// whose chat wrapper is the template the file carries (tokenizer.chat_template, rendered by
// node-llama-cpp's JinjaTemplateChatWrapper), greedy, each reply ending where llama.cpp's end-of-
// generation tokens say. For the tests to compare with `lora_trainer sample --chat --messages`.
//
//   node tests/tools/llama_cpp_chat.mjs REQUEST.json > RESPONSE.json
//
// REQUEST: {"model": "model.gguf", "max_tokens": N,
//           "conversations": [[{"role": "system"|"user"|"assistant", "content": "..."}, ...], ...]}
//           (each ending with a user message: the one prompted)
// RESPONSE: {"replies": ["...", ...], "template": the file's tokenizer.chat_template, "eos": its
//           tokenizer.ggml.eos_token_id}
// Exits 3 with a note when node-llama-cpp is absent (llama_cpp_package.mjs).
import fs from "node:fs";
import {loadPackage} from "./llama_cpp_package.mjs";

const request = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const {getLlama, LlamaLogLevel, LlamaChatSession, JinjaTemplateChatWrapper} = await loadPackage("llama_cpp_chat.mjs");
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath: request.model});
const tokenizerInfo = model.fileInfo.metadata.tokenizer ?? {};
const template = tokenizerInfo.chat_template;
if (!template) {
    console.error("llama_cpp_chat.mjs: " + request.model + " carries no tokenizer.chat_template");
    process.exit(1);
}
const response = {replies: [], template, eos: tokenizerInfo.ggml?.eos_token_id ?? null};
for (const conversation of request.conversations) {
    const context = await model.createContext({contextSize: 512, threads: 1});
    const chatWrapper = new JinjaTemplateChatWrapper({
        template,
        reasoning: null,                          // the template's own default, as lora_trainer renders it
        trimLeadingWhitespaceInResponses: false,  // the reply as generated
        convertUnsupportedSystemMessagesToUserMessages: false,
    });
    const session = new LlamaChatSession({contextSequence: context.getSequence(), chatWrapper});
    const history = [];
    for (const m of conversation.slice(0, -1)) {
        if (m.role === "system") history.push({type: "system", text: m.content});
        else if (m.role === "user") history.push({type: "user", text: m.content});
        else history.push({type: "model", response: [m.content]});
    }
    session.setChatHistory(history);
    const last = conversation[conversation.length - 1];
    const reply = await session.prompt(last.content, {temperature: 0, maxTokens: request.max_tokens, trimWhitespaceSuffix: false});
    response.replies.push(reply);
    session.dispose();
    await context.dispose();
}
process.stdout.write(JSON.stringify(response));
await model.dispose();
await llama.dispose();
