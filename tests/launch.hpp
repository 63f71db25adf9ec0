// Running the launcher as a user does: in the foreground (exit code and output), or in the
// background with extra environment variables (a rank started the way torchrun starts it).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch.hpp"

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

// A socket bound to 127.0.0.1:`port` (0: one the system picks), listening when `listen_too`; -1 when
// the port is taken. *bound gets the port.
inline int bind_loopback(int port, bool listen_too, int* bound = nullptr) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || (listen_too && listen(fd, 16) != 0) ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  if (bound) *bound = ntohs(a.sin_port);
  return fd;
}

// A port for ranks started by hand, rank 0 serving the store (torchrun's variables without its agent):
// free now, and below the system's ephemeral range (net.ipv4.ip_local_port_range), where no other
// program's bind to port 0 or outgoing connection can take it before rank 0 listens on it.
inline int port_for_rank0() {
  int low = 32768, high = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low >> high;
  std::mt19937 rng(static_cast<unsigned>(getpid()) ^ static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count()));
  const int first = 10000, last = std::max(first + 1000, low) - 1;
  for (int tries = 0; tries < 200; ++tries) {
    const int port = first + static_cast<int>(rng() % static_cast<unsigned>(last - first));
    const int fd = bind_loopback(port, false);
    if (fd >= 0) {
      close(fd);
      return port;
    }
  }
  throw std::runtime_error("no free port in [" + std::to_string(first) + ", " + std::to_string(last) + "]");
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

// A refusal as the user sees it: exit 2, each of `words` in the output, and nothing of a library's own
// (no JSON library message, "internal error" or bad_alloc).
inline void refused(const Result& r, const std::vector<std::string>& words) {
  INFO(r.out);
  CHECK(r.code == 2);
  for (const auto& w : words) CHECK_THAT(r.out, Contains(w));
  CHECK(r.out.find("[json.exception") == std::string::npos);
  CHECK(r.out.find("internal error") == std::string::npos);
  CHECK(r.out.find("std::bad_alloc") == std::string::npos);
}

inline void succeeded(const Result& r) {
  INFO(r.out);
  CHECK(r.code == 0);
}

}  // namespace lt::test
