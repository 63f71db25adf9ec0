// `lora_trainer sample CHECKPOINT --prompt TEXT [--chat [--system TEXT]] [--messages FILE.json] [--tokens N]
// [--temperature T] [--top-k K] [--top-p P] [--seed S] [--tokenizer NAME] [key=value ...]`: text generated from a
// checkpoint's model. With --chat the prompt is a user message and --messages FILE a whole conversation,
// rendered with the chat template the model was trained with (training/conversation.hpp); the reply
// runs to the end-of-turn token and is printed alone.
#include <cstdio>

#include "lora_trainer/cli/commands/generation_args.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {
namespace {

struct SampleArgs {
  GenerationArgs g;
  std::string prompt, system, messages;
  bool chat = false;
  CLI::Option *prompt_opt = nullptr, *system_opt = nullptr, *messages_opt = nullptr;
};

int sample(SampleArgs a) {
  if (a.messages_opt->count() > 0) a.chat = true;  // a conversation is chat
  if (!a.chat) {
    if (a.system_opt->count() > 0)
      throw UserError("sample --system belongs to --chat (a system message rendered with the model's chat template)");
    if (a.g.limit_opt->count() > 0)
      throw UserError("sample --chat-limit belongs to --chat (it bounds the renders of the model's chat template)");
  }
  if (a.prompt_opt->count() == 0 && a.messages_opt->count() == 0)
    throw UserError("sample needs --prompt TEXT (text to continue; with --chat, the user's message) or --messages FILE.json "
                    "(a conversation)");
  GeneratingModel m = load_generating_model(a.g, "sample");
  if (!a.chat) {
    GenerateOptions o = a.g.gen;
    o.stop_ids = {m.tok->eot_id()};
    o.vocab_limit = m.tok->vocab_size();
    o.tokenizer = m.tokenizer_name;
    o.where = "sample: the prompt";
    const auto ids = generate(m.trainer->model(), m.trainer->runtime(), m.tok->encode(a.prompt), o);
    print(a.prompt + m.tok->decode(ids) + "\n");
    return 0;
  }
  Conversation c = conversation_with(m, a.g, "sample --chat");
  if (a.messages_opt->count() > 0) {
    const nlohmann::ordered_json file = parse_ordered_json(read_file(a.messages), a.messages);
    // A list of messages, or a chat record {"messages": [...]} as chat datasets hold them.
    c.set_messages(file.is_array() ? nlohmann::ordered_json{{"messages", file}} : file, a.messages);
  }
  if (a.system_opt->count() > 0) c.set_system(a.system);
  if (a.prompt_opt->count() > 0) c.add_user(a.prompt);
  c.reply(print);
  print("\n");
  return 0;
}

}  // namespace

Command add_sample(CLI::App& app) {
  auto a = std::make_shared<SampleArgs>();
  auto* sub = app.add_subcommand("sample", "generate text from a checkpoint (with --chat, a reply in a conversation)");
  a->g.add_options(sub, "tokens to generate (with --chat: at most, the reply stops at its end of turn)");
  a->prompt_opt = sub->add_option("--prompt", a->prompt, "text to continue (with --chat: the user's message, after --messages' conversation)");
  sub->add_flag("--chat", a->chat,
                "render the conversation (--messages, then --prompt as the user's message) with the chat template the "
                "model was trained with (the checkpoint's record, else the tokenizer's model directory, hf:DIR), and "
                "print the reply, generated up to its end-of-turn token");
  a->messages_opt = sub->add_option("--messages", a->messages,
                                    "a conversation to reply to (implies --chat): a JSON file holding a list of "
                                    "{\"role\", \"content\"} messages, or a chat record {\"messages\": [...]}")
                        ->check(CLI::ExistingFile);
  a->system_opt = sub->add_option("--system", a->system, "with --chat: the system message (replacing --messages' own)");
  a->g.add_overrides(sub);
  return {sub, [a] { return sample(*a); }};
}

}  // namespace lt
