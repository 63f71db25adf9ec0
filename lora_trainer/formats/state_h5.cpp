// state.h5, the tensors of a checkpoint (checkpoint.hpp has the directory around it): one HDF5 dataset
// per tensor at its name, with string attributes "dtype" and "crc32" (zlib's CRC-32 of its bytes);
// bfloat16 and float16 stored as uint16 bit patterns. Every tensor is written whole, contiguous and
// unfiltered, so its bytes lie in one range of the file that HDF5 never parses.
#include "lora_trainer/formats/state_h5.hpp"

#include "lora_trainer/core/checksum.hpp"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <hdf5.h>
#include <zlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>

#include "lora_trainer/core/util.hpp"

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
std::string crc32_hex(const torch::Tensor& t) { return hex32(tensor_crc32(t)); }

// A write that failed: on a full file system (HDF5 does not pass errno on), say so, with the space
// free and the space the tensors need; otherwise the failure as it is.
[[noreturn]] void write_failed(const std::string& path, uint64_t need, const UserError& e) {
  struct statvfs fs_info {};
  const std::string dir = fs::path(path).parent_path().string();
  if (::statvfs(dir.empty() ? "." : dir.c_str(), &fs_info) == 0) {
    const uint64_t free_bytes = static_cast<uint64_t>(fs_info.f_bavail) * fs_info.f_frsize;
    if (free_bytes < need + (uint64_t{1} << 20))
      throw UserError("could not write " + path + ": No space left on device (" + std::to_string(free_bytes >> 10) +
                      " KiB free on its file system; the tensors need " + std::to_string(need >> 10) +
                      " KiB). Free space, or write elsewhere");
  }
  throw e;
}

DataRanges write_h5_file(const std::string& path, const TensorStream& tensors) {
  quiet_hdf5();
  DataRanges ranges;
  H5Id file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  h5check(file.id, "creating " + path);
  H5Id lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl, 1);
  for (size_t i = 0; i < tensors.names.size(); ++i) {
    const std::string& name = tensors.names[i];
    auto t = tensors.get(i).detach().to(torch::kCPU).contiguous();
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

}  // namespace

TensorStream TensorStream::of(const NamedTensors& tensors) {
  TensorStream s;
  for (const auto& [n, t] : tensors) {
    s.names.push_back(n);
    s.bytes += static_cast<uint64_t>(t.numel()) * t.element_size();
  }
  s.get = [&tensors](size_t i) { return tensors[i].second; };
  return s;
}

DataRanges write_state_h5(const std::string& path, const TensorStream& tensors) {
  try {
    return write_h5_file(path, tensors);
  } catch (const UserError& e) {
    write_failed(path, tensors.bytes, e);
  }
}

DataRanges write_state_h5(const std::string& path, const NamedTensors& tensors) {
  return write_state_h5(path, TensorStream::of(tensors));
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

namespace {

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

// A dataset's dtype and shape as the file records them, checked: its size in bytes must fit in 64 bits
// and be what the file stores for it (a save stores every tensor whole, uncompressed), before anything
// is allocated.
struct DatasetShape {
  const DtypeInfo* dtype = nullptr;
  std::vector<int64_t> shape;
};

DatasetShape dataset_shape(hid_t ds, const std::string& name, const std::string& path) {
  std::string dtype = read_string_attr(ds, "dtype");
  DatasetShape out;
  out.dtype = info_for(dtype);
  if (!out.dtype) throw UserError(path + ": tensor " + name + " has unknown dtype \"" + dtype + "\"");
  H5Id space(H5Dget_space(ds), H5Sclose);
  h5check(space.id, "reading the shape of " + name + " in " + path);
  int rank = H5Sget_simple_extent_ndims(space);
  h5check(rank, "reading the shape of " + name + " in " + path);
  std::vector<hsize_t> dims(static_cast<size_t>(std::max(rank, 0)));
  if (rank > 0) h5check(H5Sget_simple_extent_dims(space, dims.data(), nullptr), "reading the shape of " + name + " in " + path);
  uint64_t bytes = c10::elementSize(out.dtype->torch_type);
  bool overflow = false;
  for (hsize_t d : dims) {
    overflow |= d > static_cast<hsize_t>(INT64_MAX) || __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes);
    out.shape.push_back(static_cast<int64_t>(d));
  }
  const uint64_t stored_bytes = H5Dget_storage_size(ds);
  uint64_t numel = 1;
  for (hsize_t d : dims) numel *= d;
  if (overflow || (numel > 0 && stored_bytes != bytes))
    throw UserError(path + ": tensor " + name + " has shape " + shape_text(out.shape) + " " + dtype + (overflow ? ", larger than 2^64 bytes" :
                    ", " + std::to_string(bytes) + " bytes, but the file stores " + std::to_string(stored_bytes) + " for it") +
                    ": the file is damaged; " + use_another_checkpoint());
  return out;
}

// `crc` (when given) receives the data's CRC-32, the one computed for the check (inspect reuses it).
torch::Tensor read_dataset(hid_t file, const std::string& name, const std::string& path, int* verified = nullptr,
                           std::string* crc = nullptr) {
  H5Id ds(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose);
  h5check(ds.id, "opening " + name + " in " + path);
  const DatasetShape info = dataset_shape(ds, name, path);
  auto t = torch::empty(info.shape, torch::TensorOptions().dtype(info.dtype->torch_type));
  if (t.numel() > 0) h5check(H5Dread(ds, info.dtype->h5_type(), H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data_ptr()),
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

std::vector<std::string> dataset_names(hid_t file, const std::string& path) {
  std::vector<std::string> names;
  h5check(H5Lvisit(file, H5_INDEX_NAME, H5_ITER_INC, collect_dataset, &names), "listing " + path);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

NamedTensors read_state_h5(const std::string& path, int* verified, std::vector<std::string>* crcs) {
  quiet_hdf5();
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  h5check(file.id, "opening " + path);
  const std::vector<std::string> names = dataset_names(file, path);
  NamedTensors out;
  if (verified) *verified = 0;
  if (crcs) crcs->assign(names.size(), std::string());
  for (size_t i = 0; i < names.size(); ++i)
    out.emplace_back(names[i], read_dataset(file, names[i], path, verified, crcs ? &(*crcs)[i] : nullptr));
  return out;
}

StateH5Reader::StateH5Reader(const std::string& path) : path_(path) {
  static_assert(sizeof(hid_t) == sizeof(file_), "hid_t is 64 bits from HDF5 1.10 on");
  quiet_hdf5();
  file_ = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  h5check(file_, "opening " + path);
  try {
    names_ = dataset_names(file_, path);
  } catch (...) {
    H5Fclose(file_);
    throw;
  }
}

StateH5Reader::~StateH5Reader() {
  if (file_ >= 0) H5Fclose(file_);
}

bool StateH5Reader::contains(const std::string& name) const {
  return std::binary_search(names_.begin(), names_.end(), name);
}

StateH5Reader::Info StateH5Reader::info(const std::string& name) const {
  H5Id ds(H5Dopen2(file_, name.c_str(), H5P_DEFAULT), H5Dclose);
  h5check(ds.id, "opening " + name + " in " + path_);
  const DatasetShape shape = dataset_shape(ds, name, path_);
  return {shape.dtype->torch_type, shape.shape};
}

torch::Tensor StateH5Reader::read(const std::string& name, int* verified, std::string* crc) const {
  return read_dataset(file_, name, path_, verified, crc);
}

std::string dtype_name(torch::ScalarType t) { return info_for(t).name; }

}  // namespace lt
