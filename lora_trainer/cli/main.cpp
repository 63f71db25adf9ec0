// The launcher: `lora_trainer <subcommand>`. Parses arguments and calls the library; nothing else.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/cli/local_ranks.hpp"
#include "lora_trainer/models/generate.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/data/tokenizer.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/training/job.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/training/lora_trainer.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/cli/bench.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;
using namespace lt;

namespace {

// A tokenizer name: one of `names`, or hf:DIR (a Hugging Face tokenizer.json, checked when loaded).
CLI::Validator tokenizer_name(std::vector<std::string> names) {
  std::string desc = join(names, "|") + "|hf:DIR";
  return CLI::Validator(
      [names](std::string& text) -> std::string {
        if (text.rfind("hf:", 0) == 0 && text.size() > 3) return "";
        for (const auto& n : names)
          if (text == n) return "";
        return "\"" + text + "\" is not a tokenizer: use " + join(names, ", ") + " or hf:DIR";
      },
      desc);
}

// A name that can be one directory level (name_problem).
CLI::Validator dir_name() {
  return CLI::Validator([](std::string& text) { return name_problem(text); }, "NAME");
}

// A whole number from 0 to 2^64 - 1, written in decimal digits (CLI11 would wrap -1 and saturate overflow).
CLI::Validator uint64_text() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const std::string bad = "must be a whole number from 0 to 18446744073709551615, got \"" + text + "\"";
        if (text.empty() || text.size() > 20 || text.find_first_not_of("0123456789") != std::string::npos) return bad;
        if (text.size() == 20 && text > "18446744073709551615") return bad;
        return "";
      },
      "UINT64");
}

// A number that parses, is finite (CLI11's ranges let NaN through) and lies in [lo, hi].
CLI::Validator finite_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        char* end = nullptr;
        double v = std::strtod(text.c_str(), &end);
        if (text.empty() || *end != '\0') return "\"" + text + "\" is not a number";
        if (!std::isfinite(v) || v < lo || v > hi) {
          char b[96];
          std::snprintf(b, sizeof b, "must be a finite number from %g to %g, got %s", lo, hi, text.c_str());
          return b;
        }
        return "";
      },
      "NUMBER in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

// A first argument that is no subcommand: name it and suggest the closest one.
void check_subcommand(const CLI::App& app, int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return;
  std::vector<std::string> names;
  for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; })) names.push_back(sub->get_name());
  const std::string given = argv[1];
  if (std::find(names.begin(), names.end(), given) != names.end()) return;
  std::string near = closest_match(given, names);
  throw UserError("unknown command \"" + given + "\"" + (near.empty() ? "" : "; did you mean \"" + near + "\"?") +
                  " The commands are: " + join(names) + " (`lora_trainer --help` describes them)");
}

int cmd_jobs() {
  for (const auto& c : job_registry().all()) std::printf("%-28s %s\n", c.kind.c_str(), c.description.c_str());
  return 0;
}

int cmd_configure(const std::string& kind, const std::string& out, const std::vector<std::string>& overrides, bool force) {
  const JobClass& cls = job_registry().find(kind);
  Config cfg(cls.schema());
  for (const auto& o : overrides) cfg.apply_override(o);
  // A config is often edited by hand after `configure`: never replace one unasked.
  const fs::path parent = fs::path(out).parent_path();
  if (!parent.empty() && !fs::is_directory(parent))
    throw UserError("configure: OUT " + out + ": directory " + parent.string() + " does not exist; create it first");
  if (fs::is_directory(out)) throw UserError("configure: OUT " + out + " is a directory; give a file name (e.g. " + (fs::path(out) / "job.json").string() + ")");
  if (fs::exists(out) && !force)
    throw UserError("configure: OUT " + out + " already exists; give another name, or --force to replace it. Nothing was written");
  write_file_atomic(out, cfg.to_json().dump(2) + "\n");
  std::printf("wrote %s (%zu keys, job/kind %s)\n", out.c_str(), cfg.schema().options().size(), kind.c_str());
  return 0;
}

// Continuing a job under a config that differs from the one its checkpoint was saved with is allowed (a
// larger token budget continues a finished job), but a changed step size or schedule silently changes
// what the counters mean: say which keys differ.
void note_config_changes(const RestorableJob& job, const std::string& checkpoint) {
  using nlohmann::json;
  if (distributed().rank() != 0) return;
  const json saved = read_checkpoint_metadata(checkpoint).value("config", json::object()).flatten();
  const json now = job.config().to_json().flatten();
  std::vector<std::string> changed;
  for (auto it = now.begin(); it != now.end(); ++it) {
    const std::string key = it.key().substr(1);  // flatten() writes "/a/b"
    if (key.rfind("runtime/", 0) == 0 || key.rfind("logging/", 0) == 0) continue;  // how it runs, not what
    auto was = saved.find(it.key());
    if (was == saved.end() || *was != it.value())
      changed.push_back(key + " " + (was == saved.end() ? std::string("(new)") : was->dump()) + " -> " + it.value().dump());
  }
  if (changed.empty()) return;
  std::printf("note: %zu setting%s differ%s from the config %s was saved with: %s. The restored state continues under "
              "this run's values (docs/cli.md, run)\n",
              changed.size(), changed.size() == 1 ? "" : "s", changed.size() == 1 ? "s" : "", checkpoint.c_str(),
              join(changed, "; ").c_str());
}

void run_or_continue(RestorableJob& job, const std::string& restore) {
  std::string latest = job.restore_latest();
  if (!latest.empty()) {
    std::printf("continuing %s from its latest checkpoint %s\n", job.spec().name.c_str(), latest.c_str());
    note_config_changes(job, (fs::path(job.job_dir()) / latest).string());
  } else if (!restore.empty()) {
    std::printf("restoring %s from %s\n", job.spec().name.c_str(), restore.c_str());
    job.restore_from_path(restore);
  }
  job.run();
}

int cmd_checkpoints(const std::string& name, const std::string& out) {
  fs::path root = fs::path(out) / "checkpoints";
  int found = 0;
  if (fs::is_directory(root)) {
    for (auto& project : fs::directory_iterator(root)) {
      if (!project.is_directory()) continue;
      for (auto& group : fs::directory_iterator(project)) {
        fs::path job_dir = group.path() / name;
        if (!fs::is_directory(job_dir)) continue;
        std::printf("%s\n", job_dir.string().c_str());
        std::optional<std::string> latest;
        try {
          latest = read_latest(job_dir.string());
        } catch (const UserError& e) {
          std::printf("  warning: %s\n", e.what());
        }
        for (const auto& suffix : list_checkpoints(job_dir.string())) {
          auto meta = read_checkpoint_metadata((job_dir / suffix).string());
          std::printf("  %-28s kind %-6s step %8lld  tokens %12lld%s\n", suffix.c_str(),
                      meta.value("kind", std::string("?")).c_str(), (long long)meta.value("step", int64_t(0)),
                      (long long)meta.value("tokens", int64_t(0)), latest && *latest == suffix ? "  (latest)" : "");
          ++found;
        }
      }
    }
  }
  if (!found) {
    std::fprintf(stderr, "error: no checkpoints of job \"%s\" under %s\n", name.c_str(), root.string().c_str());
    return 2;
  }
  return 0;
}

// A job rebuilt from a checkpoint for reading only: nothing is written under `out`.
std::unique_ptr<RestorableJob> load_for_reading(const std::string& checkpoint, const std::vector<std::string>& overrides,
                                                 BaseTrainer** trainer) {
  auto job = from_checkpoint_path(checkpoint, "", "/nonexistent-lora-trainer-out", overrides);
  *trainer = dynamic_cast<BaseTrainer*>(job.get());
  if (!*trainer) throw UserError(checkpoint + " is not a checkpoint of a training job");
  return job;
}

int cmd_eval(const std::string& checkpoint, const std::vector<std::string>& names, int64_t rows, bool as_json,
             const std::vector<std::string>& overrides) {
  BaseTrainer* t = nullptr;
  auto job = load_for_reading(checkpoint, overrides, &t);
  std::vector<Sampling> datasets;
  if (names.empty()) datasets = t->plan_datasets();
  for (const auto& n : names) datasets.push_back(parse_dataset_spec(n));
  auto results = t->evaluate(datasets, rows > 0 ? rows : t->config().get_int("training/validation_steps"));
  nlohmann::json out = {{"checkpoint", checkpoint}, {"step", t->step()}, {"kind", state_kind_name(t->state_kind())}};
  for (const auto& e : results)
    out["datasets"][e.name] = e.style == DatasetStyle::CONTRASTIVE  // preference pairs: DPO's figures
                                  ? nlohmann::json{{"dpo_loss", e.loss}, {"reward_margin", e.reward_margin},
                                                   {"accuracy", e.accuracy}, {"pairs", e.tokens}}
                                  : nlohmann::json{{"loss", e.loss}, {"perplexity", std::exp(e.loss)}, {"tokens", e.tokens}};
  if (as_json) {
    std::cout << out.dump(2) << "\n";
  } else {
    std::printf("%s (step %lld, %s state)\n%-20s %10s %12s %10s\n", checkpoint.c_str(), (long long)t->step(),
                state_kind_name(t->state_kind()).c_str(), "dataset", "loss", "perplexity", "tokens");
    for (const auto& e : results) {
      if (e.style == DatasetStyle::CONTRASTIVE)
        std::printf("%-20s %10.4f (DPO loss over %lld pairs; reward margin %.4f, accuracy %.3f)\n", e.name.c_str(), e.loss,
                    (long long)e.tokens, e.reward_margin, e.accuracy);
      else
        std::printf("%-20s %10.4f %12.2f %10lld\n", e.name.c_str(), e.loss, std::exp(e.loss), (long long)e.tokens);
    }
  }
  return 0;
}

int cmd_sample(const std::string& checkpoint, const std::string& prompt, std::string tokenizer_name,
               const GenerateOptions& opts, const std::vector<std::string>& overrides) {
  BaseTrainer* t = nullptr;
  auto job = load_for_reading(checkpoint, overrides, &t);
  if (tokenizer_name == "auto") {
    // The imported model's own tokenizer.json where its directory still has one; else by vocabulary.
    const nlohmann::json& base = t->base_model();
    const std::string hf = base.is_object() ? base.value("hf_dir", std::string()) : std::string();
    tokenizer_name = !hf.empty() && std::filesystem::exists(hf + "/tokenizer.json") ? "hf:" + hf
                     : t->model()->options().vocab_size == 257                         ? "byte"
                                                                                       : "gpt2";
  }
  auto tok = make_tokenizer(tokenizer_name);
  GenerateOptions o = opts;
  o.stop_id = tok->eot_id();
  o.vocab_limit = tok->vocab_size();
  auto ema = t->ema_weights();  // with eval/use_ema, the moving average generates
  auto ids = generate(t->model(), t->runtime(), tok->encode(prompt), o);
  std::printf("%s%s\n", prompt.c_str(), tok->decode(ids).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Line by line even into a pipe or a file, so that progress (stdout) and errors (stderr) keep their order.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"lora_trainer: train a language model (GPT-2 or Llama family) in two phases (full parameters, then LoRA adapters), with restorable jobs.\n"
               "Docs: docs/cli.md, docs/config.md, checkpoints/README.md"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "help for every subcommand");

  auto* jobs = app.add_subcommand("jobs", "list the registered job kinds");

  std::string kind, out_json;
  std::vector<std::string> overrides;
  auto* configure = app.add_subcommand("configure", "write a config with every key of JOB at its default");
  configure->add_option("JOB", kind, "job kind (see `jobs`)")->required();
  configure->add_option("OUT", out_json, "config file to write (JSON)")->required();
  bool configure_force = false;
  configure->add_flag("--force", configure_force, "replace OUT if it exists");
  configure->add_option("overrides", overrides, "key=value settings (e.g. training/batch_size=32)");

  std::string name, config_path, out_dir, restore, checkpoint;
  auto* run = app.add_subcommand("run", "run a job; re-running continues from its latest checkpoint");
  run->add_option("NAME", name, "the run's name (its checkpoint directory)")->required();
  run->add_option("CONFIG", config_path, "config file (JSON; `configure` writes one)")->required()->check(CLI::ExistingFile);
  run->add_option("OUT_DIR", out_dir, "output root: checkpoints/ and runs/ go below it (. = this directory)")->required();
  run->add_option("--restore", restore, "start from this checkpoint directory (ignored when the job has a `latest`)");
  int nproc = 1;
  run->add_option("--nproc", nproc,
                  "data-parallel ranks to start on this machine (c10d/Gloo; see docs/distributed.md). Ranks "
                  "started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) need no --nproc")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  run->add_option("overrides", overrides, "key=value settings over the config file");

  auto* checkpoints = app.add_subcommand("checkpoints", "list the checkpoints of a job");
  checkpoints->add_option("NAME", name, "the run's name")->required();
  checkpoints->add_option("OUT_DIR", out_dir, "output root")->required();

  auto* restore_cmd = app.add_subcommand("restore", "rebuild a job from a checkpoint's saved config and resume it");
  restore_cmd->add_option("NAME", name, "name for the resumed run")->required();
  restore_cmd->add_option("CHECKPOINT", checkpoint, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  restore_cmd->add_option("OUT_DIR", out_dir, "output root")->required();
  restore_cmd->add_option("overrides", overrides, "key=value settings over the saved config");

  bool inspect_verify = false;
  auto* inspect = app.add_subcommand("inspect", "print a checkpoint's metadata and per-tensor digests as JSON");
  inspect->add_option("CHECKPOINT", checkpoint, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  inspect->add_flag("--verify", inspect_verify,
                    "only check every tensor's data against the CRC-32 recorded at save: one line, exit 0 when all "
                    "match, exit 2 naming the first corrupt tensor");

  std::string export_out, export_format = "native";
  bool export_ema = false;
  auto* export_cmd = app.add_subcommand("export", "write a checkpoint's model elsewhere: by default a weights-only plain checkpoint "
                                                  "with the adapters merged in; or Hugging Face / PEFT files (docs/huggingface.md)");
  export_cmd->add_option("CHECKPOINT", checkpoint, "checkpoint directory (plain or LoRA)")->required()->check(CLI::ExistingDirectory);
  export_cmd->add_option("OUT", export_out, "directory to write (native: usable with `run ... --restore OUT`)")->required();
  export_cmd->add_option("--format", export_format,
                         "native: our weights-only checkpoint, adapters merged; hf: model.safetensors + config.json "
                         "(transformers' GPT2LMHeadModel, or LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM for the llama family), "
                         "adapters merged; peft: adapter_config.json + "
                         "adapter_model.safetensors (the adapters of a LoRA checkpoint only)")
      ->capture_default_str()->check(CLI::IsMember({"native", "hf", "peft"}));
  bool out_force = false;
  export_cmd->add_flag("--force", out_force,
                       "write into an existing directory that is not an earlier export of lora_trainer: files of the "
                       "names this export writes are replaced, every other file is kept");
  export_cmd->add_flag("--ema", export_ema,
                       "write the moving average of the trained tensors (optimization/ema/decay) instead of their values");

  std::string hf_dir, import_out;
  auto* import_cmd = app.add_subcommand("import-hf", "import a Hugging Face model (config.json + safetensors: GPT-2, "
                                                     "Llama, Qwen2, Mistral) as a weights-only checkpoint for `run ... --restore`, "
                                                     "`eval` and `sample`");
  import_cmd->add_option("HF_DIR", hf_dir, "a transformers model directory (model_type gpt2, llama, qwen2 or mistral)")->required()->check(CLI::ExistingDirectory);
  import_cmd->add_option("OUT", import_out, "checkpoint directory to write (a new or empty directory, or an earlier import "
                         "or export, whose files are replaced; other files in it are kept)")->required();
  import_cmd->add_flag("--force", out_force,
                       "write into an existing directory that is not an earlier import or export of lora_trainer: files "
                       "of the names it writes are replaced, every other file is kept");

  std::vector<std::string> eval_datasets;
  int64_t eval_rows = 0;
  bool eval_json = false;
  auto* eval_cmd = app.add_subcommand("eval", "held-out loss and perplexity of a checkpoint (plain or LoRA) on datasets");
  eval_cmd->add_option("CHECKPOINT", checkpoint, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  // One value per --dataset (or a comma-separated list), so that key=value overrides after it stay overrides.
  eval_cmd->add_option("--dataset", eval_datasets,
                       "dataset name under data/dir, NAME:padded for a PADDED one, NAME:contrastive for preference pairs; repeat it or give a comma-separated "
                       "list (default: every dataset of the job)")
      ->allow_extra_args(false)->delimiter(',')->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  eval_cmd->add_option("--rows", eval_rows, "validation rows per dataset (default: training/validation_steps)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  eval_cmd->add_flag("--json", eval_json, "print JSON");
  eval_cmd->add_option("overrides", overrides, "key=value settings over the saved config (e.g. data/dir=...)");

  std::string prompt, sample_tokenizer = "auto";
  GenerateOptions gen;
  auto* sample_cmd = app.add_subcommand("sample", "generate text from a checkpoint");
  sample_cmd->add_option("CHECKPOINT", checkpoint, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  sample_cmd->add_option("--prompt", prompt, "text to continue")->required();
  sample_cmd->add_option("--tokens", gen.max_new_tokens, "tokens to generate")->capture_default_str()
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  sample_cmd->add_option("--temperature", gen.temperature, "softmax temperature; 0 = greedy")->capture_default_str()
      ->check(finite_in(0, 1e6));
  sample_cmd->add_option("--top-k", gen.top_k, "sample from the k most likely tokens; 0 = all")->capture_default_str()
      ->check(CLI::Range(int64_t(0), int64_t(1) << 31));
  sample_cmd->add_option("--seed", gen.seed, "random seed")->capture_default_str()->check(uint64_text());
  sample_cmd->add_option("--tokenizer", sample_tokenizer, "auto (an imported model's own tokenizer.json when its directory has one, else byte when "
                         "the vocabulary is 257, else gpt2), gpt2, byte, or hf:DIR (a Hugging Face tokenizer.json in DIR)")
      ->capture_default_str()->check(tokenizer_name({"auto", "gpt2", "byte"}));
  sample_cmd->add_option("overrides", overrides, "key=value settings over the saved config (e.g. runtime/threads=1)");

  BenchOptions bench;
  auto* bench_cmd = app.add_subcommand("bench", "time phase-1 and LoRA steps of a lora/train config's model (synthetic tokens)");
  bench_cmd->add_option("CONFIG", bench.config_path, "a lora/train config (e.g. configs/demo.json)")->required()->check(CLI::ExistingFile);
  bench_cmd->add_option("--steps", bench.steps, "timed steps per phase")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  bench_cmd->add_option("--warmup", bench.warmup_steps, "untimed steps before them")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  bench_cmd->add_option("--out", bench.out_json, "JSON file for the figures")->capture_default_str();
  bench_cmd->add_option("--weights-out", bench.weights_out, "also write the initial weights (torch pickle) for scripts/reference_gpt.py");
  bench_cmd->add_option("--profile", bench.profile,
                        "also write PROFILE-full.trace.json and PROFILE-lora.trace.json: Chrome traces of the timed "
                        "steps (their times are then not representative); scripts/profile_summary.py sums them by op");
  bench_cmd->add_option("--cuda-profile", bench.cuda_profile,
                        "full or lora: record only that phase's timed steps in a CUDA profiler started with "
                        "--profile-from-start off (ncu, nsys); scripts/profile_kernels.sh runs it")
      ->check(CLI::IsMember({"full", "lora"}));
  bench_cmd->add_option("overrides", bench.overrides, "key=value settings over the config");

  TokenizeOptions tok;
  std::string ds_name, data_dir = "datasets/data";
  auto* tokenize = app.add_subcommand("tokenize", "turn text files/directories into a PMD dataset, JSONL prompt/completion records into a PADDED one, "
                                     "or JSONL prompt/chosen/rejected preference records into a CONTRASTIVE one");
  tokenize->add_option("INPUT", tok.inputs, "text files or directories")->required();
  tokenize->add_option("--name", ds_name, "dataset name (a directory under --data-dir)")->required()->check(dir_name());
  tokenize->add_option("--data-dir", data_dir, "data directory (config key data/dir)")->capture_default_str();
  tokenize->add_option("--tokenizer", tok.tokenizer, "gpt2, byte, or hf:DIR (a Hugging Face byte-level BPE tokenizer.json in DIR)")
      ->capture_default_str()->check(tokenizer_name({"gpt2", "byte"}));
  tokenize->add_option("--tokenizer-dir", tok.tokenizer_dir, "directory with encoder.json and vocab.bpe");
  tokenize->add_option("--val-fraction", tok.val_fraction, "share of documents for validation")->capture_default_str();
  tokenize->add_option("--ext", tok.extensions, "only files ending in this (e.g. --ext .py); repeat it or give a "
                       "comma-separated list (--ext .py,.js)")
      ->allow_extra_args(false)->delimiter(',')->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  std::string tok_format = "text";
  tokenize->add_option("--format", tok_format,
                       "text: each file a document -> PMD; jsonl: {\"prompt\",\"completion\"} records -> PADDED; pairs: "
                       "{\"prompt\",\"chosen\",\"rejected\"} records -> CONTRASTIVE (for dpo/train)")
      ->capture_default_str()->check(CLI::IsMember({"text", "jsonl", "pairs"}));
  tokenize->add_flag("--force", tok.force,
                     "write into an existing directory that is not a dataset of lora_trainer (its other files are kept)");
  auto* tok_length = tokenize->add_option("--length", tok.length, "jsonl, pairs: row length in tokens (0 = the longest row)")
      ->capture_default_str()->check(CLI::Range(int64_t(0), int64_t(1) << 24));

  try {
    check_subcommand(app, argc, argv);
  } catch (const UserError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }

  try {
    if (*jobs) return cmd_jobs();
    if (*configure) return cmd_configure(kind, out_json, overrides, configure_force);
    if ((*run || *restore_cmd) && out_dir.find('=') != std::string::npos)
      throw UserError("OUT_DIR \"" + out_dir + "\" looks like a key=value override: give the output directory " +
                      "first (`.` for this directory), then the overrides");
    if (*run) {
      if (nproc > 1) {
        if (Distributed::requested_by_env())
          throw UserError("--nproc starts its own ranks; it cannot be combined with WORLD_SIZE=" +
                          std::string(std::getenv("WORLD_SIZE")) + " in the environment (torchrun starts them instead)");
        Config cfg = make_config(config_path, overrides);  // a mistake is reported once, before any rank starts
        JobDirLock lock(job_dir_path(out_dir, cfg.get_string("job/project"), cfg.get_string("job/group"), name));
        setenv("LT_JOB_LOCK_HELD", "1", 1);  // the ranks' own: this launcher holds the lock for them
        std::vector<std::string> args = {argv[0], "run", name, config_path, out_dir};
        if (!restore.empty()) args.insert(args.end(), {"--restore", restore});
        args.insert(args.end(), overrides.begin(), overrides.end());
        return run_local_ranks(nproc, args, cfg.get_double("distributed/timeout_s") + 10.0);
      }
      if (Distributed::requested_by_env()) {
        Config cfg = make_config(config_path, overrides);
        set_distributed(Distributed::from_env(cfg.get_double("distributed/timeout_s"), Runtime::from_config(cfg).device));
        if (!distributed().is_main() && !std::freopen("/dev/null", "w", stdout))
          throw std::runtime_error("cannot redirect the output of rank " + std::to_string(distributed().rank()));
      }
      auto job = make_job(name, config_path, out_dir, overrides);
      std::unique_ptr<JobDirLock> lock;  // one writer per job directory (rank 0 for several ranks)
      if (!JobDirLock::held_by_launcher() && distributed().is_main()) lock = std::make_unique<JobDirLock>(job->job_dir());
      run_or_continue(*job, restore);
      return 0;
    }
    if (*checkpoints) return cmd_checkpoints(name, out_dir);
    if (*restore_cmd) {
      if (Distributed::requested_by_env())
        throw UserError("`restore` runs as one process; for data-parallel ranks use `run NAME CONFIG OUT_DIR --restore " +
                        checkpoint + "`");
      auto job = from_checkpoint_path(checkpoint, name, out_dir, overrides);
      JobDirLock lock(job->job_dir());
      job->run();
      return 0;
    }
    if (*inspect) {
      if (inspect_verify) {
        std::printf("%s\n", verify_checkpoint(checkpoint).c_str());
        return 0;
      }
      std::cout << inspect_checkpoint(checkpoint).dump(2) << "\n";
      return 0;
    }
    if (*eval_cmd) return cmd_eval(checkpoint, eval_datasets, eval_rows, eval_json, overrides);
    if (*sample_cmd) return cmd_sample(checkpoint, prompt, sample_tokenizer, gen, overrides);
    if (*bench_cmd) {
      run_bench(bench);
      return 0;
    }
    if (*export_cmd) {
      if (export_format == "hf") export_hf(checkpoint, export_out, export_ema, out_force);
      else if (export_format == "peft") export_peft(checkpoint, export_out, export_ema, out_force);
      else export_merged(checkpoint, export_out, export_ema, out_force);
      return 0;
    }
    if (*import_cmd) {
      import_hf(hf_dir, import_out, out_force);
      return 0;
    }
    if (*tokenize) {
      if (tok_format == "text" && tok_length->count() > 0)
        throw UserError("tokenize: --length sets the row length of --format jsonl and pairs; text is cut into rows at "
                        "training time (architecture/block_size). Drop --length, or give --format jsonl|pairs");
      tok.out_dir = (fs::path(data_dir) / ds_name).string();
      auto r = tok_format == "jsonl"   ? tokenize_jsonl_to_padded(tok)
               : tok_format == "pairs" ? tokenize_jsonl_to_contrastive(tok)
                                       : tokenize_to_pmd(tok);
      std::printf("dataset %s: %llu documents (%llu validation), %llu bytes -> %llu train + %llu val tokens\n",
                  tok.out_dir.c_str(), (unsigned long long)r.documents, (unsigned long long)r.val_documents,
                  (unsigned long long)r.bytes, (unsigned long long)r.train_tokens, (unsigned long long)r.val_tokens);
      return 0;
    }
  } catch (const UserError& e) {
    if (distributed().active()) std::fprintf(stderr, "error (rank %d): %s\n", distributed().rank(), e.what());
    else std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const TrainingDiverged& e) {
    if (distributed().active()) std::fprintf(stderr, "error (rank %d): %s\n", distributed().rank(), e.what());
    else std::fprintf(stderr, "error: %s\n", e.what());
    return kExitDiverged;
  } catch (const DistributedError& e) {
    // The process group cannot be shut down cleanly with a peer gone: leave at once.
    std::fprintf(stderr, "error: %s\n", e.what());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(kExitLostRank);
  } catch (const fs::filesystem_error& e) {
    // The file system refused (a path that is a file, no permission, a full or read-only disk): the
    // user's environment, named with its path.
    std::string paths = e.path1().string() + (e.path2().empty() ? "" : " -> " + e.path2().string());
    std::fprintf(stderr, "error: %s: %s (check that the path is a writable directory with free space)\n", paths.c_str(),
                 e.code().message().c_str());
    return 2;
  } catch (const nlohmann::json::exception& e) {
    // A JSON reader that did not say which file (each should): still the input's fault, not ours.
    try {
      rethrow_json_error("a JSON input", e);
    } catch (const UserError& u) {
      std::fprintf(stderr, "error: %s\n", u.what());
    }
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory. If an input file states a size (a tensor shape, a vocabulary), check it; "
                         "otherwise lower training/batch_size or architecture/* or use a machine with more memory\n");
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "internal error (please report): %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
