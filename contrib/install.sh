#!/bin/sh
# modelrelay installer: installs a release tarball made by `make dist`; it never downloads.
#
#   sh install.sh [options] [TARBALL | DIR]
#
# DIR (default: the directory this script is in) holds the tarballs and SHA256SUMS; the
# tarball for this machine is picked by `uname -m` (x86_64, aarch64, armv7). The tarball's
# SHA-256 must match its SHA256SUMS line (next to the tarball), or nothing is installed.
# Then: binaries in PREFIX/bin, man pages in PREFIX/share/man/man8, examples in
# PREFIX/share/doc/modelrelay, the service files (systemd units in PREFIX/lib/systemd/system
# and /etc/modelrelay/server.env; or on OpenWrt the procd scripts in /etc/init.d and
# /etc/config/modelrelay), the system user `modelrelay` and its state directory
# /var/lib/modelrelay (mode 750). Existing configuration files are never overwritten, so
# running it again (an upgrade) changes only what the new tarball changes.
#
# Options:
#   --prefix DIR      install under DIR (default /usr/local; /usr on OpenWrt)
#   --destdir DIR     write every file under DIR instead of / (packaging, tests); the user
#                     is still created on this machine unless --no-user
#   --arch ARCH       machine architecture instead of `uname -m`
#   --variant NAME    pick the NAME build (minimal, notls, minimal+notls, server-tls) instead of the default one
#   --init KIND       systemd, openwrt or none (default: openwrt when /etc/openwrt_release
#                     exists, otherwise systemd)
#   --user NAME       system user (default modelrelay); --no-user to create none
#   --state-dir DIR   state directory (default /var/lib/modelrelay)
#
# The systemd units keep DynamicUser=yes (systemd runs them as a transient user with its
# own StateDirectory); the static user and /var/lib/modelrelay serve procd, OpenRC,
# containers and hand-started runs.
set -eu

prefix=
destdir=
arch=
variant=
init=auto
user=modelrelay
create_user=yes
state_dir=/var/lib/modelrelay
source=

die() {
	echo "install.sh: $*" >&2
	exit 1
}
say() { echo "  $*"; }

while [ $# -gt 0 ]; do
	case $1 in
	--prefix) prefix=${2:?--prefix DIR}; shift 2 ;;
	--destdir) destdir=${2:?--destdir DIR}; shift 2 ;;
	--arch) arch=${2:?--arch ARCH}; shift 2 ;;
	--variant) variant=${2:?--variant NAME}; shift 2 ;;
	--init) init=${2:?--init systemd|openwrt|none}; shift 2 ;;
	--user) user=${2:?--user NAME}; shift 2 ;;
	--no-user) create_user=no; shift ;;
	--state-dir) state_dir=${2:?--state-dir DIR}; shift 2 ;;
	-h | --help) sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
	-*) die "unknown option $1 (see --help)" ;;
	*) [ -z "$source" ] || die "one tarball or directory, please"; source=$1; shift ;;
	esac
done

destdir=${destdir%/}
if [ -z "$destdir" ] && [ "$(id -u)" != 0 ]; then
	die "run as root (or stage the files with --destdir DIR)"
fi
case $init in
auto) if [ -f "$destdir/etc/openwrt_release" ]; then init=openwrt; else init=systemd; fi ;;
systemd | openwrt | none) ;;
*) die "--init must be systemd, openwrt or none" ;;
esac
if [ -z "$prefix" ]; then
	if [ "$init" = openwrt ]; then prefix=/usr; else prefix=/usr/local; fi
fi
prefix=${prefix%/}

# ---- which tarball ----
[ -n "$arch" ] || arch=$(uname -m)
case $arch in
x86_64 | amd64) triple=x86_64-unknown-linux-musl ;;
aarch64 | arm64) triple=aarch64-unknown-linux-musl ;;
armv7* | armv8l | armhf) triple=armv7-unknown-linux-musleabihf ;;
*) die "no build for machine architecture '$arch' (x86_64, aarch64 and armv7 are built; older ARM such as armv6 is not)" ;;
esac
suffix=$triple${variant:+-$variant}

[ -n "$source" ] || source=$(dirname "$0")
if [ -d "$source" ]; then
	tarball=
	for f in "$source"/modelrelay-*-"$suffix".tar.gz; do
		[ -e "$f" ] || continue
		[ -z "$tarball" ] || die "several tarballs for $suffix in $source: name the one to install"
		tarball=$f
	done
	[ -n "$tarball" ] || die "no modelrelay-*-$suffix.tar.gz in $source (this machine is $arch)"
else
	tarball=$source
	[ -f "$tarball" ] || die "$tarball: no such file"
	case $(basename "$tarball") in
	modelrelay-*-"$suffix".tar.gz) ;;
	*) die "$(basename "$tarball") is not the $suffix build this machine ($arch) needs (--arch to override)" ;;
	esac
fi
name=$(basename "$tarball" .tar.gz)

# ---- checksum ----
sums=$(dirname "$tarball")/SHA256SUMS
[ -f "$sums" ] || die "no SHA256SUMS next to $tarball: refusing to install an unverified tarball"
expected=$(awk -v n="$name.tar.gz" '$2 == n || $2 == "*" n { print $1; exit }' "$sums")
[ -n "$expected" ] || die "$name.tar.gz is not listed in $sums"
if command -v sha256sum >/dev/null 2>&1; then
	actual=$(sha256sum "$tarball" | awk '{ print $1 }')
elif command -v shasum >/dev/null 2>&1; then
	actual=$(shasum -a 256 "$tarball" | awk '{ print $1 }')
elif command -v openssl >/dev/null 2>&1; then
	actual=$(openssl dgst -sha256 -r "$tarball" | awk '{ print $1 }')
else
	die "need sha256sum, shasum or openssl to verify the tarball"
fi
[ "$actual" = "$expected" ] || die "checksum mismatch for $name.tar.gz (expected $expected, got $actual): not installing"
echo "modelrelay: installing $name.tar.gz (sha256 ok) into ${destdir:-/}, prefix $prefix, init $init"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xzf "$tarball" -C "$work"
pkg=$work/$name
[ -d "$pkg/bin" ] || die "$name.tar.gz does not hold $name/bin"

# Copies $1 to $2 with mode $3 through a temporary file and a rename (a running binary is
# replaced, not overwritten), and says whether anything changed.
put() {
	mkdir -p "$(dirname "$2")"
	if [ -f "$2" ] && cmp -s "$1" "$2"; then
		chmod "$3" "$2"
		say "unchanged  $2"
		return 0
	fi
	cp "$1" "$2.new.$$"
	chmod "$3" "$2.new.$$"
	mv -f "$2.new.$$" "$2"
	say "installed  $2"
}
# Like put, but keeps an existing file (configuration).
put_config() {
	if [ -e "$2" ]; then
		say "kept       $2 (exists)"
	else
		put "$1" "$2" "$3"
	fi
}
# $1 with /usr/local/bin and /usr/bin replaced by PREFIX/bin, into $2.
put_with_prefix() {
	sed -e "s|/usr/local/bin/|$prefix/bin/|g" -e "s|^PROG=/usr/bin/|PROG=$prefix/bin/|" "$1" >"$work/edited"
	put "$work/edited" "$2" "$3"
}

for b in "$pkg"/bin/*; do
	put "$b" "$destdir$prefix/bin/$(basename "$b")" 755
done
for m in "$pkg"/man/*.8; do
	[ -f "$m" ] && put "$m" "$destdir$prefix/share/man/man8/$(basename "$m")" 644
done
for e in "$pkg"/examples/* "$pkg"/docs/*.md "$pkg"/README.md "$pkg"/LICENSE; do
	[ -f "$e" ] || continue
	case $e in
	*/examples/*) put "$e" "$destdir$prefix/share/doc/modelrelay/examples/$(basename "$e")" 644 ;;
	*/docs/*) put "$e" "$destdir$prefix/share/doc/modelrelay/docs/$(basename "$e")" 644 ;;
	*) put "$e" "$destdir$prefix/share/doc/modelrelay/$(basename "$e")" 644 ;;
	esac
done

case $init in
systemd)
	for u in "$pkg"/systemd/*.service; do
		put_with_prefix "$u" "$destdir$prefix/lib/systemd/system/$(basename "$u")" 644
	done
	mkdir -p "$destdir/etc/modelrelay"
	chmod 755 "$destdir/etc/modelrelay"
	put_config "$pkg/systemd/server.env.example" "$destdir/etc/modelrelay/server.env" 600
	;;
openwrt)
	put_with_prefix "$pkg/openwrt/modelrelay-server.init" "$destdir/etc/init.d/modelrelay-server" 755
	put_with_prefix "$pkg/openwrt/modelrelay-worker.init" "$destdir/etc/init.d/modelrelay-worker" 755
	put_config "$pkg/openwrt/modelrelay.config" "$destdir/etc/config/modelrelay" 600
	;;
esac

# ---- system user and state directory ----
user_exists() {
	if command -v getent >/dev/null 2>&1; then
		getent passwd "$1" >/dev/null 2>&1
	else
		grep -q "^$1:" /etc/passwd
	fi
}
nologin=/bin/false
for n in /usr/sbin/nologin /sbin/nologin; do
	if [ -x "$n" ]; then
		nologin=$n
		break
	fi
done
owner=
if [ "$create_user" = yes ]; then
	if user_exists "$user"; then
		say "exists     user $user"
	elif command -v useradd >/dev/null 2>&1; then
		useradd --system --user-group --no-create-home --home-dir "$state_dir" --shell "$nologin" "$user"
		say "created    user $user"
	elif command -v adduser >/dev/null 2>&1; then
		# BusyBox / Alpine
		addgroup -S "$user" 2>/dev/null || true
		adduser -S -D -H -h "$state_dir" -s "$nologin" -G "$user" "$user"
		say "created    user $user"
	else
		echo "install.sh: no useradd or adduser here: create a '$user' user yourself" >&2
	fi
	user_exists "$user" && owner=$user
fi
if [ -d "$destdir$state_dir" ]; then say "exists     $destdir$state_dir"; else say "created    $destdir$state_dir"; fi
mkdir -p "$destdir$state_dir"
chmod 750 "$destdir$state_dir"
[ -z "$owner" ] || chown "$owner:" "$destdir$state_dir"

echo "modelrelay: done. Next:"
case $init in
systemd)
	echo "  edit /etc/modelrelay/server.env, then: systemctl daemon-reload && systemctl enable --now modelrelay-server"
	echo "  per backend: cp $prefix/share/doc/modelrelay/examples/worker.env.example /etc/modelrelay/worker-NAME.env,"
	echo "  edit it, then: systemctl enable --now modelrelay-worker@NAME"
	;;
openwrt)
	echo "  edit /etc/config/modelrelay (enabled, worker_secret), then:"
	echo "  /etc/init.d/modelrelay-server enable && /etc/init.d/modelrelay-server start (same for modelrelay-worker)"
	;;
none) echo "  run $prefix/bin/modelrelay-server --help and $prefix/bin/modelrelay-worker --help" ;;
esac
