// Running another program: to its end (run_process: its standard input /dev/null, its output and errors
// into files, the launcher's environment), for the real reference tools some commands read their
// results back with (check-export runs llama.cpp through node); or as a server of lines (LineProcess),
// for a reward program.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace lt {

struct ProcessResult {
  bool started = false;  // false: the program could not be started (`error` says why: not on PATH, ...)
  int exit_code = -1;    // its exit status, or 128 + the signal that ended it
  bool timed_out = false;  // it ran past the timeout and was killed
  std::string error;
};

// Runs argv[0] (looked up on PATH when it has no '/') with `argv`, its stdout into `stdout_file` and its
// stderr into `stderr_file` (created or truncated), and waits for it: at most `timeout_s` seconds (0: no
// limit), after which it is killed.
ProcessResult run_process(const std::vector<std::string>& argv, const std::string& stdout_file, const std::string& stderr_file,
                          int timeout_s = 0);

// A new private directory (mode 0700) under the system's temporary directory ($TMPDIR, else /tmp),
// named for `what`; removed with everything in it when the TempDirectory goes.
class TempDirectory {
 public:
  explicit TempDirectory(const std::string& what);
  ~TempDirectory();
  TempDirectory(const TempDirectory&) = delete;
  TempDirectory& operator=(const TempDirectory&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A program started once that answers lines: each question a line written to its standard input, its
// answer the next line it prints (its errors go to a file, quoted when it fails). A reward program
// (recipes/grpo_rewards.hpp). Writing to a program that has exited is an error, not a SIGPIPE.
class LineProcess {
 public:
  // Starts argv[0] (looked up on PATH when it has no '/'); a UserError naming `what` when it cannot.
  LineProcess(std::vector<std::string> argv, std::string what);
  // Closes its input (a well-behaved program then exits), waits a second, then kills it.
  ~LineProcess();
  LineProcess(const LineProcess&) = delete;
  LineProcess& operator=(const LineProcess&) = delete;
  // Writes `line` (no newline in it) and a newline, and returns the next line the program prints,
  // without its newline. A UserError naming `what` and `about` (the question's origin), with the end
  // of the program's errors, when it has exited, closes its output, or prints no whole line within
  // timeout_s seconds (then it is killed: the next ask is an error too).
  std::string ask(const std::string& line, double timeout_s, const std::string& about);
  // The program's exit status once it has ended (128 + signal), else -1.
  int exit_status();

 private:
  std::string failure(const std::string& about, const std::string& why);
  std::vector<std::string> argv_;
  std::string what_;
  int pid_ = -1, fd_ = -1;  // the child, and our end of the socket pair that is its stdin and stdout
  int status_ = -1;
  std::string buffer_;  // read past the last answer
  std::string stderr_path_;
  std::unique_ptr<TempDirectory> tmp_;  // holds the errors file
};

}  // namespace lt
