#!/bin/sh
# The sandbox's PID 1 until it execs systemd (tools/sandbox.py runs it under unshare in new pid,
# mount, net, uts, ipc and cgroup namespaces). $1 is an empty directory on the host that becomes
# the tmpfs holding the overlay's upper layer; $2 the hostname; the rest are units to mask. Every
# mount below exists only in the sandbox's mount namespace.
set -eu
mnt=$1; hostname=$2; shift 2
mount -t tmpfs -o mode=0755 gpud-sandbox "$mnt"
mkdir "$mnt/upper" "$mnt/work" "$mnt/root"
mount -t overlay -o "lowerdir=/,upperdir=$mnt/upper,workdir=$mnt/work" gpud-sandbox "$mnt/root"
r=$mnt/root
mount -t proc -o nosuid,nodev,noexec proc "$r/proc"
for p in sys sysrq-trigger; do
    [ -e "$r/proc/$p" ] || continue
    mount --bind "$r/proc/$p" "$r/proc/$p"
    mount -o remount,bind,ro "$r/proc/$p"
done
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$r/sys"
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$r/sys/fs/cgroup"
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$r/run"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$r/tmp"
mount -t tmpfs -o mode=0755,nosuid,size=4m tmpfs "$r/dev"
for n in null:1:3 zero:1:5 full:1:7 random:1:8 urandom:1:9 tty:5:0; do
    IFS=: read -r name major minor <<EOF
$n
EOF
    mknod -m 0666 "$r/dev/$name" c "$major" "$minor"
done
mkdir -m 0755 "$r/dev/pts"
mkdir -m 1777 "$r/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620,gid=5 devpts "$r/dev/pts"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$r/dev/shm"
ln -s pts/ptmx "$r/dev/ptmx"
ln -s /proc/self/fd "$r/dev/fd"
ln -s /proc/self/fd/0 "$r/dev/stdin"
ln -s /proc/self/fd/1 "$r/dev/stdout"
ln -s /proc/self/fd/2 "$r/dev/stderr"
for d in /dev/nvidia*; do
    [ -e "$d" ] || continue
    if [ -d "$d" ]; then mkdir -p "$r$d"; else touch "$r$d"; fi
    mount --rbind "$d" "$r$d"
done
# Host directories the overlay cannot show (under /tmp or /run, which are fresh here, or on
# another file system): bound at the same path, e.g. a repository checked out under /tmp.
printf '%s\n' "${GPUD_SANDBOX_BINDS:-}" | while IFS= read -r b; do
    [ -n "$b" ] || continue
    mkdir -p "$r$b"
    mount --rbind "$b" "$r$b"
done
unset GPUD_SANDBOX_BINDS
# Files laid over the root as if the host had them (Sandbox(root_files=...)): only the overlay's
# upper layer is written. The directories that exist keep their modes and owners (a 0700 temporary
# directory copied onto / would lock every service user out).
if [ -n "${GPUD_SANDBOX_ROOT_FILES:-}" ]; then
    tar -C "$GPUD_SANDBOX_ROOT_FILES" -cf - . | tar -C "$r" -xf - --no-overwrite-dir
fi
unset GPUD_SANDBOX_ROOT_FILES
for u in "$@"; do ln -sfn /dev/null "$r/etc/systemd/system/$u"; done
mkdir -p "$r/etc/systemd/journald.conf.d"
printf '[Journal]\nStorage=volatile\n' > "$r/etc/systemd/journald.conf.d/gpud-sandbox.conf"
printf '%s\n' "$hostname" > "$r/etc/hostname"
hostname "$hostname"
cd "$r"
pivot_root . .
umount -l .
cd /
exec /lib/systemd/systemd --system --unit=multi-user.target
