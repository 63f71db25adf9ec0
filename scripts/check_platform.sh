#!/usr/bin/env bash
# Builds this working tree and runs the whole test suite on another Debian release, inside a chroot:
#
#   bash scripts/check_platform.sh debian13        Debian 13 (trixie): LibTorch 2.6 (CPU), HDF5 1.14,
#                                                  Catch2 3, CLI11 2.4, gcc 14. Build + whole ctest suite.
#   bash scripts/check_platform.sh debian13-cuda   Debian 13 contrib/non-free: the CUDA LibTorch 2.6
#                                                  (libtorch-cuda-dev, nvidia-cuda-toolkit 12.4, NCCL).
#                                                  Configure + compile + link (about 12 GB installed).
#                                                  cuDNN cannot be installed here, so the binaries
#                                                  cannot start as built; with a stub libcudnn.so.9
#                                                  (LT_CUDNN_STUB=0: without) the suite runs on the CPU.
#
# Needs root (debootstrap, mount, chroot) and network access to the Debian archive. Steps:
#   1. the root: `debootstrap --variant=minbase trixie` into /var/cache/lora_trainer/roots/PLATFORM
#      (LT_PLATFORM_ROOTS overrides the parent directory), from the Debian mirror this machine's apt
#      uses (/etc/apt/sources.list.d/debian.sources; LT_DEBIAN_MIRROR overrides). A marker file is
#      written only once the root is complete; a root without it (an interrupted run) is deleted and
#      made again. Later runs reuse the root.
#   2. the packages the build needs, installed in the root only when missing.
#   3. the tracked and untracked-not-ignored files (`git ls-files -co --exclude-standard`) plus the
#      GPT-2 tokenizer files (datasets/tokenizer/gpt2, fetched on the host by
#      datasets/fetch_tokenizer.sh when missing) and, where the host has it, the llama.cpp of the GGUF
#      tests (datasets/cache/llama_cpp/node_modules: scripts/fetch_llama_cpp.sh) are copied to /lt/src
#      in the root.
#   4. CMake + Ninja in /lt/build inside the root (never the host's build/), with ccache whose cache
#      (/lt/ccache) persists in the root, then ctest over the whole suite.
# proc, sys, dev, dev/shm and dev/pts are mounted into the root while it runs and always unmounted on exit.
# Exit status: 0 when everything built and every test passed (debian13-cuda: also when it linked but
# the binaries cannot start here, which it says: "compile-and-link only: REASON"), non-zero otherwise.
# Logs: ROOT/lt/logs/{packages,configure,build,test}.log.
set -euo pipefail

# Everything is inside main(), so bash has read the whole script before running any of it (editing
# the file during a run does not change that run).
main() {

  PLATFORM="${1:-}"
  case "$PLATFORM" in
    debian13 | debian13-cuda) ;;
    *)
      echo "usage: bash scripts/check_platform.sh debian13|debian13-cuda" >&2
      exit 2
      ;;
  esac

  SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  ROOTS="${LT_PLATFORM_ROOTS:-/var/cache/lora_trainer/roots}"
  ROOT="$ROOTS/$PLATFORM"
  MARKER="$ROOT/.lora_trainer-root-complete"
  SUITE=trixie
  JOBS="$(nproc)"
  START=$SECONDS

  log() { printf '[check_platform %s %4ds] %s\n' "$PLATFORM" "$((SECONDS - START))" "$*"; }
  die() {
    log "FAILED: $*" >&2
    exit 1
  }

  [[ $(id -u) -eq 0 ]] || die "needs root (debootstrap, mount and chroot)"
  [[ $ROOTS == /* && $ROOTS != / ]] || die "LT_PLATFORM_ROOTS must be an absolute directory other than /"

  COMPONENTS=(main)
  PACKAGES=(build-essential cmake ninja-build pkg-config ccache ca-certificates
            libhdf5-dev zlib1g-dev nlohmann-json3-dev catch2 libcli11-dev libpcre2-dev libutf8proc-dev
            libopenblas0-openmp libdnnl-dev libpython3-stdlib nodejs python3-protobuf python3-crc32c)
  CMAKE_ARGS=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo)
  if [[ $PLATFORM == debian13 ]]; then
    PACKAGES+=(libtorch-dev libgloo-dev)
  else
    COMPONENTS=(main contrib non-free non-free-firmware)
    # libtorch-cuda-dev conflicts with libgloo-dev; nvidia-cudnn (a dependency) is a downloader whose
    # post-install script cannot work offline: see install_packages.
    PACKAGES+=(libtorch-cuda-dev libgloo-cuda-dev libnccl-dev nvidia-cuda-toolkit)
    # cuDNN is absent, so libtorch_cuda's cuDNN symbols stay unresolved at link time; and the test
    # binary cannot be run at build time to list its tests, so they are listed when ctest runs.
    CMAKE_ARGS+=(-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined
                 -DCMAKE_CATCH_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST)
  fi

  # ---------------------------------------------------------------------------------------------------
  # Mounts: everything mounted under ROOT is listed from /proc/self/mountinfo and unmounted deepest
  # first, on every exit. A root is only ever deleted after that succeeded, and then with
  # --one-file-system, so a mount that is still there is never descended into.

  mounts_under() {
    awk -v r="$ROOT" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r
  }

  unmount_all() {
    local m
    for m in $(mounts_under); do
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
    [[ -z "$(mounts_under)" ]]
  }

  cleanup() {
    local rc=$?
    if ! unmount_all; then
      log "WARNING: could not unmount: $(mounts_under | tr '\n' ' ')" >&2
      rc=1
    fi
    exit "$rc"
  }
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM

  mount_root() {
    unmount_all || die "something under $ROOT is mounted and would not unmount"
    mount -t proc proc "$ROOT/proc"
    mount -t sysfs -o ro sysfs "$ROOT/sys"
    mount --bind /dev "$ROOT/dev"
    mkdir -p "$ROOT/dev/shm"
    mount -t tmpfs -o mode=1777,nosuid,nodev shm "$ROOT/dev/shm"
    # Pseudo-terminals (the chat test types into one): the host's, where it has them.
    if mountpoint -q /dev/pts; then
      mount --bind /dev/pts "$ROOT/dev/pts"
    else
      log "the host has no /dev/pts: the tests that need a pseudo-terminal will say they skipped it"
    fi
  }

  remove_root() {
    unmount_all || die "cannot unmount everything under $ROOT; not deleting it"
    rm -rf --one-file-system "$ROOT"
  }

  in_root() {
    chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb DEBIAN_FRONTEND=noninteractive \
      PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      CCACHE_DIR=/lt/ccache CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime \
      "$@"
  }

  # ---------------------------------------------------------------------------------------------------
  # The Debian mirror this machine's apt uses: the first URI of the first deb822 stanza whose suites are
  # not security suites (and the security one, if any), or the same from a one-line sources.list.

  sources_uri() {  # $1: main | security
    local want=$1 f
    for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list.d/*.sources; do
      [[ -f $f ]] || continue
      awk -v want="$want" 'BEGIN { RS = ""; FS = "\n" }
        {
          uris = ""; suites = ""; types = ""
          for (i = 1; i <= NF; i++) {
            if ($i ~ /^URIs:/) { uris = $i; sub(/^URIs:[ \t]*/, "", uris) }
            if ($i ~ /^Suites:/) { suites = $i }
            if ($i ~ /^Types:/) { types = $i }
          }
          if (uris == "" || types !~ /[ \t]deb([ \t]|$)/) next
          sec = (suites ~ /-security/)
          if ((want == "security") == sec) { split(uris, a, /[ \t]+/); print a[1]; exit }
        }' "$f" | grep -m1 . && return 0
    done
    if [[ -f /etc/apt/sources.list ]]; then
      awk -v want="$want" '$1 == "deb" {
          i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
          sec = ($(i + 1) ~ /-security/)
          if ((want == "security") == sec) { print $i; exit }
        }' /etc/apt/sources.list | grep -m1 . && return 0
    fi
    return 1
  }

  MIRROR="${LT_DEBIAN_MIRROR:-$(sources_uri main || true)}"
  [[ -n $MIRROR ]] || die "no Debian mirror found in /etc/apt/sources.list.d/debian.sources; set LT_DEBIAN_MIRROR"
  SECURITY_MIRROR="${LT_DEBIAN_SECURITY_MIRROR-$(sources_uri security || true)}"

  write_sources() {
    local keyring="" f="$ROOT/etc/apt/sources.list.d/debian.sources"
    [[ -f $ROOT/usr/share/keyrings/debian-archive-keyring.gpg ]] &&
      keyring="Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
    {
      printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: %s\n%s\n' \
        "$MIRROR" "$SUITE" "$SUITE" "${COMPONENTS[*]}" "$keyring"
      if [[ -n $SECURITY_MIRROR ]]; then
        printf '\nTypes: deb\nURIs: %s\nSuites: %s-security\nComponents: %s\n%s\n' \
          "$SECURITY_MIRROR" "$SUITE" "${COMPONENTS[*]}" "$keyring"
      fi
    } >"$f.new"
    if ! cmp -s "$f.new" "$f"; then
      mv "$f.new" "$f"
      rm -f "$ROOT/etc/apt/sources.list" "$ROOT/lt/.apt-updated"
    else
      rm -f "$f.new"
    fi
  }

  # A stand-in for cuDNN (debian13-cuda): libcudnn.so.9 with every cuDNN function that the libraries
  # of the test binary import, each returning 1 (CUDNN_STATUS_NOT_INITIALIZED), under the version
  # node libcudnn.so.9 that their references carry. Prints how many functions it has.
  make_cudnn_stub() {
    in_root bash -c '
      set -euo pipefail
      mkdir -p /lt/cudnn-stub
      cd /lt/cudnn-stub
      for lib in $(ldd /lt/build/lora_trainer_tests | awk "/=> \// { print \$3 }"); do
        nm -D --undefined-only --with-symbol-versions "$lib" 2>/dev/null |
          awk "\$2 ~ /@libcudnn[.]so[.]9\$/ { sub(/@.*/, \"\", \$2); print \$2 }"
      done | sort -u >symbols
      [[ -s symbols ]]
      { echo "/* made by scripts/check_platform.sh: cuDNN is absent; nothing calls this without a GPU */"
        while read -r s; do echo "int $s(void) { return 1; }"; done <symbols; } >stub.c
      echo "libcudnn.so.9 { global: *; };" >stub.map
      gcc -shared -fPIC -o libcudnn.so.9 stub.c -Wl,-soname,libcudnn.so.9 -Wl,--version-script=stub.map
      wc -l <symbols' 2>>"$ROOT/lt/logs/build.log"
  }

  # ---------------------------------------------------------------------------------------------------
  # 1. The root.

  mkdir -p "$ROOTS"
  exec 9>"$ROOTS/.$PLATFORM.lock"
  if ! flock -n 9; then
    log "another check of $PLATFORM is running; waiting for it"
    flock 9
  fi

  log "source tree: $SRC"
  log "root: $ROOT (Debian $SUITE, components: ${COMPONENTS[*]})"
  if [[ -f $MARKER ]]; then
    log "reusing the root (complete since $(cat "$MARKER"))"
  else
    if [[ -e $ROOT ]]; then
      log "$ROOT exists without its completion marker (an interrupted bootstrap): deleting it"
      remove_root
    fi
    if ! command -v debootstrap >/dev/null 2>&1; then
      log "installing debootstrap on the host"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null 2>&1 || {
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
      }
    fi
    log "bootstrapping Debian $SUITE (minbase) from $MIRROR"
    t=$SECONDS
    mkdir -p "$ROOT"
    comps="${COMPONENTS[*]}"
    debootstrap --variant=minbase --components="${comps// /,}" "$SUITE" "$ROOT" "$MIRROR" \
      >"$ROOTS/.$PLATFORM.debootstrap.log" 2>&1 ||
      die "debootstrap failed; last lines of $ROOTS/.$PLATFORM.debootstrap.log: $(tail -n 5 "$ROOTS/.$PLATFORM.debootstrap.log")"
    unmount_all || die "debootstrap left mounts under $ROOT"
    mkdir -p "$ROOT/lt/logs" "$ROOT/lt/ccache"
    mv "$ROOTS/.$PLATFORM.debootstrap.log" "$ROOT/lt/logs/debootstrap.log"
    date -u +%Y-%m-%dT%H:%M:%SZ >"$MARKER"
    log "bootstrapped in $((SECONDS - t)) s"
  fi
  mkdir -p "$ROOT/lt/logs" "$ROOT/lt/ccache"
  write_sources
  cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
  mount_root

  # ---------------------------------------------------------------------------------------------------
  # 2. Packages, only those missing.

  missing_packages() {
    local installed
    installed="$(in_root dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${PACKAGES[@]}" 2>/dev/null || true)"
    local p
    for p in "${PACKAGES[@]}"; do
      grep -qE "^$p ii " <<<"$installed" || echo "$p"
    done
  }

  install_packages() {
    local plog=/lt/logs/packages.log
    if [[ ! -f $ROOT/lt/.apt-updated ]]; then
      in_root apt-get update >>"$ROOT$plog" 2>&1 || die "apt-get update failed in the root (see $ROOT$plog)"
      touch "$ROOT/lt/.apt-updated"
    fi
    if in_root apt-get install -y --no-install-recommends "$@" >>"$ROOT$plog" 2>&1; then
      return 0
    fi
    # nvidia-cudnn's post-install script downloads cuDNN from NVIDIA, which cannot work here. For a
    # compile-and-link check it is replaced by one that does nothing; cuDNN then stays absent.
    local pi="$ROOT/var/lib/dpkg/info/nvidia-cudnn.postinst"
    if [[ -f $pi ]] && ! grep -q 'lora_trainer check_platform' "$pi"; then
      log "nvidia-cudnn's post-install script (a download from NVIDIA) failed: replacing it with one" \
          "that exits 0, so cuDNN itself stays absent (libcudnn.so.9 is not installed)"
      printf '#!/bin/sh\n# replaced by lora_trainer check_platform: no download\nexit 0\n' >"$pi"
      in_root dpkg --configure -a >>"$ROOT$plog" 2>&1 || die "dpkg --configure -a failed (see $ROOT$plog)"
      in_root apt-get install -y --no-install-recommends "$@" >>"$ROOT$plog" 2>&1 && return 0
    fi
    die "apt-get install failed in the root; last lines of $ROOT$plog:
  $(tail -n 15 "$ROOT$plog")"
  }

  mapfile -t missing < <(missing_packages)
  if ((${#missing[@]})); then
    log "installing in the root (${#missing[@]} missing): ${missing[*]}"
    t=$SECONDS
    install_packages "${missing[@]}"
    mapfile -t missing < <(missing_packages)
    ((${#missing[@]} == 0)) || die "still missing after apt-get install: ${missing[*]}"
    log "packages installed in $((SECONDS - t)) s"
  else
    log "all ${#PACKAGES[@]} packages present in the root"
  fi
  ver() { in_root dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo '?'; }
  if [[ $PLATFORM == debian13 ]]; then torch_pkg=libtorch-dev; else torch_pkg=libtorch-cuda-dev; fi
  log "versions: $torch_pkg $(ver "$torch_pkg"), libhdf5-dev $(ver libhdf5-dev), catch2 $(ver catch2)," \
      "libcli11-dev $(ver libcli11-dev), libutf8proc-dev $(ver libutf8proc-dev), g++ $(ver g++)," \
      "cmake $(ver cmake)$(
      [[ $PLATFORM == debian13-cuda ]] && echo ", nvidia-cuda-toolkit $(ver nvidia-cuda-toolkit), libnccl-dev $(ver libnccl-dev)")"

  # ---------------------------------------------------------------------------------------------------
  # 3. The sources. A file whose bytes are those of the previous copy keeps that copy's modification
  # time (so it does not rebuild); any other gets the current time. (Keeping the host's times would
  # miss an edit made on the host while an earlier check was building: the object is then newer.)

  t=$SECONDS
  if [[ ! -f $SRC/datasets/tokenizer/gpt2/encoder.json ]]; then
    log "the GPT-2 tokenizer files are missing on the host: datasets/fetch_tokenizer.sh"
  fi
  bash "$SRC/datasets/fetch_tokenizer.sh" >/dev/null || die "datasets/fetch_tokenizer.sh failed on the host"
  rm -rf --one-file-system "$ROOT/lt/src.new"
  mkdir -p "$ROOT/lt/src.new"
  git -C "$SRC" rev-parse --is-inside-work-tree >/dev/null 2>&1 || die "$SRC is not a git work tree"
  nfiles=$(
    cd "$SRC"
    git ls-files -co --exclude-standard -z |
      while IFS= read -r -d '' f; do [[ -e $f || -L $f ]] && printf '%s\0' "$f"; done >"$ROOT/lt/files.list"
    tr -cd '\0' <"$ROOT/lt/files.list" | wc -c
  )
  # The llama.cpp of the GGUF tests (scripts/fetch_llama_cpp.sh) where the host has it: prebuilt, it runs
  # on the root's Node.js too.
  extra=(datasets/tokenizer/gpt2)
  [[ -d $SRC/datasets/cache/llama_cpp/node_modules ]] && extra+=(datasets/cache/llama_cpp/node_modules)
  (cd "$SRC" && tar --null -T "$ROOT/lt/files.list" -cf - "${extra[@]}") | tar -xmf - -C "$ROOT/lt/src.new"
  nchanged=0
  while IFS= read -r -d '' f; do
    if [[ -f $ROOT/lt/src/$f && ! -L $ROOT/lt/src.new/$f ]] && cmp -s "$ROOT/lt/src/$f" "$ROOT/lt/src.new/$f"; then
      touch -r "$ROOT/lt/src/$f" "$ROOT/lt/src.new/$f"
    else
      nchanged=$((nchanged + 1))
    fi
  done <"$ROOT/lt/files.list"
  rm -rf --one-file-system "$ROOT/lt/src"
  mv "$ROOT/lt/src.new" "$ROOT/lt/src"
  in_root bash /lt/src/datasets/fetch_tokenizer.sh >/dev/null || die "the tokenizer files did not verify in the root"
  log "copied $nfiles files ($nchanged new or changed since the last check) + ${extra[*]}" \
      "to $ROOT/lt/src in $((SECONDS - t)) s"

  # ---------------------------------------------------------------------------------------------------
  # 4. Configure, build, test.

  t=$SECONDS
  log "configuring: cmake -S /lt/src -B /lt/build ${CMAKE_ARGS[*]}"
  in_root cmake -S /lt/src -B /lt/build "${CMAKE_ARGS[@]}" >"$ROOT/lt/logs/configure.log" 2>&1 || {
    tail -n 40 "$ROOT/lt/logs/configure.log"
    die "CMake configure failed (log: $ROOT/lt/logs/configure.log)"
  }
  if [[ $PLATFORM == debian13-cuda ]]; then
    grep -q 'LT_WITH_CUDA' "$ROOT/lt/build/build.ninja" ||
      die "CMake did not configure a CUDA build (TORCH_CUDA_LIBRARIES unset)"
    log "configured as a CUDA build (LT_WITH_CUDA$(grep -q LT_WITH_NCCL "$ROOT/lt/build/build.ninja" && echo ', LT_WITH_NCCL'))"
  fi
  log "configured in $((SECONDS - t)) s"

  t=$SECONDS
  in_root ccache -z >/dev/null 2>&1 || true
  log "building with $JOBS jobs (log: $ROOT/lt/logs/build.log)"
  build_ok=1
  in_root cmake --build /lt/build -j "$JOBS" >"$ROOT/lt/logs/build.log" 2>&1 || build_ok=0
  blog="$ROOT/lt/logs/build.log"
  nwarn=$(grep -c 'warning:' "$blog" || true)
  if ((nwarn)); then
    log "$nwarn compiler warnings; distinct ones (count, location, message):"
    grep -E '^[^ ]+:[0-9]+:[0-9]+: warning:' "$blog" | sed 's|^/lt/src/||' | sort | uniq -c | sort -rn | head -n 40
  fi
  if ((!build_ok)); then
    log "errors:"
    grep -E 'error:|undefined reference|FAILED:' "$blog" | sed 's|^/lt/src/||' | head -n 60
    die "the build failed after $((SECONDS - t)) s (log: $blog)"
  fi
  ccache_stats="$(in_root ccache -s 2>/dev/null | awk '/^ *Hits:/ && !h { h = $2 "/" $4 } /^ *Misses:/ && !m { m = $2 "/" $4 }
    END { if (h != "") print "ccache hits " h ", misses " m }')"
  log "built in $((SECONDS - t)) s${ccache_stats:+; $ccache_stats}"

  test_env=""
  stub_note=""
  if [[ $PLATFORM == debian13-cuda ]]; then
    # Without cuDNN (and without a GPU) the binaries may be unable to start at all: say exactly why.
    if ! out="$(in_root /lt/build/lora_trainer_tests --list-tests 2>&1)"; then
      reason="$(grep -m1 -E 'error while loading shared libraries|cannot open|undefined symbol' <<<"$out" || true)"
      [[ -n $reason ]] || reason="$(head -n 3 <<<"$out" | tr '\n' ' ')"
      notfound="$(in_root ldd /lt/build/lora_trainer_tests 2>/dev/null | awk '/not found/ { print $1 }' | sort -u | paste -sd ' ' || true)"
      log "the test binary cannot start: $reason"
      [[ -n $notfound ]] && log "libraries the dynamic loader cannot find: $notfound"
      only="compile-and-link only: ${notfound:+missing $notfound; }$reason"
      if [[ $notfound != libcudnn.so.9 || ${LT_CUDNN_STUB:-1} == 0 ]]; then
        log "$only"
        log "done in $((SECONDS - START)) s"
        exit 0
      fi
      # cuDNN is the one thing missing, and on a machine without a GPU it is never called: a stub
      # that exports the cuDNN functions the libraries import (each returning an error status),
      # under their symbol version, lets the binaries start, so the suite can run on the CPU.
      if ! nstub="$(make_cudnn_stub)" ||
         ! in_root env LD_LIBRARY_PATH=/lt/cudnn-stub /lt/build/lora_trainer_tests --list-tests >/dev/null 2>&1; then
        log "a stub libcudnn.so.9 did not make the binaries start either"
        log "$only"
        log "done in $((SECONDS - START)) s"
        exit 0
      fi
      log "with a stub libcudnn.so.9 (/lt/cudnn-stub: the $nstub cuDNN functions LibTorch imports, each" \
          "returning an error status; never called without a GPU) the binaries start: running the suite on the CPU"
      test_env="LD_LIBRARY_PATH=/lt/cudnn-stub"
      stub_note=" (CUDA LibTorch on the CPU, with the cuDNN stub; as installed: $only)"
    else
      log "the test binary starts (cuDNN present or not needed): running the suite"
    fi
  fi

  t=$SECONDS
  log "running the whole suite: ctest --output-on-failure -j $JOBS (log: $ROOT/lt/logs/test.log)"
  test_ok=1
  in_root sh -c "cd /lt/build && $test_env ctest --output-on-failure -j $JOBS" 2>&1 |
    tee "$ROOT/lt/logs/test.log" || test_ok=0
  summary="$(grep -E 'tests passed|tests failed' "$ROOT/lt/logs/test.log" | tail -n 1 || true)"
  ((test_ok)) || die "the suite failed after $((SECONDS - t)) s: ${summary:-no summary}"
  log "suite: ${summary:-no summary} in $((SECONDS - t)) s"
  log "OK: $PLATFORM built and passed in $((SECONDS - START)) s$stub_note"
}

main "$@"
