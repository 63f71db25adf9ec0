// TensorBoard's event files, written without TensorFlow or the protobuf library.
//
// An event file (events.out.tfevents.<unix seconds>.<host>.lora_trainer: TensorBoard reads every file
// of a directory whose name contains "tfevents") is a sequence of TFRecords, each
//   uint64  the payload's length, little-endian
//   uint32  the masked CRC-32C of those 8 bytes
//   bytes   the payload: one serialized tensorflow.Event protobuf
//   uint32  the masked CRC-32C of the payload
// where masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 (tensorflow/core/lib/hash/crc32c.h, CRC-32C
// being the Castagnoli polynomial 0x82f63b78, reflected). The messages written, with their field
// numbers (tensorflow/core/util/event.proto, tensorflow/core/framework/summary.proto):
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
// The first record is an Event with file_version "brain.Event:2"; each other one holds the scalars of
// one step. TensorBoard shows a simple_value as a point of the scalar chart named by its tag.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lt {

// CRC-32C (Castagnoli) of `size` bytes, continuing from `crc` (0 to start).
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
// The TFRecord framing's masked CRC-32C.
uint32_t masked_crc32c(const void* data, size_t size);

struct ScalarValue {
  std::string tag;
  float value = 0;
};

// One serialized Event: its wall time and step, and either a file version or scalars.
std::string encode_event(double wall_time, int64_t step, const std::string& file_version,
                         const std::vector<ScalarValue>& scalars);
// The TFRecord of a payload: length, its CRC, the payload, its CRC.
std::string frame_record(const std::string& payload);

// The intact records of an event file, in order. Bytes that fail their CRCs (a damaged record, a last one
// cut short: what a killed writer leaves) are skipped up to the next intact record, whose length and
// payload both match their CRCs again, so damage loses no record after it; `damage` (if given) receives
// a line for each such stretch (where, how many bytes). `step_of` (if given) receives each record's
// Event step (0 where it has none).
std::vector<std::string> read_event_records(const std::string& path, std::vector<int64_t>* step_of = nullptr,
                                            std::vector<std::string>* damage = nullptr);

// Appends scalars to a directory's event file. Each record is written with one write() and the file
// closed after it, so a kill leaves at most a cut last record, which the next writer drops; a failed
// write (a full disk, the file size limit) leaves no part of the record and stops the run with a
// UserError naming the file (append_file, core/outputs.hpp).
class EventFileWriter {
 public:
  // The event file this class wrote in `dir` before (the newest, if several), or a new one; a new file
  // starts with the file_version record.
  explicit EventFileWriter(std::string dir);

  void add_scalars(int64_t step, const std::vector<ScalarValue>& scalars);
  // Keeps only the intact records of steps up to `step` (a resumed run redoes the later ones), dropping
  // damaged bytes and a cut last record (a warning says what and where), and starting with the
  // file_version record; the file is replaced in one rename.
  void truncate_after(int64_t step);

  const std::string& path() const { return path_; }

 private:
  void append(const std::string& record);
  std::string dir_, path_;
};

}  // namespace lt
