// `run --nproc N`: N ranks of a data-parallel job on this machine, started the way torchrun starts them.
#pragma once

#include <string>
#include <vector>

#include "lora_trainer/core/distributed.hpp"  // kExitLostRank

namespace lt {

// Serves the ranks' store (StoreServer, on MASTER_PORT from the environment, else on a port the system
// picks), runs `args` (this program's command line for one rank; args[0] is ignored, this executable
// runs) as `nproc` child processes with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR
// (127.0.0.1), MASTER_PORT (the store's) and TORCHELASTIC_USE_AGENT_STORE=True set, and waits for
// them. SIGINT and SIGTERM are passed on to every rank (they checkpoint and stop together). When a
// rank fails, the others get `grace_s` to exit on their own (their collectives fail) and are then
// killed. Returns 0 when every rank succeeded, else the exit status of the rank that failed first
// (128 + the signal for a rank killed by one), preferring a cause over kExitLostRank (a rank that only
// lost contact with a failed peer), never the launcher's own kill of a rank that did not stop in time.
// When all succeeded it prints each rank's peak resident memory (the kernel's rusage of that process).
int run_local_ranks(int nproc, const std::vector<std::string>& args, double grace_s);

}  // namespace lt
