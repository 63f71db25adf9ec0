// node-llama-cpp (the real llama.cpp, prebuilt), for the scripts of this folder: looked up from
// $LT_LLAMA_CPP_DIR (a directory holding node_modules/node-llama-cpp: scripts/fetch_llama_cpp.sh installs
// it in datasets/cache/llama_cpp), else the usual module path. Exits 3 with a note when it is absent.
import path from "node:path";
import {createRequire} from "node:module";
import {pathToFileURL} from "node:url";

export async function loadPackage(script) {
    const dirs = [process.env.LT_LLAMA_CPP_DIR, path.resolve(path.dirname(new URL(import.meta.url).pathname), "../../datasets/cache/llama_cpp")]
        .filter(Boolean);
    for (const dir of dirs) {
        try {
            const require = createRequire(path.join(dir, "package.json"));
            return await import(pathToFileURL(require.resolve("node-llama-cpp")).href);
        } catch (e) {
            // try the next place
        }
    }
    try {
        return await import("node-llama-cpp");
    } catch (e) {
        console.error(`${script}: node-llama-cpp is not installed (bash scripts/fetch_llama_cpp.sh installs it)`);
        process.exit(3);
    }
}
