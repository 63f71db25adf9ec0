// What a command writes never costs the user a file: re-runs into a directory it wrote before keep
// everything it did not write, a refused command leaves its outputs as they were, outputs are never
// read back as inputs, a write killed between its renames is put back by the next one, and a full disk
// ends in a clear error (exit 2) with no temporary left and no crash.
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "catch.hpp"

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;
namespace fs = std::filesystem;

namespace {

const std::string kModel = std::string(LT_SOURCE_DIR) + "/tests/data/hf_gpt2/model";

// Every entry below `dir` (relative paths) with its bytes: what a command must leave as it was.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> out;
  walk_tree(dir, [&](const std::string& p, bool is_dir) {
    out[fs::relative(p, dir).string()] = is_dir ? std::string("<dir>") : read_file(p);
    return true;
  });
  return out;
}

// Names in `dir` that are temporaries of ours (.X.tmp-*, .X.old-*, X.tmp-*).
std::vector<std::string> leftovers(const std::string& dir) {
  std::vector<std::string> out;
  walk_tree(dir, [&](const std::string& p, bool) {
    const std::string n = fs::path(p).filename().string();
    if (n.find(".tmp-") != std::string::npos || n.find(".old-") != std::string::npos) out.push_back(p);
    return true;
  });
  return out;
}

// A tmpfs of `kib` KiB mounted at `dir` for the test's lifetime (root only; `ok` false elsewhere).
struct SmallDisk {
  std::string dir;
  bool ok = false;
  SmallDisk(const std::string& at, int kib) : dir(at) {
    fs::create_directories(dir);
    ok = ::mount("tmpfs", dir.c_str(), "tmpfs", 0, ("size=" + std::to_string(kib) + "k").c_str()) == 0;
  }
  ~SmallDisk() {
    if (ok) ::umount2(dir.c_str(), MNT_DETACH);
  }
};

}  // namespace

TEST_CASE("outputs: a second export or import into its directory replaces only its own files", "[outputs]") {
  test::TempDir d;
  const std::string imported = d / "imported", hf = d / "hf";
  import_hf(kModel, imported);
  export_hf(imported, hf);
  // The user completes the export into a model directory, as one does for the Hub.
  write_file_atomic(hf + "/tokenizer.json", "{\"mine\": 1}");
  write_file_atomic(hf + "/README.md", "# my model\n");
  fs::create_directories(hf + "/extra");
  write_file_atomic(hf + "/extra/notes.txt", "notes");
  fs::create_symlink("README.md", hf + "/link.md");
  export_hf(imported, hf);
  CHECK(read_file(hf + "/tokenizer.json") == "{\"mine\": 1}");
  CHECK(read_file(hf + "/README.md") == "# my model\n");
  CHECK(read_file(hf + "/extra/notes.txt") == "notes");
  CHECK(fs::read_symlink(hf + "/link.md") == "README.md");
  CHECK(fs::exists(hf + "/model.safetensors"));
  CHECK(fs::exists(hf + "/config.json"));
  // Through the launcher as well, and for import-hf over an earlier import.
  write_file_atomic(imported + "/NOTES", "mine");
  auto r = test::launch({"import-hf", kModel, imported});
  CHECK(r.code == 0);
  CHECK(read_file(imported + "/NOTES") == "mine");
  CHECK(is_checkpoint(imported));
  CHECK(leftovers(d.str()).empty());

  // An earlier PEFT export's own files go when an HF export replaces it; the user's stay.
  const std::string switched = d / "switched";
  fs::create_directories(switched);
  write_file_atomic(switched + "/" + kExportMarker, R"({"exported_from": "x", "format": "peft"})");
  write_file_atomic(switched + "/adapter_config.json", "{}");
  write_file_atomic(switched + "/adapter_model.safetensors", "x");
  write_file_atomic(switched + "/README.md", "keep");
  export_hf(imported, switched);
  CHECK_FALSE(fs::exists(switched + "/adapter_config.json"));
  CHECK_FALSE(fs::exists(switched + "/adapter_model.safetensors"));
  CHECK(read_file(switched + "/README.md") == "keep");
  CHECK(fs::exists(switched + "/model.safetensors"));
}

TEST_CASE("outputs: somebody's directory is refused unchanged, or written into with --force keeping its files", "[outputs]") {
  test::TempDir d;
  const std::string imported = d / "imported", mine = d / "mine";
  import_hf(kModel, imported);
  fs::create_directories(mine);
  write_file_atomic(mine + "/config.json", "{\"theirs\": true}");
  write_file_atomic(mine + "/README.md", "readme");
  const auto before = snapshot(mine);
  auto r = test::launch({"export", "--format", "hf", imported, mine});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("not an earlier export or import") && Contains("--force") && Contains("Nothing was written"));
  CHECK(snapshot(mine) == before);
  r = test::launch({"import-hf", kModel, mine});
  CHECK(r.code == 2);
  CHECK(snapshot(mine) == before);
  // --force: the files this export writes are replaced (config.json), every other one is kept.
  r = test::launch({"export", "--format", "hf", "--force", imported, mine});
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(read_file(mine + "/README.md") == "readme");
  CHECK(read_file(mine + "/config.json").find("theirs") == std::string::npos);
  CHECK(fs::exists(mine + "/model.safetensors"));
  // An empty directory made beforehand is a fine OUT.
  fs::create_directories(d / "empty");
  CHECK(test::launch({"export", imported, d / "empty"}).code == 0);
  CHECK(is_checkpoint(d / "empty"));
  // A file is not.
  write_file_atomic(d / "afile", "x");
  r = test::launch({"export", imported, d / "afile"});
  CHECK(r.code == 2);
  CHECK(read_file(d / "afile") == "x");
}

TEST_CASE("outputs: a refused or failed tokenize leaves the existing dataset as it was", "[outputs]") {
  test::TempDir d;
  const std::string data = d / "data", text = d / "text";
  fs::create_directories(text);
  for (int i = 0; i < 4; ++i) write_file_atomic(text + "/doc" + std::to_string(i) + ".txt", test::generated_text(i, 200));
  auto r = test::launch({"tokenize", "--name", "notes", "--tokenizer", "byte", "--data-dir", data, text});
  REQUIRE(r.code == 0);
  write_file_atomic(data + "/notes/LICENSE", "mine");
  const auto before = snapshot(data);
  // Refusals after the dataset was found: no input files, a split that leaves validation empty, an
  // unreadable input, a malformed JSONL record. Each leaves it as it was.
  fs::create_directories(d / "empty");
  CHECK(test::launch({"tokenize", "--name", "notes", "--tokenizer", "byte", "--data-dir", data, d / "empty"}).code == 2);
  CHECK(snapshot(data) == before);
  write_file_atomic(d / "blank.txt", "");  // one token (end-of-text): nothing left for training
  CHECK(test::launch({"tokenize", "--name", "notes", "--tokenizer", "byte", "--data-dir", data, d / "blank.txt"}).code == 2);
  CHECK(snapshot(data) == before);
  write_file_atomic(d / "bad.jsonl", "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": 1}\n");
  CHECK(test::launch({"tokenize", "--format", "jsonl", "--name", "notes", "--tokenizer", "byte", "--data-dir", data, d / "bad.jsonl"}).code == 2);
  CHECK(snapshot(data) == before);
  CHECK(leftovers(data).empty());
  // A re-run replaces the dataset's files and keeps the user's.
  r = test::launch({"tokenize", "--name", "notes", "--tokenizer", "byte", "--data-dir", data, text + "/doc0.txt", text + "/doc1.txt",
                    text + "/doc2.txt"});
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(read_file(data + "/notes/LICENSE") == "mine");
  CHECK(read_json_file(data + "/notes/meta.json")["documents"] == 3);
  // Somebody's directory under that name needs --force.
  fs::create_directories(data + "/raw");
  write_file_atomic(data + "/raw/x.txt", "x");
  r = test::launch({"tokenize", "--name", "raw", "--tokenizer", "byte", "--data-dir", data, text});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("--force"));
  CHECK_FALSE(fs::exists(data + "/raw/meta.json"));
}

TEST_CASE("outputs: tokenize never reads its own output back as input", "[outputs]") {
  test::TempDir d;
  const std::string corpus = d / "corpus";
  fs::create_directories(corpus + "/sub");
  for (int i = 0; i < 4; ++i) write_file_atomic(corpus + "/sub/doc" + std::to_string(i) + ".txt", test::generated_text(i, 200));
  const std::string data = corpus + "/data";  // the data directory inside the tree being tokenized
  auto run = [&] { return test::launch({"tokenize", "--name", "c", "--tokenizer", "byte", "--data-dir", data, corpus}); };
  auto r = run();
  REQUIRE(r.code == 0);
  const auto first = read_json_file(data + "/c/meta.json");
  r = run();  // the dataset written by the first run is now inside the input tree
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, Contains("skipping"));
  const auto second = read_json_file(data + "/c/meta.json");
  CHECK(second["documents"] == first["documents"]);
  CHECK(second["train_tokens"] == first["train_tokens"]);
  // Giving a file of the dataset being written as input is refused.
  r = test::launch({"tokenize", "--name", "c", "--tokenizer", "byte", "--data-dir", data, data + "/c/train.bin"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("inside the dataset being written"));
}

TEST_CASE("outputs: a write killed between its renames is put back, and stale temporaries go", "[outputs]") {
  test::TempDir d;
  const std::string out = d / "out";
  // A process that no longer runs: the largest pid Linux can give is below 2^22.
  const long dead = 4194999;
  const std::string old = d / (".out.old-" + temp_tag(out, dead)), tmp = d / (".out.tmp-" + temp_tag(out, dead));
  fs::create_directories(old);
  write_file_atomic(old + "/data.txt", "the old contents");
  fs::create_directories(tmp);
  write_file_atomic(tmp + "/half", "partial");
  const std::string notes_tmp = d / ("notes.tmp-" + temp_tag(d / "notes", dead));
  write_file_atomic(notes_tmp, "partial");
  // Another process's write in progress (this one's pid: alive) is left alone.
  const std::string live = d / (".out.tmp-" + temp_tag(out));
  fs::create_directories(live);
  CHECK(recover_interrupted_writes(out) == 2);
  CHECK(read_file(out + "/data.txt") == "the old contents");
  CHECK_FALSE(fs::exists(tmp));
  CHECK(fs::exists(live));
  write_file_atomic(d / "notes", "complete");
  CHECK_FALSE(fs::exists(notes_tmp));
  fs::remove(live);
  // A replace keeps what it does not write and drops only `ours` (the directory has no record yet).
  publish_dir(out, [](const fs::path& tmp) { write_file_atomic((tmp / "new.txt").string(), "new"); }, "", {"data.txt"});
  CHECK(read_file(out + "/new.txt") == "new");
  CHECK_FALSE(fs::exists(out + "/data.txt"));
  // A failing fill leaves the old directory and no temporary.
  write_file_atomic(out + "/keep.txt", "keep");
  CHECK_THROWS_WITH(publish_dir(out, [](const fs::path&) { throw UserError("refused"); }), Contains("refused"));
  CHECK(read_file(out + "/keep.txt") == "keep");
  CHECK(leftovers(d.str()).empty());
  // Through a command: the kill left only the old export, which the next export finds in place.
  const std::string imported = d / "imported";
  import_hf(kModel, imported);
  fs::rename(imported, d / (".imported.old-" + temp_tag(imported, dead)));
  auto r = test::launch({"import-hf", kModel, imported});
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(is_checkpoint(imported));
  CHECK(leftovers(d.str()).empty());
}

TEST_CASE("outputs: files and directories named like our temporaries but not made by us are never removed or put back", "[outputs]") {
  test::TempDir d;
  const std::string out = d / "out", dead = "4194999";
  // The user's: a backup beside a file we write, directories in an older lora_trainer's or any other
  // pattern beside a directory we write, and one whose (valid) tag was made for another name.
  const std::vector<std::string> files = {d / "notes.tmp-backup", d / ("notes.tmp-" + dead + "-7"), d / ("out.tmp-" + dead + "-1")};
  const std::vector<std::string> dirs = {d / (".out.tmp-" + dead + "-7"), d / ".out.del-x", d / (".out.tmp-" + temp_tag(d / "other", 4194999))};
  for (const auto& f : files) write_file_atomic(f, "mine");
  for (const auto& p : dirs) write_file_atomic(p + "/f", "mine");
  // An `.old` copy of the user's while OUT is missing is not taken for ours: not put back.
  write_file_atomic(d / (".out.old-" + dead + "-2/f"), "mine");
  CHECK(recover_interrupted_writes(out) == 0);
  CHECK_FALSE(fs::exists(out));
  write_file_atomic(d / "notes", "ours");
  publish_dir(out, [](const fs::path& tmp) { write_file_atomic((tmp / "a.txt").string(), "a"); });
  auto r = test::launch({"import-hf", kModel, d / "notes"});  // refused: a file; its lookalikes untouched
  CHECK(r.code == 2);
  for (const auto& f : files) CHECK(read_file(f) == "mine");
  for (const auto& p : dirs) CHECK(read_file(p + "/f") == "mine");
  CHECK(read_file(d / (".out.old-" + dead + "-2/f")) == "mine");
  CHECK(read_file(out + "/a.txt") == "a");
}

TEST_CASE("outputs: a re-export drops only what its earlier export recorded, and shards, an index and models of the user's stay", "[outputs]") {
  test::TempDir d;
  const std::string adapter = std::string(LT_SOURCE_DIR) + "/tests/data/checkpoints/format1_lora";
  const std::string peft = d / "peft";
  REQUIRE(test::launch({"export", "--format", "peft", adapter, peft}).code == 0);
  // The user puts a model beside the adapter: shards, their index, a single file and a GGUF.
  const std::vector<std::string> mine = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                         "model.safetensors.index.json", "model.safetensors", "model.gguf", "state.h5"};
  for (const auto& f : mine) write_file_atomic(peft + "/" + f, "mine");
  auto r = test::launch({"export", "--format", "peft", adapter, peft});
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Contains("replacing the earlier export"));
  for (const auto& f : mine) CHECK(read_file(peft + "/" + f) == "mine");
  CHECK(fs::exists(peft + "/adapter_model.safetensors"));
  // Our own files that a later export does not write again still go, each named: a sharded export's
  // shards and index when the next one writes a single file (a shard the user added stays).
  const std::string imported = d / "imported", hf = d / "hf";
  import_hf(kModel, imported);
  r = test::launch({"export", "--format", "hf", "--max-shard-size", "40000", imported, hf});
  INFO(r.out);
  REQUIRE(r.code == 0);
  std::vector<std::string> shards;
  for (const auto& e : fs::directory_iterator(hf))
    if (is_hf_shard_name(e.path().filename().string())) shards.push_back(e.path().filename().string());
  REQUIRE(shards.size() >= 2);
  write_file_atomic(hf + "/model-00099-of-00099.safetensors", "mine");
  r = test::launch({"export", "--format", "hf", imported, hf});
  INFO(r.out);
  CHECK(r.code == 0);
  for (const auto& s : shards) {
    CHECK_FALSE(fs::exists(hf + "/" + s));
    CHECK_THAT(r.out, Contains("removed " + fs::weakly_canonical(hf).string() + "/" + s));
  }
  CHECK_FALSE(fs::exists(hf + "/model.safetensors.index.json"));
  CHECK(read_file(hf + "/model-00099-of-00099.safetensors") == "mine");
  CHECK(fs::exists(hf + "/model.safetensors"));
  // An export of an older lora_trainer (a marker, no record): only its format's fixed names go; the
  // shards beside it may be the user's, so they stay, with a note.
  const std::string older = d / "older";
  write_file_atomic(older + "/" + kExportMarker, R"({"exported_from": "x", "format": "peft"})");
  write_file_atomic(older + "/adapter_model.safetensors", "old");
  write_file_atomic(older + "/adapter_config.json", "{}");
  write_file_atomic(older + "/model-00001-of-00001.safetensors", "mine");
  r = test::launch({"export", "--format", "hf", imported, older});
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_FALSE(fs::exists(older + "/adapter_model.safetensors"));
  CHECK(read_file(older + "/model-00001-of-00001.safetensors") == "mine");
  CHECK_THAT(r.out, Contains("model-00001-of-00001.safetensors may be that export's or yours"));
}

TEST_CASE("outputs: a re-tokenize drops only its earlier dataset's files, and a meta.json that is not ours needs --force", "[outputs]") {
  test::TempDir d;
  const std::string data = d / "data", text = d / "text";
  write_file_atomic(text + "/doc.txt", test::generated_text(1, 400));
  auto tokenize = [&](const std::string& name, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"tokenize", "--name", name, "--tokenizer", "byte", "--data-dir", data};
    args.insert(args.end(), extra.begin(), extra.end());
    args.push_back(text);
    return test::launch(args);
  };
  REQUIRE(tokenize("notes").code == 0);
  // Files of the names another kind of dataset writes, put there by the user, stay.
  for (const char* f : {"train.tokens.bin", "shape.json", "val.mask.bin"}) write_file_atomic(data + "/notes/" + f, "mine");
  auto r = tokenize("notes");
  INFO(r.out);
  CHECK(r.code == 0);
  for (const char* f : {"train.tokens.bin", "shape.json", "val.mask.bin"}) CHECK(read_file(data + "/notes/" + f) == "mine");
  // A directory with somebody's meta.json is not a dataset of ours.
  write_file_atomic(data + "/theirs/meta.json", R"({"author": "me"})");
  write_file_atomic(data + "/theirs/train.bin", "mine");
  r = tokenize("theirs");
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("--force"));
  CHECK(read_file(data + "/theirs/train.bin") == "mine");
  // A dataset of an older lora_trainer (its meta.json, no record) is replaced as before.
  write_file_atomic(data + "/older/meta.json", R"({"style": "padded", "tokenizer": "byte", "vocab_size": 257})");
  write_file_atomic(data + "/older/train.tokens.bin", "old");
  write_file_atomic(data + "/older/README", "mine");
  r = tokenize("older");
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_FALSE(fs::exists(data + "/older/train.tokens.bin"));
  CHECK(read_file(data + "/older/README") == "mine");
  CHECK(fs::exists(data + "/older/train.bin"));
}

TEST_CASE("outputs: a full disk ends every save in exit 2, no temporary and no crash", "[outputs]") {
  test::TempDir d;
  SmallDisk disk(d / "disk", 96);
  if (!disk.ok) {
    WARN("skipped: mounting a small tmpfs needs root (the full-disk checks run as root in CI)");
    return;
  }
  const std::string imported = d / "imported";
  import_hf(kModel, imported);
  // The model needs ~150 KB: import-hf, export (native, hf) and a training job's checkpoint all fail
  // inside the HDF5 or safetensors write.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"import-hf", kModel, disk.dir + "/a"}, {"export", imported, disk.dir + "/b"},
        {"export", "--format", "hf", imported, disk.dir + "/c"}}) {
    auto r = test::launch(args);
    INFO(args[0] << " " << args.back() << ": " << r.out);
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains("No space left on device"));
    CHECK(r.out.find("internal error") == std::string::npos);
    CHECK(leftovers(disk.dir).empty());
    CHECK_FALSE(fs::exists(args.back()));
  }
  // tokenize into a data directory on the full disk.
  write_file_atomic(d / "big.txt", test::generated_text(1, 60000));
  auto r = test::launch({"tokenize", "--name", "big", "--tokenizer", "byte", "--data-dir", disk.dir, d / "big.txt"});
  INFO(r.out);
  CHECK(r.code == 2);
  CHECK(leftovers(disk.dir).empty());
  CHECK_FALSE(fs::exists(disk.dir + "/big"));
}

TEST_CASE("outputs: a FIFO where a file is read is refused without blocking", "[outputs]") {
  test::TempDir d;
  const std::string model = d / "model";
  fs::create_directories(model);
  fs::copy_file(kModel + "/config.json", model + "/config.json");
  REQUIRE(::mkfifo((model + "/model.safetensors").c_str(), 0644) == 0);
  auto r = test::shell("timeout 60 " + test::quote(LT_LAUNCHER) + " import-hf " + test::quote(model) + " " + test::quote(d / "out"));
  INFO(r.out);
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("model.safetensors") && Contains("FIFO"));
  // A FIFO as a config file or a tokenizer.json is refused the same way.
  fs::remove(model + "/model.safetensors");
  fs::copy_file(kModel + "/model.safetensors", model + "/model.safetensors");
  fs::remove(model + "/config.json");
  REQUIRE(::mkfifo((model + "/config.json").c_str(), 0644) == 0);
  r = test::shell("timeout 60 " + test::quote(LT_LAUNCHER) + " import-hf " + test::quote(model) + " " + test::quote(d / "out"));
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("FIFO"));
}
