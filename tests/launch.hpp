// Running the launcher as a user does: in the foreground (exit code and output), or in the
// background with extra environment variables (a rank started the way torchrun starts it).
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt::test {

struct Result {
  int code;
  std::string out;
};

inline std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs a shell command and waits; its stdout and stderr together.
inline Result shell(std::string cmd) {
  cmd += " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

// Runs the launcher with `args` (after `env`, "NAME=value ..." settings) and waits.
inline Result launch(const std::vector<std::string>& args, const std::string& env = "") {
  std::string cmd = env + " " + quote(LT_LAUNCHER);
  for (const auto& a : args) cmd += " " + quote(a);
  return shell(cmd);
}

// Starts the launcher in the background with `env` set, its output going to `log`.
inline pid_t spawn(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
                   const std::string& log) {
  std::fflush(stdout);  // or the child writes the parent's buffered output again
  std::fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    if (!std::freopen(log.c_str(), "w", stdout)) _exit(126);
    dup2(fileno(stdout), 2);
    std::vector<char*> argv{const_cast<char*>(LT_LAUNCHER)};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(LT_LAUNCHER, argv.data());
    _exit(127);
  }
  return pid;
}

// Waits up to `seconds` until `log` contains `text`.
inline bool wait_for_text(const std::string& log, const std::string& text, double seconds) {
  for (double waited = 0; waited < seconds; waited += 0.05) {
    std::FILE* f = std::fopen(log.c_str(), "r");
    if (f) {
      std::fclose(f);
      if (read_file(log).find(text) != std::string::npos) return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// Waits up to `seconds` for `pid` to exit; its exit code (128 + signal), or -1 if it is still running.
inline int wait_exit(pid_t pid, double seconds) {
  for (double waited = 0; waited < seconds; waited += 0.05) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return -1;
}

// Digests of the tensors that define the training state (weights and optimizer), by name.
inline std::map<std::string, std::string> state_digests(const std::string& ckpt) {
  std::map<std::string, std::string> out;
  const nlohmann::json info = inspect_checkpoint(ckpt);
  for (const auto& t : info["tensors"]) out[t["name"].get<std::string>()] = t["fnv1a64"].get<std::string>();
  return out;
}

inline std::vector<nlohmann::json> read_metrics_lines(const std::string& run_dir) {
  std::vector<nlohmann::json> out;
  std::istringstream in(read_file(run_dir + "/metrics.jsonl"));
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace lt::test
