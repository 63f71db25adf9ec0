#include "lora_trainer/core/subprocess.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <signal.h>

#include <cerrno>
#include <chrono>
#include <thread>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "lora_trainer/core/util.hpp"

extern char** environ;

namespace lt {
namespace {

// posix_spawnp of argv with `actions` (destroyed here); 0 or the error number.
int spawn(std::vector<std::string> argv, posix_spawn_file_actions_t* actions, pid_t* pid) {
  std::vector<char*> c_args;
  for (auto& a : argv) c_args.push_back(a.data());
  c_args.push_back(nullptr);
  const int err = posix_spawnp(pid, c_args[0], actions, nullptr, c_args.data(), environ);
  posix_spawn_file_actions_destroy(actions);
  return err;
}

}  // namespace

ProcessResult run_process(const std::vector<std::string>& argv, const std::string& stdout_file, const std::string& stderr_file,
                          int timeout_s) {
  ProcessResult r;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, stdout_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&actions, 2, stderr_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid = -1;
  const int err = spawn(argv, &actions, &pid);
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

namespace lt {
namespace {

// The last `max` bytes of a file ("" when it cannot be read).
std::string file_tail(const std::string& path, size_t max) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return "";
  const auto size = static_cast<size_t>(in.tellg());
  const size_t from = size > max ? size - max : 0;
  in.seekg(static_cast<std::streamoff>(from));
  std::string out(size - from, '\0');
  in.read(out.data(), static_cast<std::streamsize>(out.size()));
  return out;
}

std::string seconds_text(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

}  // namespace

LineProcess::LineProcess(std::vector<std::string> argv, std::string what) : argv_(std::move(argv)), what_(std::move(what)) {
  if (argv_.empty() || argv_[0].empty()) throw UserError(what_ + ": no program given");
  tmp_ = std::make_unique<TempDirectory>("reward");
  stderr_path_ = *tmp_ / "stderr";
  int sv[2];
  // A socket pair rather than two pipes: send() with MSG_NOSIGNAL reports a program that has exited
  // as EPIPE instead of killing the launcher with SIGPIPE.
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    throw UserError(what_ + ": could not make a socket pair: " + std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, sv[1], 0);
  posix_spawn_file_actions_adddup2(&actions, sv[1], 1);
  posix_spawn_file_actions_addopen(&actions, 2, stderr_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid = -1;
  const int err = spawn(argv_, &actions, &pid);
  close(sv[1]);
  if (err != 0) {
    close(sv[0]);
    throw UserError(what_ + ": cannot start " + argv_[0] + ": " + std::strerror(err) +
                    (argv_[0].find('/') == std::string::npos ? " (looked up on PATH)" : ""));
  }
  pid_ = pid;
  fd_ = sv[0];
}

LineProcess::~LineProcess() {
  if (fd_ >= 0) close(fd_);
  if (pid_ <= 0 || status_ >= 0) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (std::chrono::steady_clock::now() < deadline) {
    if (exit_status() >= 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
}

int LineProcess::exit_status() {
  if (status_ >= 0 || pid_ <= 0) return status_;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return status_;
}

std::string LineProcess::failure(const std::string& about, const std::string& why) {
  std::string tail = file_tail(stderr_path_, 2000);
  while (!tail.empty() && (tail.back() == '\n' || tail.back() == '\r')) tail.pop_back();
  return what_ + " (" + join(argv_, " ") + "), " + about + ": " + why +
         (tail.empty() ? "" : "; its errors end with:\n" + tail);
}

std::string LineProcess::ask(const std::string& line, double timeout_s, const std::string& about) {
  if (fd_ < 0) throw UserError(failure(about, "it was stopped after an earlier failure"));
  const std::string out = line + "\n";
  for (size_t sent = 0; sent < out.size();) {
    const ssize_t n = send(fd_, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      close(fd_);
      fd_ = -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      const int st = exit_status();
      throw UserError(failure(about, st >= 0 ? "it has exited (status " + std::to_string(st) + ")"
                                             : std::string("writing to it failed: ") + std::strerror(errno)));
    }
    sent += static_cast<size_t>(n);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  for (;;) {
    const size_t nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string answer = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      if (!answer.empty() && answer.back() == '\r') answer.pop_back();
      return answer;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      kill(pid_, SIGKILL);
      close(fd_);
      fd_ = -1;
      throw UserError(failure(about, "no answer within " + seconds_text(timeout_s) + " s (it was stopped)"));
    }
    pollfd p{fd_, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    char chunk[4096];
    const ssize_t n = recv(fd_, chunk, sizeof chunk, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      close(fd_);
      fd_ = -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      const int st = exit_status();
      throw UserError(failure(about, st >= 0 ? "it exited (status " + std::to_string(st) + ") without answering"
                                             : "it closed its output without answering"));
    }
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

}  // namespace lt
