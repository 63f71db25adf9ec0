#include "lora_trainer/core/outputs.hpp"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <set>

#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;

namespace lt {

static void write_all(int fd, const std::string& path, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw UserError("could not write " + path + ": " + std::strerror(errno));
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  write_file_atomic(path, {{contents.data(), contents.size()}});
}

void write_file_atomic(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces) {
  fs::path target(path);
  if (target.has_parent_path()) fs::create_directories(target.parent_path());
  recover_interrupted_writes(path);
  const std::string tmp = path + ".tmp-" + temp_tag(path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);  // a new file: nothing else is truncated
  if (fd < 0) throw UserError("could not create " + tmp + ": " + std::strerror(errno));
  try {
    for (const auto& [data, size] : pieces) write_all(fd, tmp, static_cast<const char*>(data), size);
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

void append_file(const std::string& path, const std::string& bytes, const std::string& hint) {
  const std::string then = hint.empty() ? "" : "; " + hint;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) throw UserError("could not write " + path + ": " + std::strerror(errno) + then);
  struct stat st {};
  const bool sized = ::fstat(fd, &st) == 0;  // a device (/dev/full) has no size to cut back to, nor a torn record
  try {
    write_all(fd, path, bytes.data(), bytes.size());
  } catch (const UserError& e) {
    // A part of a record would be read back as a damaged one: the file keeps whole records only.
    std::string torn;
    if (!sized || (S_ISREG(st.st_mode) && ::ftruncate(fd, st.st_size) != 0))
      torn = " (and a part of the last record may be left at its end: " + std::string(std::strerror(errno)) + ")";
    ::close(fd);
    throw UserError(e.what() + torn + then);
  }
  if (::close(fd) != 0) throw UserError("could not write " + path + ": " + std::strerror(errno) + then);
}

namespace {

// The process id in a leftover's tag "PID-N-CHECK" (0 when it has none).
long tag_pid(const std::string& tag) {
  char* end = nullptr;
  const long pid = std::strtol(tag.c_str(), &end, 10);
  return end != tag.c_str() && *end == '-' && pid > 0 ? pid : 0;
}

bool process_gone(long pid) { return pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH); }

bool lexists(const std::string& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0;
}

// Puts `src` (anything but a socket or device) at `dst` without copying data where a hard link will
// do: directories are made anew and filled the same way, links are recreated.
void keep_entry(const std::string& src, const std::string& dst) {
  struct stat st {};
  if (::lstat(src.c_str(), &st) != 0) throw UserError("could not keep " + src + ": " + std::strerror(errno));
  auto fail = [&](const char* verb) { throw UserError(std::string("could not keep ") + src + " (" + verb + " " + dst + "): " + std::strerror(errno)); };
  if (S_ISDIR(st.st_mode)) {
    if (::mkdir(dst.c_str(), st.st_mode & 07777) != 0) fail("mkdir");
    for (const auto& name : sorted_entries(src)) keep_entry(src + "/" + name, dst + "/" + name);
  } else if (S_ISLNK(st.st_mode)) {
    std::string target(static_cast<size_t>(st.st_size > 0 ? st.st_size : PATH_MAX) + 1, '\0');
    const ssize_t n = ::readlink(src.c_str(), target.data(), target.size());
    if (n < 0) fail("readlink for");
    target.resize(static_cast<size_t>(n));
    if (::symlink(target.c_str(), dst.c_str()) != 0) fail("symlink");
  } else if (S_ISREG(st.st_mode)) {
    if (::link(src.c_str(), dst.c_str()) == 0) return;
    std::error_code ec;  // a file system without hard links (or too many of them): a copy
    if (!fs::copy_file(src, dst, ec)) throw UserError("could not keep " + src + " (copy to " + dst + "): " + ec.message());
  } else if (S_ISFIFO(st.st_mode)) {
    if (::mkfifo(dst.c_str(), st.st_mode & 07777) != 0) fail("mkfifo");
  } else {
    throw UserError(src + " is a socket or device file; it cannot be kept when its directory is rewritten. Move it "
                    "elsewhere and run the command again");
  }
}

}  // namespace

namespace {

// `path` as the temporaries' CHECK names it: the canonical path of its directory (links resolved), then
// its own name. A trailing slash is dropped.
fs::path check_path(const std::string& path) {
  fs::path target = fs::absolute(path).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();
  std::error_code ec;  // an unreadable directory on the way: its path as given
  const fs::path dir = fs::weakly_canonical(target.parent_path(), ec);
  return (ec ? target.parent_path() : dir) / target.filename();
}

std::string tag_check(const fs::path& target, const std::string& pid_and_n) {
  const std::string what = target.string() + '\n' + pid_and_n;
  return hex64(fnv1a64(what.data(), what.size()));
}

// TAG = PID-N-CHECK, with CHECK the digest of `target`, PID and N.
bool tag_fits(const fs::path& target, const std::string& tag) {
  const size_t first = tag.find('-'), second = first == std::string::npos ? first : tag.find('-', first + 1);
  if (second == std::string::npos || tag.size() != second + 17 || tag_pid(tag) == 0) return false;
  for (size_t k = first + 1; k < second; ++k)
    if (!std::isdigit(static_cast<unsigned char>(tag[k]))) return false;
  return tag.compare(second + 1, 16, tag_check(target, tag.substr(0, second))) == 0;
}

}  // namespace

std::string temp_tag(const std::string& target, long pid) {
  std::random_device rd;
  const std::string pid_and_n = std::to_string(pid > 0 ? pid : static_cast<long>(::getpid())) + "-" + std::to_string(rd());
  return pid_and_n + "-" + tag_check(check_path(target), pid_and_n);
}

std::string temporary_target(const std::string& path) {
  const fs::path p = fs::absolute(path).lexically_normal();
  const std::string name = p.filename().string();
  const fs::path parent = p.parent_path();
  if (name.empty()) return "";
  for (const char* marker : {".tmp-", ".old-", ".del-"}) {
    const size_t at = name.rfind(marker);
    if (at == std::string::npos) continue;
    const std::string tag = name.substr(at + 5);
    // A directory's `.NAME.<marker>TAG`, and a file's `PATH.tmp-TAG` (a hidden file's looks the same).
    if (name[0] == '.' && at > 1 && tag_fits(check_path((parent / name.substr(1, at - 1)).string()), tag))
      return (parent / name.substr(1, at - 1)).string();
    if (std::string(marker) == ".tmp-" && at > 0 && tag_fits(check_path((parent / name.substr(0, at)).string()), tag))
      return (parent / name.substr(0, at)).string();
  }
  return "";
}

void note_once(const std::string& key, const std::string& text) {
  static std::mutex mutex;
  static std::set<std::string> noted;
  std::lock_guard<std::mutex> lock(mutex);
  if (noted.insert(key).second) std::fprintf(stderr, "note: %s\n", text.c_str());
}

int recover_interrupted_writes(const std::string& path, bool locked) {
  fs::path target = fs::absolute(path).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();
  const std::string parent = target.parent_path().string(), name = target.filename().string();
  const fs::path checked = check_path(target.string());
  const std::string dir_tmp = "." + name + ".tmp-", dir_old = "." + name + ".old-", file_tmp = name + ".tmp-",
                    dir_del = "." + name + ".del-";  // a directory being deleted (delete_checkpoint): removed, never put back
  std::vector<std::string> tmps, olds;
  for (const auto& e : sorted_entries(parent)) {
    for (const auto* prefix : {&dir_tmp, &dir_old, &file_tmp, &dir_del}) {
      if (e.size() <= prefix->size() || e.compare(0, prefix->size(), *prefix) != 0) continue;
      const std::string tag = e.substr(prefix->size()), p = parent + "/" + e;
      if (!tag_fits(checked, tag)) {
        // Named like one of ours but without the proof: the user's, an older lora_trainer's, or a
        // temporary of another path (a hidden file's `.NAME.tmp-TAG`): never touched.
        if (temporary_target(p).empty())
          note_once(p, "left " + p + " alone: it is named like a temporary of " + target.string() + " but was not made "
                    "by this program for it (a file of yours, or an older lora_trainer's); delete it if you do not need it");
        continue;
      }
      if (!locked && !process_gone(tag_pid(tag))) continue;  // a write in progress
      (prefix == &dir_old ? olds : tmps).push_back(p);
    }
  }
  int handled = 0;
  if (!olds.empty() && !lexists(target.string())) {
    // A kill between the two renames of a replace: the complete old directory goes back in place.
    if (::rename(olds.back().c_str(), target.c_str()) == 0) {
      std::fprintf(stderr, "note: %s was missing after an interrupted write; put back its earlier contents from %s\n",
                   target.c_str(), olds.back().c_str());
      olds.pop_back();
      ++handled;
    }
  }
  for (const auto* list : {&tmps, &olds})
    for (const auto& p : *list)
      if (remove_tree(p)) {
        std::printf("removed %s, left by an interrupted write of %s\n", p.c_str(), target.c_str());
        ++handled;
      }
  std::fflush(stdout);
  return handled;
}

namespace {

std::string canonical_dir(const std::string& dir) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(dir), ec).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.string();
}

void write_record(const fs::path& dir, const std::string& path, const WriteOwner& owner, std::vector<std::string> files) {
  files.erase(std::remove(files.begin(), files.end(), std::string(kWriteRecord)), files.end());
  const nlohmann::json record = {{"writer", "lora_trainer"}, {"path", path},   {"kind", owner.kind},
                                 {"by", owner.by},           {"of", owner.of}, {"files", files}};
  write_file_atomic((dir / kWriteRecord).string(), record.dump(2) + "\n");
}

}  // namespace

std::optional<WriteRecord> read_write_record(const std::string& dir) {
  const std::string file = (fs::path(dir) / kWriteRecord).string();
  struct stat st {};
  if (::lstat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > (1 << 24)) return std::nullopt;
  try {
    const nlohmann::json j = parse_json(read_file(file), file);
    if (!j.is_object() || j.value("writer", std::string()) != "lora_trainer") return std::nullopt;
    WriteRecord r;
    r.path = j.at("path").get<std::string>();
    if (r.path != canonical_dir(dir)) return std::nullopt;  // a copy of one of ours: not written there
    r.kind = j.value("kind", std::string());
    r.by = j.value("by", std::string());
    r.of = j.value("of", std::string());
    for (const auto& f : j.at("files")) {
      const std::string n = f.get<std::string>();
      if (!n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos) r.files.push_back(n);
    }
    return r;
  } catch (const std::exception&) {
    return std::nullopt;  // damaged: proves nothing
  }
}

void publish_dir(const std::string& dir, const std::function<void(const fs::path& tmp)>& fill, const std::string& what,
                 const std::vector<std::string>& ours, const WriteOwner& owner) {
  const std::string action = what.empty() ? "write " + dir : what;
  // A link to a directory is written through: the link stays, its target gets the new contents.
  fs::path final_dir = fs::weakly_canonical(fs::absolute(dir)).lexically_normal();
  if (final_dir.filename().empty()) final_dir = final_dir.parent_path();
  const fs::path parent = final_dir.parent_path();
  try {
    fs::create_directories(parent);
  } catch (const fs::filesystem_error& e) {
    throw UserError("could not " + action + ": " + e.what());
  }
  recover_interrupted_writes(final_dir.string());
  struct stat st {};
  const bool replacing = ::lstat(final_dir.c_str(), &st) == 0;
  if (replacing && !S_ISDIR(st.st_mode))
    throw UserError("could not " + action + ": " + final_dir.string() + " exists and is not a directory. Nothing was written");
  const std::string tag = temp_tag(final_dir.string());
  const std::string name = final_dir.filename().string();
  const fs::path tmp = parent / ("." + name + ".tmp-" + tag);
  std::vector<std::string> dropped;
  try {
    if (::mkdir(tmp.c_str(), 0755) != 0) throw UserError("could not " + action + ": mkdir " + tmp.string() + ": " + std::strerror(errno));
    fill(tmp);
    write_record(tmp, final_dir.string(), owner, sorted_entries(tmp.string()));
    if (replacing) {
      // What an earlier write recorded there (a write of the same kind), or for a directory without a
      // record the caller's `ours`: those of its regular files that this write does not write again go.
      // Everything else of the old directory stays.
      const std::optional<WriteRecord> earlier = read_write_record(final_dir.string());
      const std::vector<std::string> none, &theirs = !earlier ? ours : !owner.kind.empty() && earlier->kind == owner.kind
                                                                           ? earlier->files : none;
      for (const auto& e : sorted_entries(final_dir.string())) {
        if (lexists((tmp / e).string())) continue;
        struct stat old_st {};
        if (std::find(theirs.begin(), theirs.end(), e) != theirs.end() && ::lstat((final_dir / e).c_str(), &old_st) == 0 &&
            S_ISREG(old_st.st_mode)) {
          dropped.push_back((final_dir / e).string());
          continue;
        }
        keep_entry((final_dir / e).string(), (tmp / e).string());
      }
    }
    fsync_dir(tmp.string());
    if (!replacing) {
      if (::rename(tmp.c_str(), final_dir.c_str()) != 0)
        throw UserError("could not " + action + ": rename " + tmp.string() + " to " + final_dir.string() + ": " + std::strerror(errno));
    } else if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      // One step: `dir` was the old directory until now, and is the new one from now on; the old
      // contents are at `tmp`, removed below (or by the next write, if killed first).
      remove_tree(tmp.string());
    } else if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) {
      // No exchange on this file system: two renames; a kill between them leaves `.NAME.old-TAG`, which
      // the next write (recover_interrupted_writes) puts back.
      const fs::path old = parent / ("." + name + ".old-" + tag);  // the same proof as the temporary's
      if (::rename(final_dir.c_str(), old.c_str()) != 0)
        throw UserError("could not " + action + ": rename " + final_dir.string() + ": " + std::strerror(errno));
      if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
        const int err = errno;
        ::rename(old.c_str(), final_dir.c_str());
        throw UserError("could not " + action + ": rename " + tmp.string() + ": " + std::strerror(err));
      }
      remove_tree(old.string());
    } else {
      throw UserError("could not " + action + ": exchange " + tmp.string() + " with " + final_dir.string() + ": " +
                      std::strerror(errno));
    }
    fsync_dir(parent.string());
  } catch (const fs::filesystem_error& e) {
    remove_tree(tmp.string());
    throw UserError("could not " + action + ": " + e.what());
  } catch (...) {
    remove_tree(tmp.string());
    throw;
  }
  for (const auto& d : dropped)
    std::printf("removed %s: the earlier write there made it, and this one does not write it again\n", d.c_str());
}

}  // namespace lt
