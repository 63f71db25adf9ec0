// Data: PMD windows, mixture frequencies, largest-remainder splits and the resumable cursor.
#include "catch.hpp"

#include <fstream>

#include "lora_trainer/data/data.hpp"
#include "fixtures.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;

static void write_tokens(const std::string& path, const std::vector<uint32_t>& ids) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
}

static void make_counting_dataset(const std::string& dir, const std::string& name, uint32_t n, uint32_t base) {
  std::filesystem::create_directories(dir + "/" + name);
  std::vector<uint32_t> ids(n);
  for (uint32_t i = 0; i < n; ++i) ids[i] = base + i;
  write_tokens(dir + "/" + name + "/train.bin", ids);
  write_tokens(dir + "/" + name + "/val.bin", std::vector<uint32_t>(ids.begin(), ids.begin() + 100));
  write_file_atomic(dir + "/" + name + "/meta.json", R"({"style":"pmd","vocab_size":100000})");
}

TEST_CASE("a PMD sample is a block-aligned window with shifted targets", "[data]") {
  test::TempDir dir;
  make_counting_dataset(dir.str(), "count", 1000, 0);
  PmdDataset ds(dir.str(), "count");
  const int64_t T = 8;
  CHECK(ds.num_samples(Split::Train, T) == (1000 - 1) / 8);
  std::vector<int64_t> in(T), tgt(T);
  ds.sample(Split::Train, 3, T, in.data(), tgt.data(), nullptr);
  for (int64_t t = 0; t < T; ++t) {
    CHECK(in[t] == 24 + t);
    CHECK(tgt[t] == 25 + t);
  }
}

TEST_CASE("the mixture draws datasets at their rates", "[data]") {
  test::TempDir dir;
  make_counting_dataset(dir.str(), "a", 5000, 0);
  make_counting_dataset(dir.str(), "b", 5000, 50000);
  DataCatalog cat(dir.str());
  MixtureSampler s(cat, {{"a", 0.2, DatasetStyle::PMD}, {"b", 0.8, DatasetStyle::PMD}}, 16, 7, 0);
  Batch b = s.next(4000);
  int from_b = 0;
  for (int64_t r = 0; r < 4000; ++r) {
    bool is_b = b.inputs[r][0].item<int64_t>() >= 50000;
    CHECK(is_b == (b.source[static_cast<size_t>(r)] == 1));
    from_b += is_b;
  }
  // Binomial(4000, 0.8): sd ~ 25; allow 5 sd.
  CHECK(std::abs(from_b - 3200) < 125);
}

TEST_CASE("the cursor reproduces the same rows after a restore", "[data]") {
  test::TempDir dir;
  make_counting_dataset(dir.str(), "a", 5000, 0);
  make_counting_dataset(dir.str(), "b", 5000, 50000);
  DataCatalog cat(dir.str());
  std::vector<Sampling> mix = {{"a", 0.5, DatasetStyle::PMD}, {"b", 0.5, DatasetStyle::PMD}};
  MixtureSampler straight(cat, mix, 16, 3, 1);
  straight.next(10);
  straight.next(10);
  Batch third = straight.next(10);

  MixtureSampler resumed(cat, mix, 16, 3, 1);
  resumed.set_cursor(20);
  CHECK(torch::equal(resumed.next(10).inputs, third.inputs));
  // A different seed or stage gives different rows.
  MixtureSampler other(cat, mix, 16, 4, 1);
  other.set_cursor(20);
  CHECK_FALSE(torch::equal(other.next(10).inputs, third.inputs));
}

TEST_CASE("largest remainder parts sum to the total", "[data]") {
  CHECK(largest_remainder({1, 1, 1}, 10) == std::vector<int64_t>{4, 3, 3});
  CHECK(largest_remainder({0.5, 0.25, 0.25}, 8) == std::vector<int64_t>{4, 2, 2});
  for (int total : {0, 1, 7, 33, 100}) {
    auto p = largest_remainder({0.1, 0.3, 0.6}, total);
    CHECK(p[0] + p[1] + p[2] == total);
  }
}

TEST_CASE("a missing dataset names the path and the command that makes it", "[data]") {
  test::TempDir dir;
  DataCatalog cat(dir.str());
  CHECK_THROWS_WITH(cat.get({"nope", 1.0, DatasetStyle::PMD}),
                    Contains("nope/meta.json") && Contains("lora_trainer tokenize"));
}

TEST_CASE("a dataset shorter than one window is a clear error", "[data]") {
  test::TempDir dir;
  make_counting_dataset(dir.str(), "short", 10, 0);
  DataCatalog cat(dir.str());
  CHECK_THROWS_WITH(MixtureSampler(cat, {{"short", 1.0, DatasetStyle::PMD}}, 64, 0, 0),
                    Contains("fewer than block_size + 1"));
}

TEST_CASE("tokenize writes train/val splits with end-of-text after each document", "[data]") {
  test::TempDir dir;
  test::make_byte_dataset(dir.str(), "gen", 1, 8, 200);
  auto meta = nlohmann::json::parse(read_file(dir / "gen/meta.json"));
  CHECK(meta["documents"] == 8);
  CHECK(meta["val_documents"] == 2);
  CHECK(meta["eot_id"] == 256);
  TokenFile val(dir / "gen/val.bin");
  TokenFile train(dir / "gen/train.bin");
  CHECK(val.size() == meta["val_tokens"].get<uint64_t>());
  CHECK(train.size() + val.size() == meta["bytes"].get<uint64_t>() + 8);  // one EOT per document
  int eots = 0;
  for (uint64_t i = 0; i < train.size(); ++i) eots += train.data()[i] == 256;
  CHECK(eots == 6);
  CHECK(train.data()[train.size() - 1] == 256);
}

// Writes `records` (one JSON object a line) and tokenizes them (byte tokenizer, a quarter for
// validation) as the PADDED dataset "qa" under dir/data.
static TokenizeResult make_padded_qa(const test::TempDir& dir, const std::string& records, int64_t length = 0) {
  write_file_atomic(dir / "qa.jsonl", records);
  TokenizeOptions o;
  o.inputs = {dir / "qa.jsonl"};
  o.out_dir = dir / "data/qa";
  o.tokenizer = "byte";
  o.val_fraction = 0.25;
  o.length = length;
  return tokenize_jsonl_to_padded(o);
}

TEST_CASE("padded: JSONL records become left-padded rows with loss only on the completion", "[data]") {
  test::TempDir dir;
  std::string records;
  for (int i = 0; i < 8; ++i)
    records += nlohmann::json({{"prompt", "Q" + std::to_string(i) + ":"}, {"completion", " yes"}}).dump() + "\n";
  auto r = make_padded_qa(dir, records, 12);
  CHECK(r.documents == 8);
  CHECK(r.val_documents == 2);
  DataCatalog cat(dir / "data");
  const Dataset& ds = cat.get({"qa", 1.0, DatasetStyle::PADDED});
  CHECK(ds.num_samples(Split::Train, 8) == 6);
  // Row 0 is "Q0:" + " yes" + EOT = 8 tokens, left-padded to 12 with EOT (256).
  // With T = 11 the window is the whole row: inputs = row[0..11), targets = row[1..12) where counted.
  std::vector<int64_t> in(11), tgt(11);
  ds.sample(Split::Train, 0, 11, in.data(), tgt.data(), nullptr);
  CHECK(std::vector<int64_t>(in.begin(), in.begin() + 5) == std::vector<int64_t>{256, 256, 256, 256, 'Q'});
  // Targets: padding and the prompt are ignored; " yes" and EOT count.
  CHECK(std::vector<int64_t>(tgt.begin(), tgt.end()) ==
        std::vector<int64_t>{-1, -1, -1, -1, -1, -1, ' ', 'y', 'e', 's', 256});
  // A longer window pads further on the left, all ignored.
  std::vector<int64_t> in2(15), tgt2(15);
  ds.sample(Split::Train, 0, 15, in2.data(), tgt2.data(), nullptr);
  CHECK(tgt2.back() == 256);
  CHECK(std::count(tgt2.begin(), tgt2.end(), -1) == 15 - 5);
  // Asking for it as PMD is a clear error.
  CHECK_THROWS_WITH(cat.get({"qa", 1.0, DatasetStyle::PMD}), Contains("of style padded"));
}

TEST_CASE("padded and PMD datasets mix in one stage", "[data]") {
  test::TempDir dir;
  make_counting_dataset(dir / "data", "count", 5000, 0);
  std::string records;
  for (int i = 0; i < 8; ++i) records += R"({"prompt":"p","completion":"c"})" "\n";
  make_padded_qa(dir, records);
  DataCatalog cat(dir / "data");
  MixtureSampler s(cat, {{"count", 0.5, DatasetStyle::PMD}, {"qa", 0.5, DatasetStyle::PADDED}}, 8, 1, 0);
  Batch b = s.next(64);
  int padded_rows = 0;
  for (int64_t r = 0; r < 64; ++r) {
    bool is_padded = b.source[static_cast<size_t>(r)] == 1;
    padded_rows += is_padded;
    int64_t ignored = b.targets[r].lt(0).sum().item<int64_t>();
    CHECK(ignored == (is_padded ? 6 : 0));  // "p","c",EOT in 9 positions: only "c" and EOT count
  }
  CHECK(padded_rows > 16);
  CHECK(padded_rows < 48);
}

TEST_CASE("eval dataset specs take the suffixes :padded, :contrastive and :prompts and refuse any other suffix or a path", "[data]") {
  CHECK(parse_dataset_spec("code").name == "code");
  CHECK(parse_dataset_spec("code").style == DatasetStyle::PMD);
  CHECK(parse_dataset_spec("qa:padded").name == "qa");
  CHECK(parse_dataset_spec("qa:padded").style == DatasetStyle::PADDED);
  CHECK(parse_dataset_spec("prefs:contrastive").style == DatasetStyle::CONTRASTIVE);
  CHECK(parse_dataset_spec("sums:prompts").name == "sums");
  CHECK(parse_dataset_spec("sums:prompts").style == DatasetStyle::PROMPTS);
  CHECK_THROWS_WITH(parse_dataset_spec("en:weird"), lt::test::Contains("\":weird\" is not a style") &&
                                                         lt::test::Contains("NAME:padded, NAME:contrastive or NAME:prompts"));
  CHECK_THROWS_WITH(parse_dataset_spec("../en"), lt::test::Contains("not a valid name"));
  CHECK_THROWS_WITH(parse_dataset_spec(".:padded"), lt::test::Contains("not a valid name"));
}
