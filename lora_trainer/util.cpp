#include "lora_trainer/util.hpp"

#include <nlohmann/json.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

namespace fs = std::filesystem;

namespace lt {

static void write_all(int fd, const std::string& path, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) throw UserError("could not write " + path + ": " + std::strerror(errno));
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  fs::path target(path);
  if (target.has_parent_path()) fs::create_directories(target.parent_path());
  std::random_device rd;
  std::string tmp = path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(rd());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw UserError("could not create " + tmp + ": " + std::strerror(errno));
  try {
    write_all(fd, tmp, contents.data(), contents.size());
    if (::fsync(fd) != 0) throw UserError("could not fsync " + tmp + ": " + std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw UserError("could not rename " + tmp + " to " + path + ": " + std::strerror(errno));
  }
  fsync_dir(target.has_parent_path() ? target.parent_path().string() : ".");
}

void publish_dir(const std::string& dir, const std::function<void(const fs::path& tmp)>& fill, const std::string& what) {
  fs::path final_dir = fs::absolute(dir).lexically_normal();
  if (final_dir.filename().empty()) final_dir = final_dir.parent_path();
  fs::create_directories(final_dir.parent_path());
  std::random_device rd;
  const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(rd());
  const fs::path tmp = final_dir.parent_path() / ("." + final_dir.filename().string() + ".tmp-" + tag);
  try {
    fs::create_directories(tmp);
    fill(tmp);
    fsync_dir(tmp.string());
    if (fs::exists(final_dir)) {
      const fs::path old = final_dir.parent_path() / ("." + final_dir.filename().string() + ".old-" + tag);
      fs::rename(final_dir, old);
      fs::rename(tmp, final_dir);
      remove_tree(old.string());  // a leftover is a hidden directory, removed when the job next starts
    } else {
      fs::rename(tmp, final_dir);
    }
    fsync_dir(final_dir.parent_path().string());
  } catch (const fs::filesystem_error& e) {
    remove_tree(tmp.string());
    throw UserError("could not " + (what.empty() ? "write " + dir : what) + ": " + e.what());
  } catch (...) {
    remove_tree(tmp.string());
    throw;
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError("could not read " + path + ": " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

SignalGuard::SignalGuard(void (*handler)(int))
    : prev_int_(std::signal(SIGINT, handler)), prev_term_(std::signal(SIGTERM, handler)) {}

SignalGuard::~SignalGuard() {
  std::signal(SIGINT, prev_int_);
  std::signal(SIGTERM, prev_term_);
}

nlohmann::json parse_json(const std::string& text, const std::string& what, const std::string& hint) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // parse_error (syntax) or out_of_range 406 (a number that does not fit a double or 64-bit integer)
    std::string why = e.what();
    auto bracket = why.find("] ");
    if (bracket != std::string::npos) why = why.substr(bracket + 2);
    throw UserError(what + ": not valid JSON: " + why + (hint.empty() ? "" : "; " + hint));
  }
}

nlohmann::json read_json_file(const std::string& path, const std::string& hint) {
  return parse_json(read_file(path), path, hint);
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

static size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

static std::vector<std::string> sorted_entries(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (!d) return names;
  while (dirent* e = readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.emplace_back(e->d_name);
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

bool remove_tree(const std::string& path, std::string* error) {
  auto fail = [&](const char* what, const std::string& p) {
    if (error) *error = std::string(what) + " " + p + ": " + std::strerror(errno);
    return false;
  };
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) return errno == ENOENT ? true : fail("cannot stat", path);
  if (!S_ISDIR(st.st_mode)) return unlink(path.c_str()) == 0 || errno == ENOENT ? true : fail("cannot remove", path);
  if (access(path.c_str(), R_OK | X_OK) != 0) return fail("cannot read", path);
  for (const auto& name : sorted_entries(path))
    if (!remove_tree(path + "/" + name, error)) return false;
  return rmdir(path.c_str()) == 0 || errno == ENOENT ? true : fail("cannot remove", path);
}

void walk_tree(const std::string& dir, const std::function<bool(const std::string&, bool)>& visit) {
  for (const auto& name : sorted_entries(dir)) {
    const std::string p = dir + "/" + name;
    struct stat st {};
    if (lstat(p.c_str(), &st) != 0) continue;
    const bool is_dir = S_ISDIR(st.st_mode);
    if (visit(p, is_dir) && is_dir) walk_tree(p, visit);
  }
}

std::string closest_match(const std::string& name, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::string::npos;
  for (const auto& c : candidates) {
    size_t d = edit_distance(name, c);
    if (d < best_d) best_d = d, best = c;
  }
  // Accept up to a third of the name's length in edits (a typo, a wrong section), at least 2.
  size_t limit = std::max<size_t>(2, name.size() / 3);
  return best_d <= limit ? best : std::string();
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + ")";
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string name_problem(const std::string& name) {
  if (name.empty() || name.find('/') != std::string::npos || name[0] == '.')
    return "\"" + name + "\" is not a valid name: use letters, digits, '-', '_' (no '/', no leading '.')";
  return "";
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

uint64_t fnv1a64(const void* data, size_t size, uint64_t h) {
  auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

Progress::Progress(std::string label, uint64_t total, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), tty_(::isatty(2)),
      start_(std::chrono::steady_clock::now()), last_draw_(start_) {}

void Progress::update(uint64_t done) {
  auto now = std::chrono::steady_clock::now();
  double pct = total_ ? 100.0 * double(done) / double(total_) : 100.0;
  double secs = std::chrono::duration<double>(now - start_).count();
  if (tty_) {
    if (now - last_draw_ < std::chrono::milliseconds(200) && done < total_) return;
    last_draw_ = now;
    std::fprintf(stderr, "\r%s: %5.1f%% (%llu/%llu%s%s) %.0fs   ", label_.c_str(), pct,
                 (unsigned long long)done, (unsigned long long)total_, unit_.empty() ? "" : " ",
                 unit_.c_str(), secs);
    std::fflush(stderr);
  } else {
    uint64_t decile = total_ ? (done * 10) / total_ : 10;
    if (decile <= last_decile_ || decile >= 10) return;
    last_decile_ = decile;
    if (secs < 2.0) return;  // short work needs no progress lines
    std::fprintf(stderr, "%s: %3llu%% (%.0fs)\n", label_.c_str(), (unsigned long long)decile * 10, secs);
  }
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::fprintf(stderr, "%s%s: done (%llu%s%s) in %.1fs\n", tty_ ? "\r" : "", label_.c_str(),
               (unsigned long long)total_, unit_.empty() ? "" : " ", unit_.c_str(), secs);
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < INT_MIN || x > INT_MAX)
    throw UserError(std::string("environment variable ") + name + "=\"" + v + "\" is not an integer");
  return static_cast<int>(x);
}

}  // namespace lt
