// The safetensors reader/writer: round trips, files written by the real library (tests/data/hf_gpt2,
// made by scripts/hf_golden.py with safetensors 0.8), sharded models, and damaged files.
#include <cstring>
#include <filesystem>

#include "catch.hpp"

#include "lora_trainer/formats/safetensors.hpp"
#include "fixtures.hpp"
#include "lora_trainer/core/memory.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

const std::string kGpt2Dir = std::string(LT_SOURCE_DIR) + "/tests/data/hf_gpt2";

// A file with exactly this header text and this many data bytes (for damaged files).
void write_raw(const std::string& path, const std::string& header, size_t data_bytes, int64_t header_len = -1) {
  std::string s(8, '\0');
  uint64_t n = header_len >= 0 ? static_cast<uint64_t>(header_len) : header.size();
  std::memcpy(s.data(), &n, 8);
  s += header;
  s.append(data_bytes, '\x01');
  write_file_atomic(path, s);
}

}  // namespace

TEST_CASE("safetensors round trips every dtype bit for bit, with metadata", "[safetensors]") {
  test::TempDir d;
  auto gen = at::detail::createCPUGenerator(7);
  NamedTensors in = {
      {"b.f32", torch::randn({3, 5}, gen)},
      {"a.bf16", torch::randn({4, 2}, gen).to(torch::kBFloat16)},
      {"c.f16", torch::randn({7}, gen).to(torch::kFloat16)},
      {"d.i64", torch::arange(-3, 9, torch::kLong).reshape({3, 4})},
      {"e.scalar", torch::tensor(2.5)},
      {"f.empty", torch::zeros({0, 4})},
      {"g.f64", torch::randn({2}, gen).to(torch::kFloat64)},
      {"h.u8", torch::arange(0, 5, torch::kLong).to(torch::kUInt8)},
      {"i.transposed", torch::randn({3, 2}, gen).t()},  // not contiguous: written in row-major order
  };
  const std::string path = d / "x.safetensors";
  write_safetensors(path, in, {{"format", "pt"}, {"note", "hello"}});
  std::map<std::string, std::string> meta;
  NamedTensors out = read_safetensors(path, &meta);
  CHECK(meta == std::map<std::string, std::string>{{"format", "pt"}, {"note", "hello"}});
  REQUIRE(out.size() == in.size());
  std::sort(in.begin(), in.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < in.size(); ++i) {
    INFO(in[i].first);
    CHECK(out[i].first == in[i].first);
    CHECK(out[i].second.scalar_type() == in[i].second.scalar_type());
    CHECK(out[i].second.sizes() == in[i].second.sizes());
    CHECK(torch::equal(out[i].second, in[i].second));
  }
  // The header is padded with spaces so that the data starts 8-byte aligned.
  std::string bytes = read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK((8 + n) % 8 == 0);
  CHECK(bytes.substr(8, 1) == "{");
  // No temporary file is left beside it.
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(d.path)) files += e.is_regular_file();
  CHECK(files == 1);
}

TEST_CASE("safetensors reads what the real library wrote, one file or sharded bf16", "[safetensors]") {
  SafetensorsFile f(kGpt2Dir + "/model/model.safetensors");
  CHECK(f.entries().size() == 28);
  CHECK(f.metadata().at("format") == "pt");
  const auto& wte = f.entry("transformer.wte.weight");
  CHECK(wte.dtype == torch::kFloat32);
  CHECK(wte.shape == std::vector<int64_t>{300, 32});
  CHECK(f.entry("transformer.h.0.attn.c_attn.weight").shape == std::vector<int64_t>{32, 96});  // Conv1D: (in, out)
  NamedTensors f32 = read_safetensors_model(kGpt2Dir + "/model");
  NamedTensors bf16 = read_safetensors_model(kGpt2Dir + "/model_bf16_sharded");  // model.safetensors.index.json
  REQUIRE(f32.size() == 28);
  REQUIRE(bf16.size() == 28);
  for (size_t i = 0; i < f32.size(); ++i) {
    INFO(f32[i].first);
    CHECK(bf16[i].first == f32[i].first);
    CHECK(bf16[i].second.scalar_type() == torch::kBFloat16);
    CHECK(torch::equal(bf16[i].second, f32[i].second.to(torch::kBFloat16)));
  }
}

TEST_CASE("a tensor viewed in place has the file's values, its pages leave the process when it is released, and an "
          "unaligned one is a copy", "[safetensors]") {
  test::TempDir d;
  auto gen = at::detail::createCPUGenerator(3);
  const auto big = torch::randn({16, 1 << 20}, gen);  // 64 MiB of f32
  const auto small = torch::randn({5, 3}, gen).to(torch::kBFloat16);
  const std::string path = d / "m.safetensors";
  write_safetensors(path, {{"big", big}, {"small", small}});
  const SafetensorsFile f(path);
  const int64_t before = ProcessMemory::now().file;
  {
    const torch::Tensor v = f.view("big");
    REQUIRE(v.sizes() == big.sizes());
    CHECK(torch::equal(v, big));  // every page read: in this process's mapping now
    const int64_t held = ProcessMemory::now().file - before;
    INFO("mapped pages held while viewed: " << held / 1e6 << " MB");
    CHECK(held > (int64_t(56) << 20));
    CHECK(is_mapped_view(v));
    CHECK(is_mapped_view(v.to(torch::kFloat32)));  // the same pages: a reader keeping it must copy
    CHECK_FALSE(is_mapped_view(v.to(torch::kBFloat16)));
    CHECK_FALSE(is_mapped_view(f.tensor("big")));
  }
  const int64_t after = ProcessMemory::now().file - before;
  INFO("mapped pages held after the view is released: " << after / 1e6 << " MB");
  CHECK(after < (int64_t(8) << 20));
  CHECK(torch::equal(f.view("small"), small));
  // A header whose length leaves the data at an odd offset: the f32 values are not aligned to 4 bytes,
  // so they are copied (the same values).
  const std::string odd = d / "odd.safetensors";
  const std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  REQUIRE((8 + header.size()) % 4 != 0);
  std::string bytes(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(bytes.data(), &n, 8);
  const float values[2] = {1.5f, -2.25f};
  bytes += header + std::string(reinterpret_cast<const char*>(values), sizeof values);
  write_file_atomic(odd, bytes);
  const SafetensorsFile g(odd);
  const torch::Tensor w = g.view("w");
  CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 4 == 0);
  CHECK_FALSE(is_mapped_view(w));
  CHECK(torch::equal(w, torch::tensor({1.5f, -2.25f})));
}

TEST_CASE("a damaged safetensors file is an error naming the file and the tensor", "[safetensors]") {
  test::TempDir d;
  const std::string good = d / "good.safetensors";
  write_safetensors(good, {{"w", torch::ones({4, 4})}, {"v", torch::ones({3})}});
  const std::string bytes = read_file(good);

  SECTION("truncated data") {
    const std::string p = d / "cut.safetensors";
    write_file_atomic(p, bytes.substr(0, bytes.size() - 10));
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains(p) && Contains("tensor w") && Contains("outside the file"));
  }
  SECTION("truncated inside the header") {
    const std::string p = d / "cut2.safetensors";
    write_file_atomic(p, bytes.substr(0, 20));
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains(p) && Contains("header length"));
    write_file_atomic(p, bytes.substr(0, 5));
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains("shorter than the 8-byte header length"));
  }
  SECTION("offsets past the end") {
    const std::string p = d / "past.safetensors";
    write_raw(p, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"v":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 12);
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains(p) && Contains("tensor v") && Contains("outside the file"));
  }
  SECTION("shape and size disagree") {
    const std::string p = d / "shape.safetensors";
    write_raw(p, R"({"w":{"dtype":"F32","shape":[3,2],"data_offsets":[0,16]}})", 16);
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains("tensor w") && Contains("16 bytes for shape [3, 2] F32, which needs 24"));
    write_raw(p, R"({"w":{"dtype":"BF16","shape":[4],"data_offsets":[0,16]}})", 16);
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains("which needs 8"));
  }
  SECTION("overlapping tensors and gaps") {
    const std::string p = d / "overlap.safetensors";
    write_raw(p, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"v":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12);
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains("inside the previous tensor"));
    write_raw(p, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12);
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains("cover 8 bytes of the 12-byte data buffer"));
  }
  SECTION("a header that is not what the format says") {
    const std::string p = d / "bad.safetensors";
    write_raw(p, "not json at all", 0);
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains(p) && Contains("not valid JSON"));
    write_raw(p, R"({"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8);
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains("tensor w") && Contains("dtype Q4 is not supported"));
    write_raw(p, R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8);
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains("negative"));
    write_raw(p, R"({"w":{"dtype":"F32","shape":[2]}})", 8);
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains("needs dtype, shape and data_offsets"));
    write_raw(p, R"({"__metadata__":{"n":1}})", 0);
    CHECK_THROWS_WITH(SafetensorsFile(p), Contains("is not a string"));
  }
  SECTION("a sharded index naming a tensor its shard lacks") {
    const std::string m = d / "sharded";
    std::filesystem::create_directories(m);
    write_safetensors(m + "/a.safetensors", {{"w", torch::ones({2})}});
    write_file_atomic(m + "/model.safetensors.index.json", R"({"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}})");
    CHECK_THROWS_WITH(read_safetensors_model(m), Contains("puts tensor v in a.safetensors, which does not hold it"));
    write_file_atomic(m + "/model.safetensors.index.json", R"({"weight_map": {"w": "../a.safetensors"}})");
    CHECK_THROWS_WITH(read_safetensors_model(m), Contains("is not a file in"));
    CHECK_THROWS_WITH(read_safetensors_model(d / "nothing-here"), Contains("neither model.safetensors"));
  }
  CHECK_NOTHROW(SafetensorsFile(good));
}
