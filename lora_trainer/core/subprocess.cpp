#include "lora_trainer/core/subprocess.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <signal.h>

#include <cerrno>
#include <chrono>
#include <thread>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "lora_trainer/core/util.hpp"

extern char** environ;

namespace lt {

ProcessResult run_process(const std::vector<std::string>& argv, const std::string& stdout_file, const std::string& stderr_file,
                          int timeout_s) {
  ProcessResult r;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, stdout_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&actions, 2, stderr_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  std::vector<std::string> args = argv;
  std::vector<char*> c_args;
  for (auto& a : args) c_args.push_back(a.data());
  c_args.push_back(nullptr);
  pid_t pid = -1;
  const int err = posix_spawnp(&pid, c_args[0], &actions, nullptr, c_args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (err != 0) {
    r.error = argv[0] + ": " + std::strerror(err);
    return r;
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  for (;;) {
    const pid_t done = waitpid(pid, &status, timeout_s > 0 ? WNOHANG : 0);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) {
      r.error = std::string("waitpid: ") + std::strerror(errno);
      return r;
    }
    if (done == 0) {
      if (std::chrono::steady_clock::now() >= deadline) {
        kill(pid, SIGKILL);
        r.timed_out = true;
        waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  r.started = true;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

TempDirectory::TempDirectory(const std::string& what) {
  std::error_code ec;
  std::string base = std::filesystem::temp_directory_path(ec).string();
  if (ec || base.empty()) base = "/tmp";
  std::string pattern = base + "/lora_trainer-" + what + "-XXXXXX";
  if (!mkdtemp(pattern.data()))
    throw UserError("could not make a temporary directory in " + base + " (" + std::strerror(errno) +
                    "): set TMPDIR to a writable directory");
  path_ = pattern;
}

TempDirectory::~TempDirectory() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace lt
