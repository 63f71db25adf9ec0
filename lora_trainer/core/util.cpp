#include "lora_trainer/core/util.hpp"

#include <nlohmann/json.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <stdio.h>
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
#include <unordered_set>
#include <sstream>

namespace fs = std::filesystem;

namespace lt {

std::vector<std::string> sorted_entries(const std::string& dir) {
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

std::string first_problems(const std::vector<std::string>& problems, size_t shown) {
  std::string text;
  for (size_t i = 0; i < problems.size() && i < shown; ++i) text += (i ? "; " : "") + problems[i];
  if (problems.size() > shown) text += "; ...";
  return text;
}

void require_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  const std::string label = what.empty() ? path : what + " " + path;
  if (::stat(path.c_str(), &st) != 0) throw UserError("could not read " + label + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    throw UserError(label + " is not a regular file (" +
                    (S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO" : "a device or socket") +
                    "); give a file");
}

int open_regular_file(const std::string& path, uint64_t* size, const std::string& what) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  const std::string label = what.empty() ? path : what + " " + path;
  if (fd < 0) throw UserError("could not read " + label + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    require_regular_file(path, what);  // names what it is
    throw UserError("could not read " + label);
  }
  // Reads block as usual from here on (O_NONBLOCK means nothing for a regular file's reads).
  if (size) *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

std::string use_another_checkpoint(const std::string& job) {
  return "use another checkpoint (`lora_trainer checkpoints " + job + " OUT_DIR` lists them)";
}

std::string read_file(const std::string& path) {
  uint64_t size = 0;
  const int fd = open_regular_file(path, &size);
  std::string out;
  out.reserve(static_cast<size_t>(size));
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      throw UserError("could not read " + path + ": " + std::strerror(err));
    }
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

SignalGuard::SignalGuard(void (*handler)(int))
    : prev_int_(std::signal(SIGINT, handler)), prev_term_(std::signal(SIGTERM, handler)) {}

SignalGuard::~SignalGuard() {
  std::signal(SIGINT, prev_int_);
  std::signal(SIGTERM, prev_term_);
}

namespace {

// Where the parser is, for messages: "/a/b/3".
struct JsonFrame {
  bool object = false;
  std::unordered_set<std::string> keys;
  std::string key;
  size_t index = 0;
};

std::string json_path(const std::vector<JsonFrame>& frames) {
  std::string out;
  for (const auto& f : frames) {
    out += "/" + (f.object ? f.key : std::to_string(f.index));
    if (out.size() > 80) return out.substr(0, 80) + "...";
  }
  return out.empty() ? "/" : out;
}

}  // namespace

namespace {

// parse_json's checks, for either kind of nlohmann value (key order kept or not).
template <class json>
json parse_checked(const std::string& text, const std::string& what, const std::string& hint) {
  const std::string tail = hint.empty() ? "" : "; " + hint;
  std::vector<JsonFrame> frames;
  auto element_done = [&] {
    if (!frames.empty() && !frames.back().object) ++frames.back().index;
  };
  // The parser builds its tree without recursion, but freeing and printing one recurse: the depth is
  // checked while parsing. nlohmann keeps the last of two equal keys; a config must not mean two things.
  typename json::parser_callback_t check = [&](int, typename json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (frames.size() >= static_cast<size_t>(kMaxJsonDepth))
          throw UserError(what + ": nested more than " + std::to_string(kMaxJsonDepth) + " levels deep (at " +
                          json_path(frames) + "); no input of lora_trainer needs that" + tail);
        frames.push_back(JsonFrame{event == json::parse_event_t::object_start, {}, {}, 0});
        break;
      case json::parse_event_t::key: {
        JsonFrame& f = frames.back();
        f.key = parsed.template get<std::string>();
        if (!f.keys.insert(f.key).second)
          throw UserError(what + ": key " + json_path(frames) + " is given twice in one object; keep one (the last "
                          "would silently win)" + tail);
        break;
      }
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        frames.pop_back();
        element_done();
        break;
      case json::parse_event_t::value:
        element_done();
        break;
    }
    return true;
  };
  try {
    return json::parse(text, check);
  } catch (const typename json::exception& e) {
    // parse_error (syntax) or out_of_range 406 (a number that does not fit a double or 64-bit integer)
    std::string why = e.what();
    auto bracket = why.find("] ");
    if (bracket != std::string::npos) why = why.substr(bracket + 2);
    throw UserError(what + ": not valid JSON: " + why + tail);
  }
}

}  // namespace

nlohmann::json parse_json(const std::string& text, const std::string& what, const std::string& hint) {
  return parse_checked<nlohmann::json>(text, what, hint);
}

nlohmann::ordered_json parse_ordered_json(const std::string& text, const std::string& what, const std::string& hint) {
  return parse_checked<nlohmann::ordered_json>(text, what, hint);
}

void rethrow_json_error(const std::string& what, const std::exception& e) {
  if (!dynamic_cast<const nlohmann::json::exception*>(&e)) return;
  // "[json.exception.type_error.302] (/model/vocab) type must be string, but is number"
  std::string why = e.what(), path;
  auto bracket = why.find("] ");
  if (bracket != std::string::npos) why = why.substr(bracket + 2);
  if (!why.empty() && why[0] == '(') {
    auto close = why.find(") ");
    if (close != std::string::npos) {
      path = why.substr(1, close - 1);
      why = why.substr(close + 2);
    }
  }
  const std::string must = "type must be ", but = ", but is ";
  if (why.rfind(must, 0) == 0 && why.find(but) != std::string::npos) {
    const size_t at = why.find(but);
    why = "must be " + why.substr(must.size(), at - must.size()) + ", not " + why.substr(at + but.size());
  }
  throw UserError(what + ": " + (path.empty() ? "" : path + ": ") + why +
                  ". The file is damaged, hand-edited or of another kind; fix it or write it again");
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
