#include "lora_trainer/training/provenance.hpp"

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/tokenizer_choice.hpp"
#include "lora_trainer/formats/checkpoint.hpp"

namespace lt {

Provenance::Provenance(std::string data_dir, std::vector<std::string> datasets, int64_t vocab_size, std::string model)
    : data_dir_(std::move(data_dir)), datasets_(std::move(datasets)), vocab_size_(vocab_size), model_(std::move(model)) {}

void Provenance::restored(const CheckpointMeta& ck) {
  restored_dir_ = ck.dir;
  restored_tokenizer_ = ck.tokenizer;  // its type checked by CheckpointMeta::read
  restored_chat_ = ck.chat;
  restored_trained_ = ck.step > 0;
  base_model_ = ck.base_model;
}

const Provenance::Records& Provenance::records() const {
  if (records_) return *records_;
  Records r;
  try {
    r.tokenizer = datasets_tokenizer(data_dir_, datasets_);
  } catch (const UserError&) {  // datasets of two tokenizers: nothing recorded, and `auto` says why
  }
  try {
    r.chat = datasets_chat_format(data_dir_, datasets_);
  } catch (const UserError& e) {  // datasets of two templates: none recorded
    r.chat_conflict = e.what();
  }
  records_ = std::move(r);
  return *records_;
}

std::string Provenance::tokenizer_name(const std::string& command, bool trained_here) const {
  TokenizerClues c;
  c.checkpoint = restored_dir_.empty() ? model_ : restored_dir_;
  c.recorded = restored_tokenizer_;
  c.trained = trained_here || restored_trained_;
  c.data_dir = data_dir_;
  c.datasets = datasets_;
  c.hf_dir = base_model_.is_object() ? base_model_.value("hf_dir", std::string()) : std::string();
  c.vocab_size = vocab_size_;
  return auto_tokenizer(c, command);
}

nlohmann::json Provenance::chat_format() const {
  const Records& r = records();
  return !r.chat.is_null() || !r.chat_conflict.empty() ? r.chat : restored_chat_;
}

void Provenance::add_metadata(nlohmann::json& meta) const {
  if (!base_model_.is_null()) meta["base_model"] = base_model_;
  const Records& r = records();
  const std::string& tokenizer = r.tokenizer.empty() ? restored_tokenizer_ : r.tokenizer;
  if (!tokenizer.empty()) meta["tokenizer"] = tokenizer;
  if (nlohmann::json chat = chat_format(); !chat.is_null()) meta["chat"] = std::move(chat);
}

}  // namespace lt
