// A dataset's side files (lengths, masks, the pairs of a contrastive dataset, meta.json) checked against
// the token files they describe when the dataset opens: one that lies is refused, naming the file, the
// row and what to do, instead of training on fragments of examples or on padding.
#include "catch.hpp"

#include <cstring>
#include <map>

#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/data/packing.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

// Prompt/completion records of varied lengths; `pairs`: prompt/chosen/rejected.
std::string records(int n, bool pairs) {
  std::string jsonl;
  for (int i = 0; i < n; ++i) {
    const std::string prompt = "Question " + std::to_string(i) + test::generated_text(static_cast<uint64_t>(i), 1 + i % 3) + ":";
    const std::string answer = " " + test::generated_text(static_cast<uint64_t>(100 + i), static_cast<size_t>(1 + (i * 5) % 4));
    nlohmann::json j = {{"prompt", prompt}};
    if (pairs) j["chosen"] = answer, j["rejected"] = " no" + std::to_string(i);
    else j["completion"] = answer;
    jsonl += j.dump() + "\n";
  }
  return jsonl;
}

// Tokenizes (byte tokenizer) `n` records as dataset `name` under dir/data; rows of `length` (0: the longest).
void make_dataset(const test::TempDir& dir, const std::string& name, bool pairs, int n, int64_t length = 0) {
  write_file_atomic(dir / (name + ".jsonl"), records(n, pairs));
  TokenizeOptions o;
  o.inputs = {dir / (name + ".jsonl")};
  o.out_dir = dir / ("data/" + name);
  o.tokenizer = "byte";
  o.val_fraction = 0.25;
  o.length = length;
  if (pairs) tokenize_jsonl_to_contrastive(o);
  else tokenize_jsonl_to_padded(o);
}

std::vector<uint32_t> u32s(const std::string& path) {
  const std::string bytes = read_file(path);
  std::vector<uint32_t> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

void write_u32s(const std::string& path, const std::vector<uint32_t>& v) {
  write_file_atomic(path, std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
}

// Opens the dataset as training does, every way it can be: rows, packed rows, pairs.
void open(const std::string& data, const std::string& name, bool pairs) {
  if (pairs) {
    ContrastiveDataset ds(data, name);
    ds.check_vocabulary(257);
    return;
  }
  PaddedDataset(data, name).check_vocabulary(257);
  PackedDataset(std::make_unique<PaddedDataset>(data, name)).check_vocabulary(257);
}

// Keeps a dataset's files, to put them back after each lie.
struct Files {
  std::string dir;
  std::map<std::string, std::string> kept;
  explicit Files(std::string d) : dir(std::move(d)) {
    for (const char* f : {"meta.json", "shape.json", "train.tokens.bin", "train.mask.bin", "train.lengths.bin",
                          "val.tokens.bin", "val.mask.bin", "val.lengths.bin"})
      kept[f] = read_file(dir + "/" + f);
  }
  void restore() const {
    for (const auto& [f, bytes] : kept) write_file_atomic(dir + "/" + f, bytes);
  }
  std::string operator/(const std::string& f) const { return dir + "/" + f; }
};

}  // namespace

TEST_CASE("dataset files: a lengths file that does not describe its rows is refused, naming file, row and the fix", "[data]") {
  test::TempDir dir;
  const std::string data = dir / "data";
  make_dataset(dir, "qa", false, 24);
  const Files f(data + "/qa");
  REQUIRE_NOTHROW(open(data, "qa", false));
  const auto shape = read_json_file(f / "shape.json");
  const uint64_t L = shape["train"][1].get<uint64_t>();
  const std::vector<uint32_t> lengths = u32s(f / "train.lengths.bin");
  // Two rows with padding, a longer than b.
  uint64_t a = lengths.size(), b = lengths.size();
  for (uint64_t r = 0; r < lengths.size(); ++r)
    for (uint64_t q = 0; q < lengths.size(); ++q)
      if (a == lengths.size() && lengths[r] > lengths[q] && lengths[q] > 4 && lengths[r] + 4 < L) a = r, b = q;
  REQUIRE(a < lengths.size());
  const std::string fix = "re-run `lora_trainer tokenize`";
  auto refused = [&](const std::vector<std::string>& words) {
    for (bool packed : {false, true}) {
      INFO((packed ? "packed" : "rows"));
      try {
        if (packed) PackedDataset(std::make_unique<PaddedDataset>(data, "qa"));
        else PaddedDataset(data, "qa");
        FAIL("accepted");
      } catch (const UserError& e) {
        for (const auto& w : words) CHECK_THAT(e.what(), Contains(w));
      }
    }
    f.restore();
  };
  auto lie = [&](const std::string& file, uint64_t row, uint32_t value) {
    auto v = u32s(f / file);
    v[row] = value;
    write_u32s(f / file, v);
  };

  // The issue's example: a row said shorter than it is, so a packed row would hold the fragment.
  lie("train.lengths.bin", a, lengths[a] - 3);
  refused({f / "train.lengths.bin", "row " + std::to_string(a), "not padding", fix});
  // A row of no tokens.
  lie("train.lengths.bin", b, 0);
  refused({f / "train.lengths.bin", "row " + std::to_string(b), "length 0", fix});
  // A row said longer than it is (its example would start with padding): the sum no longer matches.
  lie("train.lengths.bin", b, lengths[b] + 1);
  refused({f / "train.lengths.bin", "sum to", "train_tokens", fix});
  // Two rows' lengths swapped: the sum holds, the shorter one's padding does not.
  {
    auto v = lengths;
    std::swap(v[a], v[b]);
    write_u32s(f / "train.lengths.bin", v);
  }
  refused({f / "train.lengths.bin", "row " + std::to_string(a), "not padding"});
  // Longer than a row, and a file of the wrong size (a part of an entry missing).
  lie("train.lengths.bin", a, static_cast<uint32_t>(L + 1));
  refused({f / "train.lengths.bin", "row " + std::to_string(a), "longer than the rows'"});
  write_file_atomic(f / "train.lengths.bin", f.kept.at("train.lengths.bin").substr(2));
  refused({f / "train.lengths.bin", "4 per row"});
  // The validation split's file.
  lie("val.lengths.bin", 0, u32s(f / "val.lengths.bin")[0] - 2);
  refused({f / "val.lengths.bin", "row 0", fix});
  // The mask counts a padding position in the loss.
  {
    std::string mask = f.kept.at("train.mask.bin");
    mask[a * L] = 1;
    write_file_atomic(f / "train.mask.bin", mask);
  }
  refused({f / "train.lengths.bin", "row " + std::to_string(a), "position 0", "mask 1"});
  // meta.json's pad_id is not what pads the rows, or beyond a token id.
  for (const nlohmann::json& pad : {nlohmann::json(65), nlohmann::json(uint64_t{1} << 32)}) {
    auto meta = read_json_file(f / "meta.json");
    meta["pad_id"] = pad;
    write_file_atomic(f / "meta.json", meta.dump());
    refused({"pad_id", pad == 65 ? "pad_id 65" : "uint32"});
  }
  // meta.json's count of the tokens.
  {
    auto meta = read_json_file(f / "meta.json");
    meta["val_tokens"] = meta["val_tokens"].get<uint64_t>() + 5;
    write_file_atomic(f / "meta.json", meta.dump());
  }
  refused({f / "val.lengths.bin", "val_tokens", "do not belong together"});
  REQUIRE_NOTHROW(open(data, "qa", false));
}

TEST_CASE("dataset files: a contrastive dataset's rows are pairs of one prompt, cut rows included", "[data]") {
  test::TempDir dir;
  const std::string data = dir / "data";
  // Rows of 24 tokens: the long records lose a part of their prompt, the chosen and the rejected row not
  // the same part; still one prompt.
  make_dataset(dir, "prefs", true, 16, 24);
  const Files f(data + "/prefs");
  REQUIRE_NOTHROW(open(data, "prefs", true));
  const uint64_t L = 24;
  int cut = 0;
  for (uint32_t n : u32s(f / "train.lengths.bin")) cut += n == L;
  CHECK(cut > 2);

  // The rejected row of pair 0 and the chosen row of pair 1 exchanged in all three files: every file
  // agrees with the others row by row, but the pairs are no longer one prompt each.
  {
    std::string tokens = f.kept.at("train.tokens.bin"), mask = f.kept.at("train.mask.bin");
    auto lengths = u32s(f / "train.lengths.bin");
    std::swap_ranges(tokens.begin() + 4 * L, tokens.begin() + 8 * L, tokens.begin() + 8 * L);
    std::swap_ranges(mask.begin() + L, mask.begin() + 2 * L, mask.begin() + 2 * L);
    std::swap(lengths[1], lengths[2]);
    write_file_atomic(f / "train.tokens.bin", tokens);
    write_file_atomic(f / "train.mask.bin", mask);
    write_u32s(f / "train.lengths.bin", lengths);
  }
  CHECK_THROWS_WITH(open(data, "prefs", true), Contains(f / "train.tokens.bin") && Contains("rows 0 and 1") &&
                                                   Contains("different prompts") && Contains("re-run `lora_trainer tokenize`"));
  f.restore();
  // A lying lengths file of a contrastive dataset is refused as a padded one's.
  {
    auto lengths = u32s(f / "val.lengths.bin");
    lengths[1] -= 2;
    write_u32s(f / "val.lengths.bin", lengths);
    CHECK_THROWS_WITH(open(data, "prefs", true), Contains(f / "val.lengths.bin") && Contains("row 1"));
  }
  f.restore();
  REQUIRE_NOTHROW(open(data, "prefs", true));
}

TEST_CASE("dataset files: a run over a lying lengths file stops before training, exit 2, naming it", "[data]") {
  test::TempDir dir;
  const std::string data = dir / "data";
  make_dataset(dir, "qa", false, 24);
  auto lengths = u32s(data + "/qa/train.lengths.bin");
  uint64_t r = 0;
  while (lengths[r] < 6) ++r;
  lengths[r] -= 5;
  write_u32s(data + "/qa/train.lengths.bin", lengths);
  std::vector<std::string> args = {"configure", "lora/train", dir / "cfg.json"};
  for (const auto& o : test::tiny_overrides(data)) args.push_back(o);
  for (const char* o : {"training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]", "training/post_lora_tokens=[256]",
                        R"(training/post_lora_dataset=[[{"name":"qa","rate":1,"style":"padded"}]])", "data/pack=true",
                        "training/allow_random_base=true"})
    args.push_back(o);
  REQUIRE(test::launch(args).code == 0);
  const test::Result run = test::launch({"run", "job", dir / "cfg.json", dir / "out"});
  INFO(run.out);
  CHECK(run.code == 2);
  CHECK_THAT(run.out, Contains(data + "/qa/train.lengths.bin") && Contains("row " + std::to_string(r)) &&
                          Contains("re-run `lora_trainer tokenize`"));
  CHECK_FALSE(std::filesystem::exists(dir / "out/runs/general/default/job/metrics.jsonl"));
}
