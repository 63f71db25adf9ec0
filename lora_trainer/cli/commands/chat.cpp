// `lora_trainer chat CHECKPOINT [--system TEXT] [--tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
// [--tokenizer NAME] [key=value ...]`: a conversation with a trained model in the terminal, through the
// chat template it was trained with (training/conversation.hpp). Each line read is the user's message;
// the reply is printed as it is generated and ends at the end of turn. Lines starting with '/' are
// commands: /reset, /system [TEXT], /help, /exit ('//' sends a message that starts with '/').
#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "lora_trainer/cli/commands/generation_args.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {
namespace {

struct ChatArgs {
  GenerationArgs g;
  std::string system;
};

const char* const kHelp =
    "/reset          forget the conversation (the system message stays)\n"
    "/system TEXT    set the system message (/system alone removes it)\n"
    "/help           this list\n"
    "/exit           end (as does Ctrl-D); a message starting with '/' is written '//...'\n";

// A command line ("/..."): true when the chat goes on.
bool command(Conversation& c, const std::string& line) {
  const size_t space = line.find(' ');
  const std::string name = line.substr(0, space), arg = space == std::string::npos ? "" : line.substr(space + 1);
  if (name == "/exit" || name == "/quit") return false;
  if (name == "/reset") {
    c.reset();
    std::fprintf(stderr, "(the conversation is forgotten%s)\n", c.system().empty() ? "" : "; the system message stays");
  } else if (name == "/system") {
    c.set_system(arg);
    std::fprintf(stderr, "%s\n", arg.empty() ? "(no system message)" : "(system message set)");
  } else if (name == "/help") {
    std::fprintf(stderr, "%s", kHelp);
  } else {
    std::fprintf(stderr, "unknown command %s; the commands are:\n%s", name.c_str(), kHelp);
  }
  return true;
}

int chat(const ChatArgs& a) {
  GeneratingModel m = load_generating_model(a.g, "chat");
  Conversation c = conversation_with(m, a.g, "chat");
  c.set_system(a.system);
  const bool terminal = isatty(STDIN_FILENO) != 0;
  std::fprintf(stderr,
               "chatting with %s through %s; a reply ends at its end of turn or after %lld tokens. /help lists the "
               "commands; /exit or Ctrl-D ends.\n",
               a.g.checkpoint.c_str(), c.from().c_str(), (long long)a.g.gen.max_new_tokens);
  std::string line;
  while (true) {
    if (terminal) print("> ");
    if (!std::getline(std::cin, line)) break;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    if (line[0] == '/' && line.compare(0, 2, "//") != 0) {
      if (!command(c, line)) break;
      continue;
    }
    c.add_user(line[0] == '/' ? line.substr(1) : line);
    try {
      const size_t prompt = c.prompt_tokens();
      if (static_cast<int64_t>(prompt) + a.g.gen.max_new_tokens > c.block_size())
        std::fprintf(stderr, "(the conversation is %zu tokens; the model sees only its last %lld: /reset starts afresh)\n", prompt,
                     (long long)c.block_size());
      bool ended = false;
      c.reply(print, &ended);
      print("\n");
      if (!ended) std::fprintf(stderr, "(the reply reached --tokens %lld before its end of turn)\n", (long long)a.g.gen.max_new_tokens);
    } catch (const UserError& e) {  // e.g. a template that refuses the conversation: say so, and go on without the message
      c.drop_last();
      std::fprintf(stderr, "error: %s\n", e.what());
    }
  }
  if (terminal) print("\n");
  return 0;
}

}  // namespace

Command add_chat(CLI::App& app) {
  auto a = std::make_shared<ChatArgs>();
  auto* sub = app.add_subcommand("chat", "a conversation with a checkpoint's model in the terminal, through its chat template");
  a->g.add_options(sub, "a reply's most tokens (it stops at its end of turn)");
  sub->add_option("--system", a->system, "the system message (/system changes it)");
  a->g.add_overrides(sub);
  return {sub, [a] { return chat(*a); }};
}

}  // namespace lt
