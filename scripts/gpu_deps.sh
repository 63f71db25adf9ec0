#!/usr/bin/env bash
# Downloads (here, on the Debian 12 machine) the Debian .deb files that the build on a CUDA host needs
# and that such a host has no package registry for: HDF5 (headers, the C and C++ libraries and the
# libraries they load), nlohmann-json, CLI11, Catch2 2, PCRE2, utf8proc, the gloo headers c10d's
# ProcessGroupGloo.hpp includes (used only when the PyTorch package ships none) and pkgconf.
# They land in .gpu/debs/ (ignored by git); scripts/gpu_check.sh unpacks them on the CUDA host into
# .gpu/prefix with `dpkg -x` (never into /). Carry `.gpu` to that host.
#
# Nothing is installed here. Packages every Linux system has (libc6, libgcc-s1, libstdc++6, zlib1g)
# are left out; the runtime libraries HDF5 loads (libcurl4, libssl3, Kerberos, LDAP, GnuTLS, ...)
# come along, and gpu_check.sh uses each only where the host lacks a library of that soname.
# Idempotent: a .deb already present at the candidate version is not fetched again; older versions
# and packages no longer on the list are removed.
# Usage: scripts/gpu_deps.sh [DEST_DIR]   (default: .gpu/debs in the repository)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/.gpu/debs}"
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"

# Development packages: their headers, CMake/pkg-config files and .so links. Taken without their
# Depends (libhdf5-dev would pull Fortran, libjpeg-dev, libssl-dev, ...: none of them used here).
DEV=(libhdf5-dev zlib1g-dev nlohmann-json3-dev libcli11-dev catch2 libpcre2-dev libutf8proc-dev libgloo-dev)
# Runtime libraries and tools, taken with the closure of their Depends.
RUNTIME=(libhdf5-103-1 libhdf5-cpp-103-1 libpcre2-8-0 libutf8proc2 pkgconf pkgconf-bin libpkgconf3)
# In every base system (and ABI-bound to the host's compiler and C library): never brought.
EXCLUDE=(libc6 libgcc-s1 libstdc++6 gcc-12-base zlib1g libcrypt1 debconf perl-base dpkg)

if ! apt-cache show --no-all-versions libhdf5-dev >/dev/null 2>&1; then
  echo "gpu_deps: the package lists know no libhdf5-dev; running apt-get update" >&2
  apt-get update -q
fi

mapfile -t closure < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
                         --no-replaces --no-enhances "${RUNTIME[@]}" | grep -v '^[ <]' | sort -u)
declare -A skip=()
for p in "${EXCLUDE[@]}"; do skip[$p]=1; done
want=()
for p in "${DEV[@]}" "${closure[@]}"; do
  [[ -n "${skip[$p]:-}" ]] && continue
  skip[$p]=1  # also dedupes
  want+=("$p")
done

# The file name `apt-get download` gives a package: NAME_VERSION_ARCH.deb, an epoch's ':' as %3a.
declare -A keep=()
fetch=()
for p in "${want[@]}"; do
  read -r ver arch < <(apt-cache show --no-all-versions "$p" | awk '/^Version:/{v=$2} /^Architecture:/{a=$2} END{print v, a}')
  if [[ -z "$ver" ]]; then
    echo "gpu_deps: no candidate version for $p" >&2
    exit 1
  fi
  f="${p}_${ver//:/%3a}_${arch}.deb"
  keep[$f]=1
  [[ -s "$DEST/$f" ]] || fetch+=("$p")
done

for f in "$DEST"/*.deb; do
  [[ -e "$f" ]] || continue
  if [[ -z "${keep[$(basename "$f")]:-}" ]]; then
    echo "gpu_deps: removing $(basename "$f") (not on the list, or an older version)"
    rm -f "$f"
  fi
done

if ((${#fetch[@]})); then
  echo "gpu_deps: downloading ${#fetch[@]} package(s): ${fetch[*]}"
  # apt-get download writes into the current directory (as root it would otherwise try the _apt user).
  sandbox=()
  [[ $(id -u) -ne 0 ]] || sandbox=(-o APT::Sandbox::User=root)
  (cd "$DEST" && apt-get download -q "${sandbox[@]}" "${fetch[@]}")
fi

printf '%s\n' "${want[@]}" | sort > "$DEST/PACKAGES"
n=$(find "$DEST" -maxdepth 1 -name '*.deb' | wc -l)
echo "gpu_deps: $n .deb files in $DEST, $(du -sh "$DEST" | cut -f1) in all (list: $DEST/PACKAGES)"
if ((n != ${#want[@]})); then
  echo "gpu_deps: expected ${#want[@]} files" >&2
  exit 1
fi
