#include "lora_trainer/cli/local_ranks.hpp"

#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
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

#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {

namespace {

std::atomic<int> g_forward_signal{0};

extern "C" void lt_launcher_on_signal(int sig) { g_forward_signal.store(sig); }

}  // namespace

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

// What rank `rank` of `nproc` is told ("NAME=value"): where the launcher's store is, and that the
// launcher serves it. The launcher's own values of these names are not passed on.
static std::vector<std::string> rank_variables(int rank, int nproc, int port) {
  return {"RANK=" + std::to_string(rank),
          "LOCAL_RANK=" + std::to_string(rank),
          "WORLD_SIZE=" + std::to_string(nproc),
          "LOCAL_WORLD_SIZE=" + std::to_string(nproc),
          "MASTER_ADDR=127.0.0.1",
          "MASTER_PORT=" + std::to_string(port),
          "TORCHELASTIC_USE_AGENT_STORE=True",
          "TORCHELASTIC_RESTART_COUNT=0"};
}

// Whether environment entry `entry` ("NAME=value") sets one of the names in `variables`.
static bool sets_one_of(const std::string& entry, const std::vector<std::string>& variables) {
  for (const auto& v : variables) {
    const size_t name = v.find('=') + 1;  // the name and its '='
    if (entry.compare(0, name, v, 0, name) == 0) return true;
  }
  return false;
}

// In a child between fork and exec, where only async-signal-safe calls are allowed (the parent has the
// store's threads): closes every descriptor above stderr, so that the ranks do not hold the store's
// listening socket or the launcher's files.
static void close_inherited_descriptors() {
#ifdef SYS_close_range
  if (syscall(SYS_close_range, 3U, ~0U, 0U) == 0) return;
#endif
  struct rlimit lim {};
  const long last = getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < 65536
                        ? static_cast<long>(lim.rlim_cur)
                        : 65536;
  for (long fd = 3; fd < last; ++fd) close(static_cast<int>(fd));
}

int run_local_ranks(int nproc, const std::vector<std::string>& args, double grace_s) {
  // The store the ranks meet at, served from here (as torchrun's agent serves it) on MASTER_PORT or on
  // a port the system picks, so no other program can take it before the ranks start.
  StoreServer store(env_int("MASTER_PORT", 0), grace_s);
  const int port = store.port();

  // Each rank's command line and environment, made before forking: the child only closes descriptors
  // and execs.
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const std::vector<std::string> told = rank_variables(0, nproc, port);  // the names every rank is told
  std::vector<std::string> inherited;
  for (char** e = environ; *e; ++e)
    if (!sets_one_of(*e, told)) inherited.emplace_back(*e);
  std::vector<std::vector<std::string>> rank_env(static_cast<size_t>(nproc), inherited);
  std::vector<std::vector<char*>> rank_envp(static_cast<size_t>(nproc));
  std::vector<std::string> cannot_start(static_cast<size_t>(nproc));
  for (int r = 0; r < nproc; ++r) {
    auto& env = rank_env[static_cast<size_t>(r)];
    for (const std::string& v : rank_variables(r, nproc, port)) env.push_back(v);
    for (auto& v : env) rank_envp[static_cast<size_t>(r)].push_back(const_cast<char*>(v.c_str()));
    rank_envp[static_cast<size_t>(r)].push_back(nullptr);
    cannot_start[static_cast<size_t>(r)] = "error: cannot start rank " + std::to_string(r) + ": exec of /proc/self/exe failed\n";
  }

  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(static_cast<size_t>(nproc), -1);
  for (int r = 0; r < nproc; ++r) {
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      close_inherited_descriptors();
      execve("/proc/self/exe", argv.data(), rank_envp[static_cast<size_t>(r)].data());
      const std::string& msg = cannot_start[static_cast<size_t>(r)];
      ssize_t ignored = write(2, msg.data(), msg.size());
      (void)ignored;
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
  std::vector<bool> killed_here(static_cast<size_t>(nproc), false);  // ranks this launcher killed
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
      // A rank that lost a peer: the peer's own failure, reaped a moment later, is the cause (not a
      // rank this launcher killed for not stopping).
      if (first_failure < 0 ||
          (result == kExitLostRank && code != kExitLostRank && !killed_here[static_cast<size_t>(rank)])) {
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
          killed_here[i] = true;
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
