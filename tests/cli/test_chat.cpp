// Chatting with a trained model through the template it was trained with: `sample --chat` for one
// reply (to --prompt, or to a whole conversation from --messages FILE), and `chat` reading a pipe and
// in a terminal (driven through a pseudo-terminal where one can be opened, as a person types): the
// history is kept, so each reply is the one `sample --messages` gives for the conversation so far, and
// /reset and /system change it.
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>
#include <utmp.h>

#include <chrono>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch.hpp"
#include "chat_fixtures.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"

using lt::test::Contains;
using ojson = nlohmann::ordered_json;

namespace {

// A LoRA job on conversations whose replies depend on what came before (a greeting is answered
// "Hello!" the first time, "Again?" the second, "Yo." after a system message), finished: its
// checkpoint, which records the chat format.
std::string chat_checkpoint(const lt::test::TempDir& tmp) {
  const std::string model = lt::test::chat_model_dir(tmp), data = tmp / "data";
  lt::test::tokenize_conversations(
      tmp, model, data,
      {R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})",
       R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
           {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Again?"}]})",
       R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Yo."}]})"},
      4, "0.1");
  std::vector<std::string> args = {"configure", "lora/train", tmp / "chat.json"};
  for (const auto& o : lt::test::chat_job_overrides(data, 512)) args.push_back(o);
  // Phase one learns the conversations (a random model's next token hardly depends on the context, so
  // every history would get the same reply), packed: each attends to itself alone, as in a chat (a
  // left-padded row's example also sees its padding); the LoRA phase gives the checkpoint its adapters.
  const std::string& conv = lt::test::kConversations;
  for (const std::string& o : std::vector<std::string>{"training/pre_lora_tokens=[65536]", "training/pre_lora_dataset=" + conv,
                              "training/post_lora_dataset=" + conv, "optimization/lr=0.003", "training/warmup_pct=0.05", "architecture/d_model=64",
                              "data/pack=true"})
    args.push_back(o);
  REQUIRE(lt::test::launch(args).code == 0);
  const auto r = lt::test::launch({"run", "chat", tmp / "chat.json", tmp / "out"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  return tmp / "out/checkpoints/general/default/chat/final/66048";
}

const std::vector<std::string> kDraws = {"--tokens", "8", "--temperature", "0"};  // greedy

// `sample --messages` of `messages` (a JSON list): its reply, the line it prints on stdout.
std::string sample_reply(const lt::test::TempDir& tmp, const std::string& ck, const ojson& messages) {
  const std::string file = tmp / "messages.json";
  lt::write_file_atomic(file, messages.dump());
  std::vector<std::string> args = {"sample", ck, "--messages", file};
  args.insert(args.end(), kDraws.begin(), kDraws.end());
  const std::string out_file = tmp / "reply.txt";
  std::string cmd = lt::test::quote(LT_LAUNCHER);
  for (const auto& a : args) cmd += " " + lt::test::quote(a);
  const lt::test::Result r = lt::test::shell("( " + cmd + " > " + lt::test::quote(out_file) + " )");
  INFO(r.out);
  REQUIRE(r.code == 0);
  std::string reply = lt::read_file(out_file);
  REQUIRE(!reply.empty());
  REQUIRE(reply.back() == '\n');
  reply.pop_back();
  return reply;
}

// Runs `chat CHECKPOINT` on a pseudo-terminal (no echo, output as written), types `input`, and returns
// what it wrote on the terminal (its stdout) and, apart, its stderr. Empty when no pseudo-terminal can
// be opened here (a container or chroot without /dev/pts): `why` then says so.
std::optional<lt::test::Result> chat_on_terminal(const std::string& ck, const std::string& input, const std::string& err_file,
                                                 std::string& why) {
  struct termios t {};
  cfmakeraw(&t);  // no echo and no output processing: the terminal shows exactly what was written
  t.c_lflag |= ICANON;  // but lines, as a person's typing arrives
  int master = -1, slave = -1;
  if (openpty(&master, &slave, nullptr, &t, nullptr) != 0) {
    why = std::strerror(errno);
    return std::nullopt;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(master);
    if (login_tty(slave) != 0) _exit(125);
    if (!std::freopen(err_file.c_str(), "w", stderr)) _exit(126);
    std::vector<std::string> args = {LT_LAUNCHER, "chat", ck};
    args.insert(args.end(), kDraws.begin(), kDraws.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(LT_LAUNCHER, argv.data());
    _exit(127);
  }
  close(slave);
  REQUIRE(write(master, input.data(), input.size()) == static_cast<ssize_t>(input.size()));
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  char buf[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    struct pollfd p {master, POLLIN, 0};
    if (poll(&p, 1, 1000) <= 0) continue;
    const ssize_t n = read(master, buf, sizeof buf);
    if (n <= 0) break;  // EIO: the terminal's last user closed it
    out.append(buf, static_cast<size_t>(n));
  }
  int status = 0;
  if (waitpid(pid, &status, WNOHANG) == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  close(master);
  return lt::test::Result{WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

}  // namespace

TEST_CASE("chat: two turns, the second reply conditioned on the first, then /reset and /system, from a pipe and in a terminal", "[chat][launcher]") {
  lt::test::TempDir tmp;
  const std::string ck = chat_checkpoint(tmp);
  const ojson hi = {{"role", "user"}, {"content", "Hi"}}, sys = {{"role", "system"}, {"content", "Be brief."}};
  // What sample --messages replies to each conversation.
  const std::string r1 = sample_reply(tmp, ck, ojson::array({hi}));
  const std::string r2 = sample_reply(tmp, ck, ojson::array({hi, {{"role", "assistant"}, {"content", r1}}, hi}));
  const std::string with_system = sample_reply(tmp, ck, ojson::array({sys, hi}));
  // The model learned its conversations ("Hello!", "Again?", "Yo."): the same message gets another reply
  // after a first turn, or after a system message.
  CHECK(r1 == "Hello!");
  CHECK(r2 == "Again?");
  CHECK(with_system == "Yo.");
  // Read from a pipe: the replies alone, one line each, no prompts; two turns, /reset and the question
  // alone again, /system (kept by /reset) and it again; an unknown command is named and skipped; end of
  // input ends it.
  const std::string typed = "Hi\nHi\n/reset\nHi\n/bogus\n/system Be brief.\n/reset\nHi\n";
  lt::write_file_atomic(tmp / "in.txt", typed);
  const std::string out = tmp / "out.txt";
  std::string cmd = lt::test::quote(LT_LAUNCHER) + " chat " + lt::test::quote(ck);
  for (const auto& a : kDraws) cmd += " " + a;
  const lt::test::Result piped =
      lt::test::shell("( " + cmd + " < " + lt::test::quote(tmp / "in.txt") + " > " + lt::test::quote(out) + " )");
  INFO(piped.out);
  CHECK(piped.code == 0);
  CHECK(lt::read_file(out) == r1 + "\n" + r2 + "\n" + r1 + "\n" + with_system + "\n");
  CHECK_THAT(piped.out, Contains("through the template its training conversations were rendered with"));
  CHECK_THAT(piped.out, Contains("(the conversation is forgotten"));
  CHECK_THAT(piped.out, Contains("unknown command /bogus"));

  // In a terminal, as a person types: a prompt before each line, the same replies, /exit ends it.
  const std::string err = tmp / "chat.err";
  std::string why;
  const auto chat = chat_on_terminal(ck, typed + "/exit\n", err, why);
  if (!chat) {
    WARN("no pseudo-terminal can be opened here (" << why << "): the prompts on a terminal were not checked");
    return;
  }
  INFO(chat->out << "\n---\n" << lt::read_file(err));
  CHECK(chat->code == 0);
  CHECK(chat->out == "> " + r1 + "\n> " + r2 + "\n> > " + r1 + "\n> > > > " + with_system + "\n> \n");
}

TEST_CASE("sample --messages replies to a whole conversation through the checkpoint's template", "[chat][launcher]") {
  lt::test::TempDir tmp;
  const std::string ck = chat_checkpoint(tmp);
  // --chat --prompt is the conversation of one user message; --messages takes a list or a chat record.
  const ojson u1 = {{"role", "user"}, {"content", "Hi"}};
  const std::string r1 = sample_reply(tmp, ck, ojson::array({u1}));
  std::vector<std::string> args = {"sample", ck, "--chat", "--prompt", "Hi"};
  args.insert(args.end(), kDraws.begin(), kDraws.end());
  auto r = lt::test::launch(args);
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK(r.out.size() > r1.size());
  CHECK(r.out.compare(r.out.size() - r1.size() - 1, std::string::npos, r1 + "\n") == 0);
  lt::write_file_atomic(tmp / "record.json", ojson{{"messages", ojson::array({u1})}}.dump());
  args = {"sample", ck, "--messages", tmp / "record.json"};
  args.insert(args.end(), kDraws.begin(), kDraws.end());
  r = lt::test::launch(args);
  REQUIRE(r.code == 0);
  CHECK(r.out.compare(r.out.size() - r1.size() - 1, std::string::npos, r1 + "\n") == 0);
  // --messages then --prompt: the prompt is the next user message.
  const ojson a1 = {{"role", "assistant"}, {"content", "Hello!"}}, u2 = u1;
  lt::write_file_atomic(tmp / "two.json", ojson::array({u1, a1}).dump());
  const std::string r2 = sample_reply(tmp, ck, ojson::array({u1, a1, u2}));
  args = {"sample", ck, "--messages", tmp / "two.json", "--prompt", "Hi"};
  args.insert(args.end(), kDraws.begin(), kDraws.end());
  r = lt::test::launch(args);
  REQUIRE(r.code == 0);
  CHECK(r.out.compare(r.out.size() - r2.size() - 1, std::string::npos, r2 + "\n") == 0);
  CHECK(r2 != r1);

  // A bad conversation: exit 2, naming the file and the message.
  lt::write_file_atomic(tmp / "bad.json", R"([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])");
  r = lt::test::launch({"sample", ck, "--messages", tmp / "bad.json"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains(tmp / "bad.json") && Contains("message 2 has an unknown role \"robot\""));
  lt::write_file_atomic(tmp / "broken.json", R"([{"role": "user", "content": "hi"})");
  r = lt::test::launch({"sample", ck, "--messages", tmp / "broken.json"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains(tmp / "broken.json"));
  r = lt::test::launch({"sample", ck, "--tokens", "4"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("--prompt TEXT") && Contains("--messages FILE.json"));
}
