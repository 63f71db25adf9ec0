// Packing (data/packing.hpp): best-fit decreasing rows, packed samples holding whole examples, and the
// property that makes packing safe to switch on: a packed row's loss is its examples' losses summed,
// each taken alone, on both model families and both attention paths.
#include "catch.hpp"

#include <set>

#include "fixtures.hpp"
#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/data/packing.hpp"
#include "lora_trainer/models/gpt2.hpp"
#include "lora_trainer/models/llama.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

// A padded dataset "qa" of prompt/completion records of varied lengths (byte tokens), under dir/data.
std::string make_qa_dataset(const test::TempDir& dir, int records = 40) {
  std::string jsonl;
  for (int i = 0; i < records; ++i) {
    const std::string words = test::generated_text(static_cast<uint64_t>(i), static_cast<size_t>(1 + (i * 7) % 6));
    jsonl += nlohmann::json({{"prompt", "Q" + std::to_string(i) + ":"}, {"completion", " " + words}}).dump() + "\n";
  }
  write_file_atomic(dir / "qa.jsonl", jsonl);
  TokenizeOptions o;
  o.inputs = {dir / "qa.jsonl"};
  o.out_dir = dir / "data/qa";
  o.tokenizer = "byte";
  o.val_fraction = 0.2;
  tokenize_jsonl_to_padded(o);
  return dir / "data";
}

struct PackedRow {
  std::vector<int64_t> inputs, targets, segments;
};

PackedRow packed_row(const Dataset& ds, Split split, uint64_t index, int64_t T) {
  PackedRow r{std::vector<int64_t>(T), std::vector<int64_t>(T), std::vector<int64_t>(T, 0)};
  ds.sample(split, index, T, r.inputs.data(), r.targets.data(), r.segments.data());
  return r;
}

}  // namespace

TEST_CASE("pack_best_fit puts the longest first, each into the row it fills most tightly", "[packing]") {
  // Sorted: 8 (item 4), 7 (2), 5 (0), 3 (1), 2 (3), 1 (5); the empty item 6 is left out.
  const Packing p = pack_best_fit({5, 3, 7, 2, 8, 1, 0}, 8);
  REQUIRE(p.rows() == 4);
  auto row = [&](uint64_t r) { return std::vector<uint64_t>(p.index.begin() + p.offset[r], p.index.begin() + p.offset[r + 1]); };
  CHECK(row(0) == std::vector<uint64_t>{4});
  CHECK(row(1) == std::vector<uint64_t>{2, 5});  // 1 went to the row with 1 left, not the one with 6
  CHECK(row(2) == std::vector<uint64_t>{0, 1});
  CHECK(row(3) == std::vector<uint64_t>{3});
  CHECK_THROWS(pack_best_fit({9}, 8));

  // Any sizes: every non-empty item once, no row over capacity, close to the fewest rows possible.
  std::mt19937_64 rng(5);
  std::vector<uint64_t> sizes(2000);
  uint64_t total = 0;
  for (auto& s : sizes) total += (s = rng() % 120);
  const Packing q = pack_best_fit(sizes, 128);
  std::vector<int> seen(sizes.size(), 0);
  for (uint64_t r = 0; r < q.rows(); ++r) {
    uint64_t used = 0;
    for (uint64_t k = q.offset[r]; k < q.offset[r + 1]; ++k) used += sizes[q.index[k]], ++seen[q.index[k]];
    CHECK(used <= 128);
  }
  for (size_t i = 0; i < sizes.size(); ++i) CHECK(seen[i] == (sizes[i] > 0 ? 1 : 0));
  const uint64_t fewest = (total + 127) / 128;
  CHECK(q.rows() <= fewest + fewest / 20 + 1);  // within 5% of the lower bound on this mix
}

TEST_CASE("a packed sample holds whole examples, each as it is alone, with its segment", "[packing]") {
  test::TempDir dir;
  const std::string data = make_qa_dataset(dir);
  const int64_t T = 64;
  PaddedDataset rows(data, "qa");
  PackedDataset packed(std::make_unique<PaddedDataset>(data, "qa"));
  REQUIRE(packed.packed());
  const Packing& p = packed.packing(Split::Train, T);
  CHECK(packed.num_samples(Split::Train, T) == p.rows());
  CHECK(p.rows() < rows.rows(Split::Train) / 2);  // short examples: several to a row
  std::set<uint64_t> covered;
  for (uint64_t r = 0; r < p.rows(); ++r) {
    INFO("packed row " << r);
    const PackedRow row = packed_row(packed, Split::Train, r, T);
    int64_t at = 0, segment = 0;
    for (uint64_t k = p.offset[r]; k < p.offset[r + 1]; ++k, ++segment) {
      const uint64_t example = p.index[k];
      covered.insert(example);
      const auto n = static_cast<int64_t>(rows.example_length(Split::Train, example)) - 1;
      // Alone, in a window of exactly its length: no padding.
      std::vector<int64_t> in(n), tgt(n);
      rows.write_row(Split::Train, example, n, in.data(), tgt.data());
      CHECK(std::vector<int64_t>(row.inputs.begin() + at, row.inputs.begin() + at + n) == in);
      CHECK(std::vector<int64_t>(row.targets.begin() + at, row.targets.begin() + at + n) == tgt);
      CHECK(std::vector<int64_t>(row.segments.begin() + at, row.segments.begin() + at + n) == std::vector<int64_t>(n, segment));
      at += n;
    }
    for (int64_t t = at; t < T; ++t) {
      CHECK(row.targets[t] == -1);
      CHECK(row.segments[t] == segment);
    }
  }
  CHECK(covered.size() == rows.rows(Split::Train));  // every example, once each (examples are > 1 token)

  // An example longer than the row fills one, its last T + 1 tokens, as an unpacked row takes them.
  const int64_t short_T = 12;
  const Packing& s = packed.packing(Split::Train, short_T);
  int long_ones = 0;
  for (uint64_t r = 0; r < s.rows(); ++r) {
    const uint64_t example = s.index[s.offset[r]];
    if (rows.example_length(Split::Train, example) <= static_cast<uint64_t>(short_T) + 1) continue;
    ++long_ones;
    CHECK(s.offset[r + 1] - s.offset[r] == 1);
    std::vector<int64_t> in(short_T), tgt(short_T);
    rows.write_row(Split::Train, example, short_T, in.data(), tgt.data());
    const PackedRow row = packed_row(packed, Split::Train, r, short_T);
    CHECK(row.inputs == in);
    CHECK(row.targets == tgt);
  }
  CHECK(long_ones > 5);

  // A dataset without lengths (tokenized before packing existed) is refused, saying what to do.
  std::filesystem::remove(data + "/qa/train.lengths.bin");
  std::filesystem::remove(data + "/qa/val.lengths.bin");
  CHECK_THROWS_WITH(PackedDataset(std::make_unique<PaddedDataset>(data, "qa")),
                    Contains("has no train.lengths.bin") && Contains("Re-run `lora_trainer tokenize`") && Contains("data/pack=false"));
}

TEST_CASE("a packed row's loss is the sum of its examples' losses taken alone, gpt2 and llama, both attention paths", "[packing][numerics]") {
  test::TempDir dir;
  const std::string data = make_qa_dataset(dir);
  const int64_t T = 64;
  PaddedDataset rows(data, "qa");
  PackedDataset packed(std::make_unique<PaddedDataset>(data, "qa"));
  const Packing& p = packed.packing(Split::Train, T);
  Batch b;
  const int64_t B = 3;
  b.inputs = torch::empty({B, T}, torch::kLong);
  b.targets = torch::empty({B, T}, torch::kLong);
  b.segments = torch::zeros({B, T}, torch::kLong);
  for (int64_t r = 0; r < B; ++r)
    packed.sample(Split::Train, static_cast<uint64_t>(r), T, b.inputs[r].data_ptr<int64_t>(), b.targets[r].data_ptr<int64_t>(),
                  b.segments[r].data_ptr<int64_t>());
  REQUIRE(b.segments.max().item<int64_t>() >= 2);  // rows of several examples

  std::vector<bool> paths = {false};
  if (fused_attention_available()) paths.push_back(true);
  else WARN("LibTorch " << compat::torch_version() << " has no fused attention: the masked-softmax path only");
  for (ModelFamily family : {ModelFamily::Gpt2, ModelFamily::Llama})
    for (bool fused : paths) {
      INFO(to_string(family) << (fused ? ", fused attention" : ", masked-softmax attention"));
      ModelOptions o;
      o.family = family;
      o.vocab_size = 257;
      o.block_size = T;
      o.n_layer = 2;
      o.n_head = 4;
      o.n_kv_head = family == ModelFamily::Llama ? 2 : -1;
      o.d_model = 32;
      o.activation = family == ModelFamily::Llama ? ModelOptions::Activation::Silu : ModelOptions::Activation::Gelu;
      o.tie_embeddings = family == ModelFamily::Gpt2;
      o.attention = fused ? ModelOptions::Attention::Fused : ModelOptions::Attention::Manual;
      CausalLM m = make_model(o);
      m->init_weights(at::detail::createCPUGenerator(3));
      auto grads = [&] {
        std::vector<torch::Tensor> g;
        for (auto& t : m->parameters()) {
          g.push_back(t.grad().defined() ? t.grad().clone() : torch::zeros_like(t));
          t.mutable_grad() = torch::Tensor();
        }
        return g;
      };
      auto packed_loss = m->loss_sum(b.inputs, b.targets, b.segments);
      packed_loss.backward();
      const auto packed_grads = grads();
      double alone = 0;
      for (int64_t r = 0; r < B; ++r)
        for (uint64_t k = p.offset[r]; k < p.offset[r + 1]; ++k) {
          const auto n = static_cast<int64_t>(rows.example_length(Split::Train, p.index[k])) - 1;
          auto in = torch::empty({1, n}, torch::kLong), tgt = torch::empty({1, n}, torch::kLong);
          rows.write_row(Split::Train, p.index[k], n, in.data_ptr<int64_t>(), tgt.data_ptr<int64_t>());
          auto l = m->loss_sum(in, tgt);
          l.backward();
          alone += l.item<double>();
        }
      const auto alone_grads = grads();
      // Equal up to f32 rounding (the model computes in f32; rows of other lengths sum in other orders).
      CHECK(packed_loss.item<double>() == Approx(alone).epsilon(1e-5));
      for (size_t i = 0; i < packed_grads.size(); ++i)
        CHECK((packed_grads[i] - alone_grads[i]).abs().max().item<double>() < 1e-5 * (1 + alone_grads[i].abs().max().item<double>()));
      // Without the segments the row is one sequence: the examples see each other, the loss differs.
      CHECK(std::abs(m->loss_sum(b.inputs, b.targets).item<double>() - alone) > 1e-3);
      // All in one segment is the plain causal row.
      CHECK(torch::equal(m->forward(b.inputs, torch::zeros_like(b.segments)), m->forward(b.inputs)));
    }
}

TEST_CASE("a job with data/pack trains on packed rows, with accumulation, and resumes bit-identically", "[packing]") {
  test::TempDir dir;
  const std::string data = make_qa_dataset(dir, 60);
  auto make = [&](const std::string& name) {
    const std::vector<std::string> job = {"training/tokens=1536", R"(training/dataset=[{"name":"qa","rate":1,"style":"padded"}])",
                                          "data/pack=true", "training/per_device_batch_size=2", "architecture/block_size=48"};
    return std::make_unique<Trainer>(test::job_spec(name), test::tiny_config(Trainer::schema(), data, job), dir / "out");
  };
  auto straight = make("straight");
  const int64_t N = straight->total_steps();
  REQUIRE(N == 8);
  std::vector<double> losses;
  for (int64_t i = 0; i < N; ++i) losses.push_back(straight->train_step().loss);
  CHECK(losses.back() < losses.front());
  {
    auto first = make("split");
    for (int i = 0; i < 3; ++i) CHECK(first->train_step().loss == losses[static_cast<size_t>(i)]);
    first->save("ntoks/" + std::to_string(first->tokens()));
  }
  auto resumed = make("split");
  REQUIRE(resumed->restore_latest() == "ntoks/576");
  for (int64_t i = 3; i < N; ++i) CHECK(resumed->train_step().loss == losses[static_cast<size_t>(i)]);
  test::require_same_state(*straight, *resumed);
  // Validation reads the packed validation rows: a finite loss over their counted tokens.
  const ValResult v = straight->validate();
  CHECK(v.tokens > 0);
  CHECK(std::isfinite(v.loss));
}

TEST_CASE("concat_rows keeps packed rows' segments beside rows that are one sequence (a continual fade)", "[packing]") {
  Batch packed, plain;
  packed.inputs = torch::ones({1, 4}, torch::kLong);
  packed.targets = torch::ones({1, 4}, torch::kLong);
  packed.segments = torch::tensor({0, 0, 1, 1}, torch::kLong).view({1, 4});
  packed.source = {0};
  plain.inputs = torch::full({2, 4}, 2, torch::kLong);
  plain.targets = torch::full({2, 4}, 2, torch::kLong);
  plain.source = {1, 1};
  const Batch both = concat_rows(plain, packed);
  CHECK(both.inputs.size(0) == 3);
  REQUIRE(both.segments.defined());
  CHECK(torch::equal(both.segments, torch::tensor({0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1}, torch::kLong).view({3, 4})));
  CHECK(both.source == std::vector<int>{1, 1, 0});
  CHECK_FALSE(concat_rows(plain, plain).segments.defined());
}
