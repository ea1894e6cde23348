#!/usr/bin/env bash
# Build tempering's container image on this machine, without a registry.
#
#   docker/build.sh [--flavour cpu|gpu] [--target release|base] [--tag NAME] [--base IMAGE]
#
# CPU flavour (default): the base is a Debian bookworm root made here with debootstrap and
# imported with podman (localhost/tempering-debian-base:bookworm, made once). GPU flavour: pass
# --base with a CUDA image that has Python 3.11 (or lets uv install it). Builds with
# `buildah bud --isolation chroot` (podman/docker daemons are not needed), bind-mounting the
# local torch wheel folder named by pyproject.toml's torch-cpu index when it exists, and the
# host's CA bundle when it trusts extra CAs (read during the build only, never kept).
# Prints the build time and the image size. Installs buildah, podman and debootstrap with
# apt-get when they are missing and we are root.
#
# A registry-backed build on a workstation or in CI (Docker or Podman with a daemon) is plain:
#   docker build -f docker/Dockerfile --target release \
#     --build-arg BASE_IMAGE=<image with Python 3.11> --build-arg TORCH_GROUP=cpu|gpu \
#     -t REGISTRY/tempering:TAG . && docker push REGISTRY/tempering:TAG
set -euo pipefail
cd "$(dirname "$0")/.."

flavour=cpu target=release tag="" base=""
while [ $# -gt 0 ]; do
  case "$1" in
    --flavour) flavour="$2"; shift 2 ;;
    --target) target="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "docker/build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$flavour" in cpu|gpu) ;; *) echo "docker/build.sh: --flavour must be cpu or gpu, not '$flavour'" >&2; exit 2 ;; esac
case "$target" in release|base) ;; *) echo "docker/build.sh: --target must be release or base, not '$target'" >&2; exit 2 ;; esac
tag="${tag:-localhost/tempering:$target-$flavour}"

missing=""
for tool in buildah podman debootstrap; do command -v "$tool" >/dev/null || missing="$missing $tool"; done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "docker/build.sh: installing$missing"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  else
    echo "docker/build.sh: needs$missing; install them (Debian/Ubuntu: sudo apt-get install$missing)" >&2
    exit 2
  fi
fi

if [ -z "$base" ]; then
  if [ "$flavour" = gpu ]; then
    echo "docker/build.sh: the gpu flavour needs --base <a CUDA image with Python 3.11>" >&2
    exit 2
  fi
  base=localhost/tempering-debian-base:bookworm
  if ! podman image exists "$base"; then
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    echo "docker/build.sh: making $base with debootstrap"
    debootstrap --variant=minbase bookworm "$root/rootfs" http://deb.debian.org/debian >/dev/null
    tar -C "$root/rootfs" -c . | podman import -q - "$base" >/dev/null
    rm -rf "$root"; trap - EXIT
  fi
fi

mounts=()
wheels=$(python3 - <<'PY'
import re, pathlib
text = pathlib.Path("pyproject.toml").read_text()
m = re.search(r'name = "torch-cpu"\s*\nurl = "([^"]+)"', text)
print(m.group(1) if m and m.group(1).startswith("/") else "")
PY
)
[ -n "$wheels" ] && [ -d "$wheels" ] && mounts+=(-v "$wheels:$wheels:ro")
ca_args=()
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1 && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  mounts+=(-v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro)
  ca_args=(--build-arg CA_BUNDLE=/run/host-ca.crt)
fi

start=$(date +%s)
buildah bud --isolation chroot --network host --layers \
  -f docker/Dockerfile --target "$target" \
  --build-arg BASE_IMAGE="$base" --build-arg TORCH_GROUP="$flavour" "${ca_args[@]}" \
  "${mounts[@]}" -t "$tag" .
took=$(( $(date +%s) - start ))
size=$(podman image inspect --format '{{.Size}}' "$tag")
echo "docker/build.sh: built $tag in ${took} s; size $(( size / 1000000 )) MB"
echo "docker/build.sh: run a command in it: buildah run --isolation chroot \$(buildah from $tag) -- uv run examples/run_grpo_math.py"
