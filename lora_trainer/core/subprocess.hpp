// Running another program and waiting for it: its standard input /dev/null, its output and errors into
// files, the launcher's environment. For the real reference tools some commands read their results
// back with (check-export runs llama.cpp through node).
#pragma once

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

}  // namespace lt
