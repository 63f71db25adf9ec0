#include "lora_trainer/cli/local_ranks.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "lora_trainer/core/util.hpp"

namespace lt {

namespace {

std::atomic<int> g_forward_signal{0};

extern "C" void lt_launcher_on_signal(int sig) { g_forward_signal.store(sig); }

}  // namespace

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    throw std::runtime_error(std::string("no free TCP port on 127.0.0.1: ") + std::strerror(errno));
  }
  int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

namespace {

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + strsignal(WTERMSIG(status));
  return "stopped";
}

}  // namespace

int run_local_ranks(int nproc, const std::vector<std::string>& args, double grace_s) {
  int port = env_int("MASTER_PORT", 0);
  if (port <= 0) port = free_port();
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(static_cast<size_t>(nproc), -1);
  for (int r = 0; r < nproc; ++r) {
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      std::vector<char*> argv;
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv("/proc/self/exe", argv.data());
      std::fprintf(stderr, "error: cannot start rank %d: %s\n", r, std::strerror(errno));
      _exit(127);
    }
    pids[static_cast<size_t>(r)] = pid;
  }
  std::fprintf(stderr, "started %d ranks on 127.0.0.1:%d\n", nproc, port);

  auto signals = std::make_unique<SignalGuard>(lt_launcher_on_signal);  // forwarded to the ranks until they end
  int running = nproc, first_failure = -1, result = 0;
  std::vector<long> peak_kb(static_cast<size_t>(nproc), 0);  // each rank's peak resident memory
  double kill_at = 0;  // after a failure: when the ranks still running are killed
  bool killed = false;
  while (running > 0) {
    if (int sig = g_forward_signal.exchange(0)) {
      for (pid_t p : pids)
        if (p > 0) kill(p, sig);
    }
    int status = 0;
    struct rusage usage {};
    pid_t done = wait4(-1, &status, WNOHANG, &usage);
    if (done > 0) {
      int rank = -1;
      for (size_t i = 0; i < pids.size(); ++i)
        if (pids[i] == done) rank = static_cast<int>(i), pids[i] = -1;
      if (rank < 0) continue;
      --running;
      peak_kb[static_cast<size_t>(rank)] = usage.ru_maxrss;
      const int code = exit_code_of(status);
      if (code == 0) continue;
      std::fprintf(stderr, "rank %d %s%s\n", rank, describe_status(status).c_str(),
                   first_failure < 0 && running > 0 ? "; the other ranks will stop" : "");
      // A rank that lost a peer: the peer's own failure, reaped a moment later, is the cause.
      if (first_failure < 0 || (result == kExitLostRank && code != kExitLostRank)) {
        if (first_failure < 0) kill_at = now_seconds() + grace_s;
        first_failure = rank;
        result = code;
      }
      continue;
    }
    if (first_failure >= 0 && !killed && now_seconds() > kill_at) {
      for (size_t i = 0; i < pids.size(); ++i)
        if (pids[i] > 0) {
          std::fprintf(stderr, "rank %zu did not stop within %.0f s after rank %d failed; killing it\n", i, grace_s,
                       first_failure);
          kill(pids[i], SIGKILL);
        }
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  signals.reset();
  if (first_failure < 0) {
    std::string peaks;
    for (size_t i = 0; i < peak_kb.size(); ++i) {
      char text[48];
      std::snprintf(text, sizeof text, "%s%zu: %.2f GB", i ? ", " : "", i, peak_kb[i] * 1024.0 / 1e9);
      peaks += text;
    }
    std::fprintf(stderr, "peak resident memory per rank: %s\n", peaks.c_str());
  }
  if (first_failure >= 0)
    std::fprintf(stderr, "error: rank %d of %d failed (exit status %d)%s\n", first_failure, nproc, result,
                 result == kExitLostRank ? ": a rank lost contact with another" : "");
  return result;
}

}  // namespace lt
