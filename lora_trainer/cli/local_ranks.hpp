// `run --nproc N`: N ranks of a data-parallel job on this machine, started the way torchrun starts them.
#pragma once

#include <string>
#include <vector>

namespace lt {

// The exit status of a rank whose collective failed because another rank exited or hung (the
// launcher's DistributedError).
constexpr int kExitLostRank = 3;

// Runs `args` (this program's command line for one rank; args[0] is ignored, this executable runs)
// as `nproc` child processes with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR
// (127.0.0.1) and MASTER_PORT (MASTER_PORT from the environment, else a free port) set, and waits
// for them. SIGINT and SIGTERM are passed on to every rank (they checkpoint and stop together). When
// a rank fails, the others get `grace_s` to exit on their own (their collectives fail) and are then
// killed. Returns 0 when every rank succeeded, else the exit status of the rank that failed first
// (128 + the signal for a rank killed by one), preferring a cause over kExitLostRank (a rank that only
// lost contact with a failed peer). When all succeeded it prints each rank's peak resident memory
// (the kernel's rusage of that process).
int run_local_ranks(int nproc, const std::vector<std::string>& args, double grace_s);

// A TCP port on 127.0.0.1 that nothing listens on at the moment of asking.
int free_port();

}  // namespace lt
