// The launcher's subcommands: each file of this folder adds one to the CLI11 app (`add_<command>`),
// owning the values its options parse into, and returns how to run it. main.cpp parses, runs the one
// given and maps errors to exit codes. These files are the program's, not the library's: only they
// use CLI11.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace lt {

class Trainer;
class RestorableJob;

// A subcommand as added to the app: its parsed state lives in the closure; run() returns the exit status.
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

// In the order `lora_trainer --help` lists them.
Command add_jobs(CLI::App& app);
Command add_configure(CLI::App& app);
Command add_run(CLI::App& app, const std::string& program);  // program: argv[0], for `--nproc`'s ranks
Command add_checkpoints(CLI::App& app);
Command add_restore(CLI::App& app);
Command add_inspect(CLI::App& app);
Command add_export(CLI::App& app);
Command add_check_export(CLI::App& app);
Command add_import_hf(CLI::App& app);
Command add_eval(CLI::App& app);
Command add_sample(CLI::App& app);
Command add_chat(CLI::App& app);
Command add_plan(CLI::App& app);
Command add_bench(CLI::App& app);
Command add_tokenize(CLI::App& app);

// ---- Argument checks several subcommands share (command.cpp) ----

// A tokenizer name: one of `names`, or hf:DIR (a Hugging Face tokenizer.json, checked when loaded).
CLI::Validator tokenizer_name(std::vector<std::string> names);
// A name that can be one directory level (name_problem).
CLI::Validator dir_name();
// A whole number from 0 to 2^64 - 1, written in decimal digits (CLI11 would wrap -1 and saturate overflow).
CLI::Validator uint64_text();
// A number that parses, is finite (CLI11's ranges let NaN through) and lies in [lo, hi].
CLI::Validator finite_in(double lo, double hi);

// `run` and `restore`: an OUT_DIR that looks like a key=value override (the user left it out) is refused.
void check_out_dir(const std::string& out_dir);

// `run` and `plan` with --restore HF_DIR: the model's architecture from its config.json (architecture/*
// settings), before `overrides` (which a mismatch then reports); a rotary model's block_size stays the
// config's. `note` (when not null) gets a line saying so. `overrides` unchanged for anything else.
std::vector<std::string> with_model_dir_architecture(const std::string& restore, const std::vector<std::string>& overrides,
                                                     FILE* note);

// `eval` and `sample`: a job rebuilt from a checkpoint for reading only (nothing is written), and its trainer.
std::unique_ptr<RestorableJob> load_for_reading(const std::string& checkpoint, const std::vector<std::string>& overrides,
                                                Trainer** trainer);

}  // namespace lt
