#include "lora_trainer/formats/checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <hdf5.h>
#include <zlib.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <functional>
#include <filesystem>
#include <map>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/peft/lora.hpp"

namespace fs = std::filesystem;

namespace lt {

namespace {

struct DtypeInfo {
  torch::ScalarType torch_type;
  const char* name;
  hid_t (*h5_type)();
};

hid_t t_f32() { return H5T_NATIVE_FLOAT; }
hid_t t_f64() { return H5T_NATIVE_DOUBLE; }
hid_t t_u16() { return H5T_NATIVE_UINT16; }
hid_t t_i64() { return H5T_NATIVE_INT64; }
hid_t t_i32() { return H5T_NATIVE_INT32; }
hid_t t_i16() { return H5T_NATIVE_INT16; }
hid_t t_u8() { return H5T_NATIVE_UINT8; }
hid_t t_i8() { return H5T_NATIVE_INT8; }

const std::vector<DtypeInfo>& dtypes() {
  static const std::vector<DtypeInfo> table = {
      {torch::kFloat32, "float32", t_f32}, {torch::kFloat64, "float64", t_f64},
      {torch::kBFloat16, "bfloat16", t_u16}, {torch::kFloat16, "float16", t_u16},
      {torch::kInt64, "int64", t_i64},     {torch::kInt32, "int32", t_i32},
      {torch::kInt16, "int16", t_i16},     {torch::kUInt8, "uint8", t_u8},
      {torch::kInt8, "int8", t_i8},        {torch::kBool, "bool", t_u8},
  };
  return table;
}

const DtypeInfo& info_for(torch::ScalarType t) {
  for (const auto& d : dtypes())
    if (d.torch_type == t) return d;
  throw std::logic_error(std::string("checkpoint: unsupported dtype ") + c10::toString(t));
}

const DtypeInfo* info_for(const std::string& name) {
  for (const auto& d : dtypes())
    if (name == d.name) return &d;
  return nullptr;
}

// RAII for HDF5 ids.
struct H5Id {
  hid_t id = -1;
  herr_t (*closer)(hid_t) = nullptr;
  H5Id(hid_t i, herr_t (*c)(hid_t)) : id(i), closer(c) {}
  ~H5Id() {
    if (id >= 0 && closer) closer(id);
  }
  H5Id(const H5Id&) = delete;
  operator hid_t() const { return id; }
};

// Before the first HDF5 call (only this file makes them). No cleanup at exit: when a close fails (a
// flush on a full disk, a damaged file), HDF5 1.10 frees the file but keeps its id, and its exit
// handler then closes it again and crashes (HDFGroup/hdf5#2257, fixed in 1.14). Every file this
// program opens is closed by it; what a failed close leaves goes with the process.
void quiet_hdf5() {
  static bool done = false;
  if (!done) {
    H5dont_atexit();
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // errors are reported by us, with context
    done = true;
  }
}

void h5check(herr_t rc, const std::string& what) {
  if (rc < 0) throw UserError("HDF5: " + what + " failed (a damaged or truncated file? a full disk, when writing?)");
}

void write_string_attr(hid_t obj, const char* key, const std::string& value) {
  H5Id type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type, std::max<size_t>(1, value.size()));
  H5Id space(H5Screate(H5S_SCALAR), H5Sclose);
  H5Id attr(H5Acreate2(obj, key, type, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  h5check(attr.id, std::string("creating attribute ") + key);
  h5check(H5Awrite(attr, type, value.c_str()), std::string("writing attribute ") + key);
}

std::string read_string_attr(hid_t obj, const char* key) {
  if (H5Aexists(obj, key) <= 0) return "";
  H5Id attr(H5Aopen(obj, key, H5P_DEFAULT), H5Aclose);
  H5Id type(H5Aget_type(attr), H5Tclose);
  size_t n = H5Tget_size(type);
  if (n == 0 || n > (1u << 16)) throw UserError(std::string("HDF5: attribute ") + key + " has an impossible size (a damaged file)");
  std::string out(n, '\0');
  H5Id mem(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(mem, n);
  h5check(H5Aread(attr, mem, out.data()), std::string("reading attribute ") + key);
  out.erase(std::find(out.begin(), out.end(), '\0'), out.end());
  return out;
}

// A CRC-32 as the 8 hex digits the files record.
std::string hex32(uLong crc) {
  char b[16];
  std::snprintf(b, sizeof b, "%08lx", static_cast<unsigned long>(crc));
  return b;
}

// CRC-32 (zlib's) of a contiguous CPU tensor's bytes, as 8 hex digits.
std::string crc32_hex(const torch::Tensor& t) {
  uLong crc = crc32_z(0L, Z_NULL, 0);
  if (t.numel() > 0)
    crc = crc32_z(crc, static_cast<const Bytef*>(t.data_ptr()), static_cast<z_size_t>(t.numel() * t.element_size()));
  return hex32(crc);
}

// A write that failed: on a full file system (HDF5 does not pass errno on), say so, with the space
// free and the space the tensors need; otherwise the failure as it is.
[[noreturn]] void write_failed(const std::string& path, const NamedTensors& tensors, const UserError& e) {
  struct statvfs fs_info {};
  const std::string dir = fs::path(path).parent_path().string();
  uint64_t need = 0;
  for (const auto& [n, t] : tensors) need += static_cast<uint64_t>(t.numel()) * t.element_size();
  if (::statvfs(dir.empty() ? "." : dir.c_str(), &fs_info) == 0) {
    const uint64_t free_bytes = static_cast<uint64_t>(fs_info.f_bavail) * fs_info.f_frsize;
    if (free_bytes < need + (uint64_t{1} << 20))
      throw UserError("could not write " + path + ": No space left on device (" + std::to_string(free_bytes >> 10) +
                      " KiB free on its file system; the tensors need " + std::to_string(need >> 10) +
                      " KiB). Free space, or write elsewhere");
  }
  throw e;
}

// Where each tensor's bytes lie in the file (contiguous, unfiltered: HDF5 never parses them).
using DataRanges = std::vector<std::pair<uint64_t, uint64_t>>;  // offset, length; sorted

DataRanges write_h5_file(const std::string& path, const NamedTensors& tensors) {
  quiet_hdf5();
  DataRanges ranges;
  H5Id file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  h5check(file.id, "creating " + path);
  H5Id lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl, 1);
  for (const auto& [name, tensor] : tensors) {
    auto t = tensor.detach().to(torch::kCPU).contiguous();
    const DtypeInfo& di = info_for(t.scalar_type());
    std::vector<hsize_t> dims(t.sizes().begin(), t.sizes().end());
    H5Id space(t.dim() == 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(t.dim(), dims.data(), nullptr), H5Sclose);
    H5Id ds(H5Dcreate2(file, name.c_str(), di.h5_type(), space, lcpl, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
    h5check(ds.id, "creating dataset " + name + " in " + path);
    if (t.numel() > 0) {
      h5check(H5Dwrite(ds, di.h5_type(), H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data_ptr()), "writing " + name + " to " + path);
      const haddr_t at = H5Dget_offset(ds);
      if (at != HADDR_UNDEF) ranges.emplace_back(at, static_cast<uint64_t>(t.numel()) * t.element_size());
    }
    write_string_attr(ds, "dtype", di.name);
    write_string_attr(ds, "crc32", crc32_hex(t));
  }
  h5check(H5Fflush(file, H5F_SCOPE_GLOBAL), "flushing " + path);
  const hid_t id = file.id;
  file.id = -1;
  h5check(H5Fclose(id), "closing " + path);
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

DataRanges write_h5(const std::string& path, const NamedTensors& tensors) {
  try {
    return write_h5_file(path, tensors);
  } catch (const UserError& e) {
    write_failed(path, tensors, e);
  }
}

// The CRC-32 of a file's bytes outside `ranges` (HDF5's own structures: superblock, object headers,
// attributes, B-trees, heaps), and its size. Throws UserError naming the file when it cannot be read.
std::pair<std::string, uint64_t> structure_crc32(const std::string& path, const DataRanges& ranges) {
  uint64_t size = 0;
  const int fd = open_regular_file(path, &size);
  uLong crc = crc32_z(0L, Z_NULL, 0);
  std::vector<unsigned char> buf(1 << 20);
  // Reads only the gaps between the tensors' ranges: a base of many GiB costs its structures' bytes.
  auto add = [&](uint64_t from, uint64_t to) {
    while (from < to) {
      const ssize_t n = ::pread(fd, buf.data(), std::min<uint64_t>(buf.size(), to - from), static_cast<off_t>(from));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = n < 0 ? errno : 0;
        ::close(fd);
        throw UserError("could not read " + path + ": " + (err ? std::strerror(err) : "the file ended early"));
      }
      crc = crc32_z(crc, buf.data(), static_cast<z_size_t>(n));
      from += static_cast<uint64_t>(n);
    }
  };
  uint64_t at = 0;
  for (const auto& [offset, length] : ranges) {  // sorted by offset
    if (offset >= size) break;
    if (offset > at) add(at, offset);
    at = std::max(at, std::min(size, offset + length));
  }
  add(at, size);
  ::close(fd);
  return {hex32(crc), size};
}

void fsync_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

herr_t collect_dataset(hid_t group, const char* name, const H5L_info_t*, void* out) {
  // HDF5 1.12 changed H5Oget_info_by_name (a fields argument, H5O_info2_t); 1.10 has only the old one.
#if H5_VERSION_GE(1, 12, 0)
  H5O_info2_t oinfo;
  if (H5Oget_info_by_name3(group, name, &oinfo, H5O_INFO_BASIC, H5P_DEFAULT) >= 0 && oinfo.type == H5O_TYPE_DATASET)
#else
  H5O_info_t oinfo;
  if (H5Oget_info_by_name(group, name, &oinfo, H5P_DEFAULT) >= 0 && oinfo.type == H5O_TYPE_DATASET)
#endif
    static_cast<std::vector<std::string>*>(out)->push_back(name);
  return 0;
}

// `crc` (when given) receives the data's CRC-32, the one computed for the check (inspect reuses it).
torch::Tensor read_dataset(hid_t file, const std::string& name, const std::string& path, int* verified = nullptr,
                           std::string* crc = nullptr) {
  H5Id ds(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose);
  h5check(ds.id, "opening " + name + " in " + path);
  std::string dtype = read_string_attr(ds, "dtype");
  const DtypeInfo* di = info_for(dtype);
  if (!di) throw UserError(path + ": tensor " + name + " has unknown dtype \"" + dtype + "\"");
  H5Id space(H5Dget_space(ds), H5Sclose);
  h5check(space.id, "reading the shape of " + name + " in " + path);
  int rank = H5Sget_simple_extent_ndims(space);
  h5check(rank, "reading the shape of " + name + " in " + path);
  std::vector<hsize_t> dims(static_cast<size_t>(std::max(rank, 0)));
  if (rank > 0) h5check(H5Sget_simple_extent_dims(space, dims.data(), nullptr), "reading the shape of " + name + " in " + path);
  // The shape comes from the file: its size in bytes must fit in 64 bits and be what the file stores
  // for it (a save stores every tensor whole, uncompressed), before anything is allocated.
  std::vector<int64_t> shape;
  uint64_t bytes = c10::elementSize(di->torch_type);
  bool overflow = false;
  for (hsize_t d : dims) {
    overflow |= d > static_cast<hsize_t>(INT64_MAX) || __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes);
    shape.push_back(static_cast<int64_t>(d));
  }
  const uint64_t stored_bytes = H5Dget_storage_size(ds);
  uint64_t numel = 1;
  for (hsize_t d : dims) numel *= d;
  if (overflow || (numel > 0 && stored_bytes != bytes))
    throw UserError(path + ": tensor " + name + " has shape " + shape_text(shape) + " " + dtype + (overflow ? ", larger than 2^64 bytes" :
                    ", " + std::to_string(bytes) + " bytes, but the file stores " + std::to_string(stored_bytes) + " for it") +
                    ": the file is damaged; " + use_another_checkpoint());
  auto t = torch::empty(shape, torch::TensorOptions().dtype(di->torch_type));
  if (t.numel() > 0) h5check(H5Dread(ds, di->h5_type(), H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data_ptr()),
                             "reading " + name + " from " + path);
  // Checkpoints written before checksums have none; every later one is verified here, at every load.
  std::string stored = read_string_attr(ds, "crc32");
  const std::string actual = !stored.empty() || crc ? crc32_hex(t) : std::string();
  if (!stored.empty() && actual != stored)
    throw UserError(path + ": tensor " + name + " is corrupt: its data's CRC-32 is " + actual + ", the save recorded " +
                    stored + ". The file was damaged after it was written (disk, copy or transfer): copy it again, or " +
                    use_another_checkpoint());
  if (verified) *verified += stored.empty() ? 0 : 1;
  if (crc) *crc = actual;
  return t;
}

std::string shape_str(at::IntArrayRef s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

// Every field the trainers read, with its type: a damaged or hand-edited metadata.json is an error
// naming the field, not a JSON exception deep inside a restore.
void check_metadata_fields(const std::string& dir, const nlohmann::json& meta) {
  using J = nlohmann::json;
  auto fail = [&](const std::string& field, const std::string& expected) {
    std::string got = meta.contains(field) ? "it is " + meta[field].dump() : "it is missing";
    if (got.size() > 80) got = got.substr(0, 77) + "...";
    throw UserError(dir + "/metadata.json: field \"" + field + "\" must be " + expected + ", but " + got +
                    ". The checkpoint is damaged or was edited; use another (`lora_trainer checkpoints JOB OUT_DIR`)");
  };
  auto count = [](const J& v) { return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0); };
  auto need = [&](const char* field, const std::function<bool(const J&)>& ok, const char* expected, bool required) {
    if (!meta.contains(field)) {
      if (required) fail(field, expected);
      return;
    }
    if (!ok(meta[field])) fail(field, expected);
  };
  auto is_object = [](const J& v) { return v.is_object(); };
  need("kind", [](const J& v) { return v == "plain" || v == "lora"; }, "\"plain\" or \"lora\"", true);
  need("step", count, "a non-negative integer", true);
  need("tokens", count, "a non-negative integer", true);
  need("weights_only", [](const J& v) { return v.is_boolean(); }, "true or false", false);
  const bool full_state = !meta.value("weights_only", false);
  need("job", [](const J& v) {
    if (!v.is_object()) return false;
    for (const char* k : {"name", "project", "group", "kind"})
      if (v.contains(k) && !v[k].is_string()) return false;
    return true;
  }, "an object of strings (name, project, group, kind)", full_state);
  need("config", is_object, "an object (the job's config)", full_state);
  need("total_steps", count, "a non-negative integer", full_state);
  need("best_score", [](const J& v) { return v.is_null() || v.is_number(); }, "a number or null", false);
  need("best_stage", count, "a non-negative integer", false);
  need("trainable_params", [](const J& v) {
    if (!v.is_array()) return false;
    for (const auto& e : v)
      if (!e.is_string()) return false;
    return true;
  }, "a list of parameter names", full_state);
  need("data", [&](const J& v) {
    if (!v.is_object() || !v.contains("cursors") || !v["cursors"].is_object()) return false;
    for (auto& [k, c] : v["cursors"].items())
      if (k.empty() || k.find_first_not_of("0123456789") != std::string::npos || k.size() > 4 || !count(c)) return false;
    return true;
  }, "an object with \"cursors\" ({\"stage\": rows drawn})", full_state);
  need("state_h5", [&](const J& v) {
    if (!v.is_object() || !v.contains("bytes") || !v["bytes"].is_number_unsigned() || !v.contains("structure_crc32") ||
        !v["structure_crc32"].is_string() || !v.contains("data") || !v["data"].is_array())
      return false;
    for (const auto& r : v["data"])
      if (!r.is_array() || r.size() != 2 || !r[0].is_number_unsigned() || !r[1].is_number_unsigned()) return false;
    return true;
  }, "an object {\"bytes\", \"structure_crc32\", \"data\": [[offset, length], ...]}", false);
  need("lora", [](const J& v) {
    if (!v.is_object()) return false;
    if (v.contains("rank") && !(v["rank"].is_number_integer() && v["rank"].get<int64_t>() > 0)) return false;
    if (v.contains("alpha") && !v["alpha"].is_number()) return false;
    if (v.contains("boundary_step") && !v["boundary_step"].is_number_integer()) return false;
    if (v.contains("in_lora_phase") && !v["in_lora_phase"].is_boolean()) return false;
    return true;
  }, "an object (rank > 0, alpha, boundary_step, in_lora_phase, targets)", meta.value("kind", std::string()) == "lora");
}

}  // namespace

std::string dtype_name(torch::ScalarType t) { return info_for(t).name; }

StateKind parse_state_kind(const std::string& name) {
  if (name == "plain") return StateKind::Plain;
  if (name == "lora") return StateKind::Lora;
  throw std::invalid_argument("unknown state kind \"" + name + "\" (known: plain, lora)");
}

std::string state_kind_name(StateKind kind) { return kind == StateKind::Lora ? "lora" : "plain"; }

// A save writes into the hidden sibling `.NAME.tmp-TAG` and renames it into place; the checkpoint it
// replaces goes aside as `.NAME.old-TAG` until the rename is done (publish_dir). Either left behind is an
// interrupted save.
static bool is_interrupted_save(const std::string& name) {
  return name.size() > 1 && name[0] == '.' &&
         (name.find(".tmp-") != std::string::npos || name.find(".old-") != std::string::npos);
}

int remove_interrupted_saves(const std::string& job_dir) {
  std::vector<std::string> targets;  // the checkpoint each leftover was a write of
  walk_tree(job_dir, [&](const std::string& p, bool is_dir) {
    if (!is_dir) return false;
    const std::string name = fs::path(p).filename().string();
    if (is_interrupted_save(name)) {
      const size_t tmp = name.rfind(".tmp-"), old = name.rfind(".old-");
      const size_t at = tmp == std::string::npos ? old : old == std::string::npos ? tmp : std::max(tmp, old);
      targets.push_back((fs::path(p).parent_path() / name.substr(1, at - 1)).string());
      return false;
    }
    return true;
  });
  std::sort(targets.begin(), targets.end());
  targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
  int handled = 0;
  for (const auto& t : targets) handled += recover_interrupted_writes(t, /*locked=*/true);
  return handled;
}

void save_checkpoint(const std::string& dir, const NamedTensors& tensors, const nlohmann::json& metadata,
                     const std::vector<std::string>& ours) {
  publish_dir(dir, [&](const fs::path& tmp) {
    const std::string state = (tmp / "state.h5").string();
    const DataRanges ranges = write_h5(state, tensors);
    fsync_file(state);
    nlohmann::json meta = metadata;  // metadata.json last: a directory holding it is complete
    meta["format_version"] = kCheckpointFormatVersion;
    // HDF5's structures are checked before HDF5 parses them (HDF5 1.10 reads past its buffers on some
    // damaged files); the tensors' bytes have their own CRC-32s.
    const auto [crc, bytes] = structure_crc32(state, ranges);
    nlohmann::json data = nlohmann::json::array();
    for (const auto& [at, len] : ranges) data.push_back({at, len});
    meta["state_h5"] = {{"bytes", bytes}, {"structure_crc32", crc}, {"data", data}};
    write_file_atomic((tmp / "metadata.json").string(), meta.dump(2) + "\n");
  }, "save checkpoint " + dir, ours);
}

bool is_checkpoint(const std::string& dir) {
  return fs::exists(fs::path(dir) / "metadata.json") && fs::exists(fs::path(dir) / "state.h5");
}

// A checkpoint's "lora" section against the rest of its metadata: in_lora_phase and boundary_step
// against its kind and step, rank, alpha, rslora and dora against its config's optimization/lora/*.
// A contradiction is a damaged or hand-edited file; merging or resuming it would use one of two
// scales or phases.
static void check_lora_metadata(const CheckpointMeta& ck) {
  if (!ck.lora) return;
  const LoraMetadata& l = *ck.lora;
  const nlohmann::json& meta = ck.raw;
  const std::string file = (fs::path(ck.dir) / "metadata.json").string();
  const std::string tail = ". The checkpoint is damaged or hand-edited and would compute or resume wrongly; " +
                           use_another_checkpoint();
  const bool lora_kind = ck.kind == StateKind::Lora;
  const std::string kind = state_kind_name(ck.kind);
  if (l.in_lora_phase && *l.in_lora_phase != lora_kind)
    throw UserError(file + ": lora.in_lora_phase is " + (*l.in_lora_phase ? "true" : "false") + " but kind is \"" + kind +
                    "\": a " + (lora_kind ? "LoRA" : "plain") + " state is " + (lora_kind ? "" : "not ") +
                    "in the LoRA phase" + tail);
  if (l.boundary_step) {
    const int64_t boundary = *l.boundary_step;
    if (boundary < 0 || (lora_kind && boundary > ck.step) || (!lora_kind && ck.step > boundary))
      throw UserError(file + ": lora.boundary_step " + std::to_string(boundary) + " and step " + std::to_string(ck.step) +
                      " contradict kind \"" + kind + "\": the LoRA phase starts at the " + "boundary, so a " +
                      (lora_kind ? "LoRA state's step is at or after it" : "plain state's step is at or before it") + tail);
  }
  // The lora section repeats the job's optimization/lora/* settings: both were written from one value.
  // Compared where the file has both (older files lack some).
  json_context(file, [&] {
    const nlohmann::json none = nlohmann::json::object();
    const nlohmann::json& block = meta.at("lora");
    const nlohmann::json cfg = meta.value("config", none).value("optimization", none).value("lora", none);
    for (const std::string key : {"rank", "alpha", "rslora", "dora"}) {
      if (!block.contains(key) || !cfg.contains(key)) continue;
      const nlohmann::json &a = block[key], &b = cfg[key];
      const bool same = a == b || (a.is_number() && b.is_number() && a.get<double>() == b.get<double>());
      if (!same)
        throw UserError(file + ": lora." + key + " is " + a.dump() + " but its config's optimization/lora/" + key +
                        " is " + b.dump() + ": the metadata contradicts itself about the adapters it holds" + tail);
    }
  });
}

// A full state's counters against each other: step within its own schedule (total_steps, finished),
// tokens and the data cursors against the step (exactly where its per_step record says every step
// was alike; a sampler's cursor counts the rows it drew, from a counter-based hash, so no dataset
// has an end: what is impossible is more rows than the steps drew). A contradiction is a damaged or
// hand-edited metadata.json, which would resume at another place in the schedule or the data.
static void check_counters(const CheckpointMeta& ck) {
  const nlohmann::json& meta = ck.raw;
  const std::string file = ck.dir + "/metadata.json";
  const std::string damaged = ": its metadata contradicts itself (damaged or hand-edited); " +
                              use_another_checkpoint(ck.job_name);
  const std::string step = "step " + std::to_string(ck.step), steps = std::to_string(ck.step) + " steps";
  json_context(file, [&] {
    const int64_t total = meta.at("total_steps").get<int64_t>();
    if (ck.step > total)
      throw UserError(file + ": " + step + " is past its own schedule's end (total_steps " + std::to_string(total) + ")" +
                      damaged);
    if (meta.contains("finished") && meta["finished"].get<bool>() != (ck.step >= total))
      throw UserError(file + ": finished is " + meta["finished"].dump() + " at " + step + " of total_steps " +
                      std::to_string(total) + damaged);
    // Every step trains at least one token, and no token comes without a step.
    if (ck.tokens < ck.step || (ck.step == 0) != (ck.tokens == 0))
      throw UserError(file + ": tokens " + std::to_string(ck.tokens) + " cannot have been trained in " + steps +
                      " (every step trains tokens, and only steps do)" + damaged);
    const nlohmann::json per_step = meta.value("per_step", nlohmann::json());
    const nlohmann::json& cursors = meta.at("data").at("cursors");
    if (!per_step.is_object()) return;  // older checkpoints, and jobs resumed with another batch size
    const int64_t rows = per_step.at("rows").get<int64_t>(), tokens = per_step.at("tokens").get<int64_t>();
    if (rows <= 0 || tokens <= 0 || tokens % rows != 0)
      throw UserError(file + ": per_step " + per_step.dump() + " is not rows > 0 of a whole number of tokens each" + damaged);
    if (ck.tokens / tokens != ck.step || ck.tokens % tokens != 0)
      throw UserError(file + ": tokens " + std::to_string(ck.tokens) + " is not " + step + " x " + std::to_string(tokens) +
                      " tokens a step (per_step.tokens)" + damaged);
    uint64_t could = 0;  // the rows the steps drew; saturated (a hand-edited step may be huge)
    if (__builtin_mul_overflow(static_cast<uint64_t>(ck.step), static_cast<uint64_t>(rows), &could)) could = UINT64_MAX;
    uint64_t drawn = 0;
    for (auto& [stage, c] : cursors.items()) {
      const uint64_t n = c.get<uint64_t>();
      if (n > could - drawn)
        throw UserError(file + ": data.cursors[\"" + stage + "\"] is " + std::to_string(n) + " rows drawn by stage " + stage +
                        (n > could ? "" : " (with the other stages' " + std::to_string(drawn) + ")") + ", more than the " +
                        std::to_string(could) + " rows that " + steps + " of " + std::to_string(rows) +
                        " rows (per_step.rows) drew" + damaged);
      drawn += n;
    }
  });
}

CheckpointMeta CheckpointMeta::read(const std::string& dir) {
  if (!fs::is_directory(dir)) throw UserError("checkpoint " + dir + " does not exist");
  if (!is_checkpoint(dir))
    throw UserError(dir + " is not a complete checkpoint (no metadata.json/state.h5): an interrupted save, or "
                    "a job directory? `lora_trainer checkpoints NAME OUT_DIR` lists the checkpoints");
  nlohmann::json meta = read_json_file((fs::path(dir) / "metadata.json").string(),
                                       "the checkpoint is damaged; use another (`lora_trainer checkpoints JOB OUT_DIR`)");
  if (!meta.is_object()) throw UserError(dir + "/metadata.json is not a JSON object; the checkpoint is damaged");
  const auto& fv = meta.contains("format_version") ? meta["format_version"] : nlohmann::json();
  const int64_t version = fv.is_number_integer() ? fv.get<int64_t>() : 0;
  if (version < kOldestReadableFormatVersion || version > kCheckpointFormatVersion)
    throw UserError(dir + ": checkpoint format version " + std::to_string(version) + ", this build reads versions " +
                    std::to_string(kOldestReadableFormatVersion) + " to " + std::to_string(kCheckpointFormatVersion) +
                    (version > kCheckpointFormatVersion ? ": it was written by a newer lora_trainer; use that one"
                                                        : ": a damaged or hand-edited metadata.json?"));
  CheckpointMeta ck;
  ck.format_version = static_cast<int>(version);
  json_context(dir + "/metadata.json", [&] {
    check_metadata_fields(dir, meta);
    ck.dir = dir;
    ck.kind = parse_state_kind(meta["kind"].get<std::string>());
    ck.step = meta["step"].get<int64_t>();
    ck.tokens = meta["tokens"].get<int64_t>();
    ck.weights_only = meta.value("weights_only", false);
    ck.job_name = meta.contains("job") ? meta["job"].value("name", std::string("?")) : "?";
    ck.raw = std::move(meta);
    // What the metadata says must agree with itself, for every reader (restore, eval, export, init_from).
    if (!ck.weights_only) {
      check_counters(ck);
      if (ck.raw.contains("lora")) ck.lora = LoraMetadata::from_json(ck.raw["lora"], dir + "/metadata.json");
      check_lora_metadata(ck);
    }
  });
  return ck;
}

nlohmann::json read_checkpoint_metadata(const std::string& dir) { return CheckpointMeta::read(dir).raw; }

NamedTensors read_checkpoint_tensors(const std::string& dir, int* verified) {
  return read_checkpoint_tensors(CheckpointMeta::read(dir), verified);
}

// read_checkpoint_tensors; `crcs` (when given) receives each tensor's CRC-32, in the same order: the
// one computed for the check, so `inspect` does not compute it again.
// state.h5's size and the CRC-32 of its HDF5 structures against what the save recorded (metadata's
// state_h5; checkpoints written before it have none): HDF5 never parses a damaged file.
static void check_state_file(const CheckpointMeta& ck, const std::string& path) {
  if (!ck.raw.contains("state_h5")) return;
  const nlohmann::json& s = ck.raw["state_h5"];
  const std::string tail = ": the file is damaged (a truncated copy, a flipped bit?); " +
                           use_another_checkpoint(ck.job_name);
  const uint64_t bytes = s["bytes"].get<uint64_t>();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw UserError("could not read " + path + ": " + std::strerror(errno));
  if (static_cast<uint64_t>(st.st_size) != bytes)
    throw UserError(path + " has " + std::to_string(st.st_size) + " bytes; its save wrote " + std::to_string(bytes) +
                    " (metadata.json: state_h5.bytes)" + tail);
  DataRanges ranges;
  uint64_t end = 0;
  for (const auto& r : s["data"]) {
    const uint64_t at = r[0].get<uint64_t>(), len = r[1].get<uint64_t>();
    if (at < end || len == 0 || len > bytes || at > bytes - len)
      throw UserError(ck.dir + "/metadata.json: state_h5.data [" + std::to_string(at) + ", " + std::to_string(len) +
                      "] does not lie in order inside the file's " + std::to_string(bytes) + " bytes" + tail);
    ranges.emplace_back(at, len);
    end = at + len;
  }
  const std::string want = s["structure_crc32"].get<std::string>();
  const auto [crc, read] = structure_crc32(path, ranges);
  if (crc != want || read != bytes)
    throw UserError(path + ": its HDF5 structures (everything but the tensors' bytes) have CRC-32 " + crc + ", its save "
                    "recorded " + want + " (metadata.json: state_h5.structure_crc32)" + tail);
}

static NamedTensors read_tensors(const CheckpointMeta& ck, int* verified, std::vector<std::string>* crcs) {
  quiet_hdf5();
  std::string path = (fs::path(ck.dir) / "state.h5").string();
  check_state_file(ck, path);
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  h5check(file.id, "opening " + path);
  std::vector<std::string> names;
  h5check(H5Lvisit(file, H5_INDEX_NAME, H5_ITER_INC, collect_dataset, &names), "listing " + path);
  std::sort(names.begin(), names.end());
  NamedTensors out;
  if (verified) *verified = 0;
  if (crcs) crcs->assign(names.size(), std::string());
  for (size_t i = 0; i < names.size(); ++i)
    out.emplace_back(names[i], read_dataset(file, names[i], path, verified, crcs ? &(*crcs)[i] : nullptr));
  return out;
}

// Format 1 kept the adapters apart, as lora/<name>; format 2 keeps them with the parameters of their
// layers, as params/<name>.
static void upgrade_names(int from_version, NamedTensors& tensors) {
  if (from_version >= 2) return;
  const std::string old_prefix = "lora/";
  for (auto& [name, t] : tensors)
    if (name.rfind(old_prefix, 0) == 0) name = kParamsPrefix + name.substr(old_prefix.size());
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
}

NamedTensors read_checkpoint_tensors(const CheckpointMeta& ck, int* verified) {
  NamedTensors tensors = read_tensors(ck, verified, nullptr);
  upgrade_names(ck.format_version, tensors);
  return tensors;
}

ParamTensors param_tensors(const NamedTensors& tensors) {
  ParamTensors out;
  for (const auto& [n, t] : tensors) {
    if (n.rfind(kParamsPrefix, 0) != 0) continue;
    const std::string name = n.substr(kParamsPrefix.size());
    if (is_adapter_param(name)) out.adapters[name] = t;
    else out.base.emplace_back(name, t);
  }
  return out;
}

void load_checkpoint_into(const std::string& dir, const NamedTensors& into,
                          const std::vector<std::string>& prefixes) {
  load_checkpoint_into(CheckpointMeta::read(dir), into, prefixes);
}

void load_checkpoint_into(const CheckpointMeta& ck, const NamedTensors& into,
                          const std::vector<std::string>& prefixes) {
  const std::string& dir = ck.dir;
  auto selected = [&](const std::string& name) {
    if (prefixes.empty()) return true;
    for (const auto& p : prefixes)
      if (name.rfind(p, 0) == 0) return true;
    return false;
  };
  NamedTensors stored = read_checkpoint_tensors(ck);
  std::map<std::string, torch::Tensor> by_name;
  for (auto& [n, t] : stored)
    if (selected(n)) by_name[n] = t;
  std::vector<std::string> problems;
  for (const auto& [name, target] : into) {
    if (!selected(name)) continue;
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      problems.push_back("missing " + name);
      continue;
    }
    const auto& src = it->second;
    if (src.sizes() != target.sizes())
      problems.push_back(name + ": shape " + shape_str(src.sizes()) + " in the checkpoint, " +
                         shape_str(target.sizes()) + " expected");
    else if (src.scalar_type() != target.scalar_type())
      problems.push_back(name + ": dtype " + dtype_name(src.scalar_type()) + " in the checkpoint, " +
                         dtype_name(target.scalar_type()) + " expected");
    by_name.erase(it);
  }
  for (const auto& [name, t] : by_name) problems.push_back("unexpected " + name);
  if (!problems.empty()) {
    std::string msg = "checkpoint " + dir + " does not match this job's state (" +
                      std::to_string(problems.size()) + " problems): ";
    for (size_t i = 0; i < problems.size() && i < 12; ++i) msg += (i ? "; " : "") + problems[i];
    if (problems.size() > 12) msg += "; ...";
    msg += ". Is it the right checkpoint for this model size (architecture/*) and phase?";
    throw UserError(msg);
  }
  torch::NoGradGuard ng;
  std::map<std::string, torch::Tensor> all(stored.begin(), stored.end());
  for (const auto& [name, target] : into)
    if (selected(name)) target.copy_(all.at(name));
}

nlohmann::json inspect_checkpoint(const std::string& dir) {
  nlohmann::json out;
  out["path"] = dir;
  const CheckpointMeta ck = CheckpointMeta::read(dir);
  out["metadata"] = ck.raw;
  nlohmann::json tensors = nlohmann::json::array();
  std::vector<std::string> crcs;
  const NamedTensors all = read_tensors(ck, nullptr, &crcs);
  for (size_t i = 0; i < all.size(); ++i) {
    const auto& [name, t] = all[i];
    auto c = t.contiguous();
    tensors.push_back({{"name", name},
                       {"dtype", dtype_name(c.scalar_type())},
                       {"shape", c.sizes().vec()},
                       {"crc32", crcs[i]},
                       {"fnv1a64", hex64(fnv1a64(c.data_ptr(), c.numel() * c.element_size()))}});
  }
  out["tensors"] = tensors;
  return out;
}

std::string verify_checkpoint(const std::string& dir) {
  int verified = 0;
  NamedTensors all = read_checkpoint_tensors(dir, &verified);
  int64_t bytes = 0;
  for (const auto& [n, t] : all) bytes += t.numel() * t.element_size();
  std::string out = dir + ": " + std::to_string(all.size()) + " tensors (" + std::to_string(bytes) + " bytes) read; ";
  if (verified == static_cast<int>(all.size())) return out + "every CRC-32 matches the one recorded at save";
  return out + std::to_string(verified) + " verified by their CRC-32, " + std::to_string(all.size() - verified) +
         " without a recorded checksum (saved by a build before checksums)";
}

std::optional<std::string> read_latest(const std::string& job_dir) {
  fs::path p = fs::path(job_dir) / "latest";
  if (!fs::exists(p)) return std::nullopt;
  std::string s = read_file(p.string());
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  // Empty (a hand edit, a copy gone wrong): starting over from step 0 would silently train over the
  // job's checkpoints, so it is an error that says what to do.
  if (s.empty())
    throw UserError(p.string() + " is empty: it should name the checkpoint to resume from. Write the name of one "
                    "listed by `lora_trainer checkpoints JOB OUT_DIR` into it (e.g. final/1280 or ntoks/2048), or "
                    "delete it to start the job over from step 0");
  // It names a checkpoint of this job: below the job directory, never another job's or an absolute path.
  const bool outside = s[0] == '/' || s == ".." || s.rfind("../", 0) == 0 || s.find("/../") != std::string::npos ||
                       (s.size() >= 3 && s.compare(s.size() - 3, 3, "/..") == 0);
  if (outside || s.find('\0') != std::string::npos || s.find('\n') != std::string::npos)
    throw UserError(p.string() + " names \"" + s.substr(0, 80) + "\", which is not a checkpoint inside the job directory "
                    "(a hand edit, or a damaged file). Write the name of one listed by `lora_trainer checkpoints JOB "
                    "OUT_DIR` into it (e.g. final/1280 or ntoks/2048), or delete it to start the job over from step 0");
  return s;
}

void write_latest(const std::string& job_dir, const std::string& suffix) {
  write_file_atomic((fs::path(job_dir) / "latest").string(), suffix + "\n");
}

std::vector<std::string> list_checkpoints(const std::string& job_dir) {
  std::vector<std::string> out;
  if (!fs::is_directory(job_dir)) return out;
  walk_tree(job_dir, [&](const std::string& path, bool is_dir) {
    if (!is_dir) return false;
    if (fs::path(path).filename().string().rfind(".", 0) == 0) return false;  // temporaries of a save in progress
    if (is_checkpoint(path)) {
      out.push_back(fs::relative(path, job_dir).string());
      return false;
    }
    return true;
  });
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace lt
