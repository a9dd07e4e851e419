#!/usr/bin/env bash
# contrib/dist.sh [--out DIR] [--variant NAME] [--bin-dir DIR] TARGET...
# Packs release tarballs (`make dist` builds the binaries first, then runs this):
#   DIR/modelrelay-VERSION-TARGET[-VARIANT].tar.gz, one per target, holding
#     modelrelay-VERSION-TARGET[-VARIANT]/bin/        modelrelay-server, modelrelay-worker
#                                                       (Windows: modelrelay-worker.exe)
#                                         man/        modelrelay-server.8, modelrelay-worker.8
#                                         systemd/    units and example environment files
#                                         openwrt/    procd init scripts, /etc/config/modelrelay
#                                         examples/   server.env.example, worker.env.example
#                                         docs/       the guides (docs/*.md)
#                                         README.md, LICENSE
#   DIR/install.sh (contrib/install.sh) and DIR/SHA256SUMS over every tarball in DIR and
#   install.sh.
# Binaries come from target/TARGET/release/, or DIR/TARGET/ with --bin-dir. Tarballs are
# reproducible: sorted, owner 0, mtime of the last commit, gzip without a timestamp.
set -euo pipefail
cd "$(dirname "$0")/.."

out=dist
variant=
bin_dir=
targets=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=${2:?--out DIR}; shift 2 ;;
    --variant) variant=${2:?--variant NAME}; shift 2 ;;
    --bin-dir) bin_dir=${2:?--bin-dir DIR}; shift 2 ;;
    -h | --help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "contrib/dist.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || { echo "usage: contrib/dist.sh [--out DIR] [--variant NAME] [--bin-dir DIR] TARGET..." >&2; exit 2; }

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
mkdir -p "$out"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

for t in "${targets[@]}"; do
  name=modelrelay-$version-$t${variant:+-$variant}
  root=$stage/$name
  src=${bin_dir:+$bin_dir/$t}
  src=${src:-target/$t/release}
  mkdir -p "$root/bin" "$root/man" "$root/examples"
  if [[ $t == *windows* ]]; then
    bins=(modelrelay-worker.exe)
  else
    bins=(modelrelay-server modelrelay-worker)
    mkdir -p "$root/systemd" "$root/openwrt"
    cp contrib/systemd/*.service "$root/systemd/"
    cp contrib/systemd/*.env.example "$root/systemd/"
    cp contrib/openwrt/modelrelay-server.init contrib/openwrt/modelrelay-worker.init \
      contrib/openwrt/modelrelay.config "$root/openwrt/"
  fi
  for b in "${bins[@]}"; do
    [ -f "$src/$b" ] || { echo "contrib/dist.sh: missing $src/$b (make static TARGET=$t)" >&2; exit 1; }
    install -m 755 "$src/$b" "$root/bin/$b"
  done
  cp man/modelrelay-server.8 man/modelrelay-worker.8 "$root/man/"
  cp contrib/systemd/server.env.example contrib/systemd/worker.env.example "$root/examples/"
  mkdir -p "$root/docs"
  cp docs/*.md "$root/docs/"
  cp README.md LICENSE "$root/"
  chmod -R u=rwX,go=rX "$root"
  tar -C "$stage" --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$epoch" -cf - "$name" |
    gzip -n -9 >"$out/$name.tar.gz"
  printf '%-60s %9d bytes\n' "$out/$name.tar.gz" "$(stat -c %s "$out/$name.tar.gz")"
done

install -m 755 contrib/install.sh "$out/install.sh"
(cd "$out" && sha256sum -- *.tar.gz install.sh >SHA256SUMS)
echo "$out/SHA256SUMS"
