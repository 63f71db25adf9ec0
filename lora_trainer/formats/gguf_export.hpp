// A checkpoint's model, or its LoRA adapter, as GGUF files for llama.cpp (and ollama, LM Studio and
// the other tools built on it), written as llama.cpp's own converters (convert_hf_to_gguf.py,
// convert_lora_to_gguf.py) write them:
//
//   export --format gguf          OUT/model.gguf: the weights with any adapters merged, the
//                                 architecture's hyperparameters and the tokenizer
//   export --format gguf-adapter  OUT/adapter.gguf: a LoRA checkpoint's adapters alone, to load over
//                                 the base's model.gguf (llama.cpp --lora, ollama's ADAPTER)
//
// Architectures: our gpt2 family is llama.cpp's "gpt2"; the llama family is "llama" (Llama, Mistral),
// or "qwen2" when q/k/v have biases. Tensor names are llama.cpp's (token_embd, blk.N.attn_q, ...). Its
// "llama" architecture rotates interleaved pairs where transformers rotates halves, so the rows of q
// and k (and of their adapters' B) are permuted per head as the converter permutes them; "qwen2"
// rotates halves and takes them as they are. One-dimensional tensors (norms, biases) are float32, as
// the converter writes them; the rest float32, float16 or bfloat16.
//
// The tokenizer (tokenizer.ggml.*: model "gpt2", i.e. byte-level BPE) comes from the tokenizer the
// model reads text with: its tokens (as byte-level strings), token types, merges, the pre-tokenizer by
// llama.cpp's name for it (gpt-2, llama-bpe, qwen2), end-of-text and beginning-of-text ids. Ids the
// tokenizer lacks up to the model's vocabulary size are "[PADn]" tokens of type unused, as the converter
// pads them.
//
// An adapter file: general.type "adapter", adapter.type "lora", adapter.lora.alpha, and for each
// adapted weight W (ne [in, out]) W's name + ".lora_a" (ne [in, r]: PEFT's lora_A) and + ".lora_b"
// (ne [r, out]: lora_B); llama.cpp adds (alpha / r) * lora_b(lora_a(x)) at scale 1. rsLoRA's
// alpha / sqrt(r) is written as alpha * sqrt(r). DoRA, modules_to_save and trainable tokens have no
// llama.cpp adapter form: such a checkpoint is refused (export --format gguf merges them), as is one
// without adapters, and (model and adapter alike) a llama-family model whose activation is not SiLU.
#pragma once

#include <functional>
#include <string>

namespace lt {

struct GgufExportOptions {
  bool use_ema = false, force = false;
  std::string base;              // export --base: where a referenced frozen base is now
  std::string dtype = "source";  // source (the stored base's), float32, float16, bfloat16
  std::string tokenizer = "auto";  // auto, byte, gpt2, hf:DIR (model.gguf only)
  // model.gguf only: run on the written file before OUT takes it (export --check); what it throws
  // leaves OUT as it was.
  std::function<void(const std::string& model_gguf)> check;
};

// Writes OUT/model.gguf (and the export marker). Refuses, naming what and writing nothing: a
// tokenizer with more tokens than the model's vocabulary, a pre-tokenizer llama.cpp has no name for,
// `auto` where nothing tells the model's tokenizer (tokenizer_choice.hpp), a value the dtype cannot
// hold (export_cast).
void export_gguf(const std::string& checkpoint, const std::string& out, const GgufExportOptions& o);
// Writes OUT/adapter.gguf (and the marker) from a LoRA checkpoint.
void export_gguf_adapter(const std::string& checkpoint, const std::string& out, const GgufExportOptions& o);

}  // namespace lt
