#!/usr/bin/env bash
# Install llama-gateway as a systemd service. Idempotent: run it again to upgrade.
#
#   sudo deploy/install.sh               install or upgrade, enable the unit (not started)
#   sudo deploy/install.sh --start       ... and (re)start it
#   sudo deploy/install.sh --no-build    ... without building llama-server now; it prints the
#                                        command to build it (as the service user) before the
#                                        first start, where a long build would pass TimeoutStartSec
#   sudo deploy/install.sh --uninstall   stop and disable the unit; remove it, $PREFIX/venv and
#                                        $PREFIX/README.md (and $PREFIX if then empty); keep
#                                        the config, cache and state
#   sudo deploy/install.sh --uninstall --purge
#                                        ... also $CONF_DIR's gateway.yaml and llama-gateway.env
#                                        (and $CONF_DIR if then empty), $CACHE_DIR and $STATE_DIR
#                                        when named llama-gateway, and the user llama-gateway
#
# What it does: a system user `llama-gateway` (groups video/render when present), a venv under
# /opt/llama-gateway/venv with this checkout installed, /etc/llama-gateway/gateway.yaml (from
# ./gateway.yaml, never overwritten; 0640 root:<service group>, it may hold admin.token) and
# llama-gateway.env (the same), the cache /var/cache/llama-gateway and state /var/lib/llama-gateway
# (owned by the service user), the config checked as the service user, the llama-server build
# in the cache (as the service user), and the unit in /etc/systemd/system.
#
# Overrides (environment), for packaging:
#   PREFIX=/opt/llama-gateway  CONF_DIR=/etc/llama-gateway  CACHE_DIR=/var/cache/llama-gateway
#   STATE_DIR=/var/lib/llama-gateway  UNIT_DIR=/etc/systemd/system  SERVICE_USER=llama-gateway
#   SYSTEMCTL=systemctl  PYTHON=python3 (the interpreter of the venv: the service user must be
#   able to run it, and it must not live under /root, /home or /run/user, which the unit's
#   ProtectHome=yes hides; with pyenv or similar as root's python3, use PYTHON=/usr/bin/python3)
set -euo pipefail
umask 022  # what it makes must be readable by the service user whatever root's umask

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${PREFIX:-/opt/llama-gateway}"
CONF_DIR="${CONF_DIR:-/etc/llama-gateway}"
CACHE_DIR="${CACHE_DIR:-/var/cache/llama-gateway}"
STATE_DIR="${STATE_DIR:-/var/lib/llama-gateway}"
UNIT_DIR="${UNIT_DIR:-/etc/systemd/system}"
SERVICE_USER="${SERVICE_USER:-llama-gateway}"
SYSTEMCTL="${SYSTEMCTL:-systemctl}"
PYTHON="${PYTHON:-python3}"
UNIT=llama-gateway.service

usage() {  # the comment block above, from line 2 to the first line that is not a comment
  awk 'NR == 1 { next } !/^#/ { exit } { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"
}

start=0 uninstall=0 purge=0 build=1
for a in "$@"; do
  case "$a" in
    --start) start=1 ;;
    --uninstall) uninstall=1 ;;
    --purge) purge=1 ;;
    --no-build) build=0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option $a" >&2; exit 2 ;;
  esac
done
if [ "$purge" = 1 ] && [ "$uninstall" = 0 ]; then
  echo "install.sh: --purge goes with --uninstall" >&2; exit 2
fi

say() { echo "install.sh: $*"; }
die() { echo "install.sh: $*" >&2; exit 1; }
esc() { sed 's/[#&\\]/\\&/g' <<<"$1"; }  # for the right side of a sed s###
[ "$(id -u)" = 0 ] || die "run as root"

# Paths the unit's ProtectHome=yes makes invisible to the service.
hidden_by_protecthome() {
  case "$1" in
    /root|/root/*|/home|/home/*|/run/user|/run/user/*) return 0 ;;
  esac
  return 1
}

if [ "$uninstall" = 1 ]; then
  # Remove only what this script put there: PREFIX, CONF_DIR, CACHE_DIR and STATE_DIR may be
  # shared directories (PREFIX=/usr/local) holding other things.
  rm_file() { if [ -e "$1" ] || [ -L "$1" ]; then rm -f -- "$1"; say "removed $1"; fi; }
  rm_dir_if_empty() {
    if [ -d "$1" ]; then
      if rmdir -- "$1" 2>/dev/null; then say "removed $1"; else say "kept $1 (not empty)"; fi
    fi
  }
  if [ -f "$UNIT_DIR/$UNIT" ]; then
    $SYSTEMCTL disable --now "$UNIT" || true
    rm -f "$UNIT_DIR/$UNIT"
    $SYSTEMCTL daemon-reload || true
    say "removed $UNIT_DIR/$UNIT"
  fi
  if [ -d "$PREFIX/venv" ]; then
    if [ -f "$PREFIX/venv/pyvenv.cfg" ]; then
      rm -rf -- "$PREFIX/venv"; say "removed $PREFIX/venv"
    else
      say "kept $PREFIX/venv (not a venv: no pyvenv.cfg)"
    fi
  fi
  rm_file "$PREFIX/README.md"
  rm_dir_if_empty "$PREFIX"
  if [ "$purge" = 1 ]; then
    rm_file "$CONF_DIR/gateway.yaml"
    rm_file "$CONF_DIR/llama-gateway.env"
    rm_dir_if_empty "$CONF_DIR"
    for d in "$CACHE_DIR" "$STATE_DIR"; do
      [ -e "$d" ] || continue
      if [ "$(basename -- "$d")" = llama-gateway ]; then
        rm -rf -- "$d"; say "removed $d"
      else
        say "kept $d (not named llama-gateway, so maybe not only the service's; remove it yourself)"
      fi
    done
    if [ "$SERVICE_USER" = llama-gateway ] && id "$SERVICE_USER" >/dev/null 2>&1; then
      userdel "$SERVICE_USER" && say "removed user $SERVICE_USER"
    fi
  else
    say "kept $CONF_DIR, $CACHE_DIR and $STATE_DIR (add --purge to remove them)"
  fi
  exit 0
fi

# Before anything is made: paths the service could not see, a python it could not run.
for d in "$PREFIX" "$CONF_DIR" "$CACHE_DIR" "$STATE_DIR"; do
  if hidden_by_protecthome "$d"; then
    die "$d is under /root, /home or /run/user, which the unit's ProtectHome=yes hides from the service"
  fi
done
# py_id PY: its version and its base interpreter (what a venv made from it runs), resolved.
py_id() {
  "$1" -c 'import os, sys
print("%d.%d" % sys.version_info[:2])
print(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))' 2>/dev/null
}
fix="set PYTHON=/usr/bin/python3 (or another system python the service user can run)"
py_path="$(command -v -- "$PYTHON")" || die "PYTHON=$PYTHON not found; $fix"
want="$(py_id "$PYTHON")" || die "cannot run PYTHON=$PYTHON; $fix"
for p in "$py_path" "$(readlink -f -- "$py_path")" "$(sed -n 2p <<<"$want")"; do
  if hidden_by_protecthome "$p"; then
    die "PYTHON=$PYTHON is $p, under /root, /home or /run/user (hidden from the service by ProtectHome=yes); $fix"
  fi
done

# 1. the service user
if ! id "$SERVICE_USER" >/dev/null 2>&1; then
  useradd --system --home-dir "$STATE_DIR" --no-create-home --shell /usr/sbin/nologin "$SERVICE_USER"
  say "created user $SERVICE_USER"
fi
for g in video render; do
  if getent group "$g" >/dev/null && ! id -nG "$SERVICE_USER" | grep -qw "$g"; then
    usermod -aG "$g" "$SERVICE_USER"
  fi
done
GROUP="$(id -gn "$SERVICE_USER")"
as_service() { (cd / && runuser -u "$SERVICE_USER" -- "$@"); }

# 2. the venv (upgrade in place), from a python the service user can run; an existing venv
# that user cannot run (made from root's python under /root), or of another python than
# PYTHON (the system python upgraded under it), is made again
if ! as_service "$py_path" -c 'import sys, venv' >/dev/null 2>&1; then
  die "the service user $SERVICE_USER cannot run PYTHON=$PYTHON ($py_path); $fix"
fi
mkdir -p "$PREFIX"
if [ -e "$PREFIX/venv" ]; then
  why=""
  if ! as_service "$PREFIX/venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
    why="$SERVICE_USER cannot run its python"
  elif [ "$(py_id "$PREFIX/venv/bin/python" || true)" != "$want" ]; then
    why="its python is not PYTHON=$PYTHON's ($(tr '\n' ' ' <<<"$want")"
    why="${why% })"
  fi
  if [ -n "$why" ]; then
    [ -f "$PREFIX/venv/pyvenv.cfg" ] || die "$PREFIX/venv is unusable ($why) and not a venv; move it away"
    say "recreating $PREFIX/venv: $why"
    rm -rf -- "$PREFIX/venv"
  fi
fi
[ -e "$PREFIX/venv" ] || "$PYTHON" -m venv "$PREFIX/venv"
"$PREFIX/venv/bin/python" -m pip install -q --upgrade pip
"$PREFIX/venv/bin/python" -m pip install -q --upgrade "$SRC"
cp -f "$SRC/README.md" "$PREFIX/"  # the unit's Documentation=
version="$(as_service "$PREFIX/venv/bin/llama-gateway" --version)" \
  || die "the service user $SERVICE_USER cannot run $PREFIX/venv/bin/llama-gateway (can it reach $PREFIX?)"
say "installed $version into $PREFIX/venv"

# 3. config and environment (never overwrite an operator's files, nor change their modes);
# both may hold the admin token: 0640 root:<service group>
install -d -m 0755 "$CONF_DIR"
tmp="$(mktemp)"
trap 'rm -f "$tmp"' EXIT
if [ ! -f "$CONF_DIR/gateway.yaml" ]; then
  sed 's/^listen: .*/listen: "127.0.0.1:11434"/' "$SRC/gateway.yaml" > "$tmp"
  install -m 0640 -o root -g "$GROUP" "$tmp" "$CONF_DIR/gateway.yaml"
  say "wrote $CONF_DIR/gateway.yaml"
fi
if [ ! -f "$CONF_DIR/llama-gateway.env" ]; then
  sed "s#^LLAMA_GATEWAY_CACHE=.*#LLAMA_GATEWAY_CACHE=$(esc "$CACHE_DIR")#" "$SRC/deploy/llama-gateway.env" > "$tmp"
  install -m 0640 -o root -g "$GROUP" "$tmp" "$CONF_DIR/llama-gateway.env"
  say "wrote $CONF_DIR/llama-gateway.env"
fi

# 4. cache and state, owned by the service user
install -d -o "$SERVICE_USER" -g "$GROUP" -m 0750 "$CACHE_DIR" "$STATE_DIR"

# 5. the config checked as the service will read it: as its user, with its cache (a model file
# the service cannot read fails here, not at the first start)
if ! out="$(as_service env LLAMA_GATEWAY_CACHE="$CACHE_DIR" \
            "$PREFIX/venv/bin/llama-gateway" check-config -c "$CONF_DIR/gateway.yaml" 2>&1)"; then
  printf '%s\n' "$out" >&2
  die "$CONF_DIR/gateway.yaml does not pass check-config as $SERVICE_USER (above); fix it and run install.sh again"
fi
say "checked $CONF_DIR/gateway.yaml as $SERVICE_USER"

# 6. llama-server, built in the cache once, as the service user
build_cmd="runuser -u $SERVICE_USER -- env LLAMA_GATEWAY_CACHE=$CACHE_DIR $PREFIX/venv/bin/llama-gateway install-llama-server"
if [ "$build" = 1 ]; then
  say "finding or building llama-server in $CACHE_DIR (first time: minutes)"
  as_service env LLAMA_GATEWAY_CACHE="$CACHE_DIR" "$PREFIX/venv/bin/llama-gateway" install-llama-server >/dev/null
fi

# 7. the unit, with the paths above. CacheDirectory=/StateDirectory= take a path relative to
# /var/cache, /var/lib; for a directory elsewhere the line is dropped (created in step 4, and
# writable through ReadWritePaths=).
unit_dir_line() {  # KEY BASE DIR: the sed command that sets or drops KEY=
  case "$3" in
    "$2"/?*) echo "s#^$1=.*#$1=$(esc "${3#"$2"/}")#" ;;
    *) echo "/^$1=/d" ;;
  esac
}
sed -e "s#/opt/llama-gateway#$(esc "$PREFIX")#g" -e "s#/etc/llama-gateway#$(esc "$CONF_DIR")#g" \
    -e "s#/var/cache/llama-gateway#$(esc "$CACHE_DIR")#g" -e "s#/var/lib/llama-gateway#$(esc "$STATE_DIR")#g" \
    -e "$(unit_dir_line CacheDirectory /var/cache "$CACHE_DIR")" \
    -e "$(unit_dir_line StateDirectory /var/lib "$STATE_DIR")" \
    -e "s#^User=.*#User=$(esc "$SERVICE_USER")#" -e "s#^Group=.*#Group=$(esc "$GROUP")#" \
    -e "s#runuser -u llama-gateway #runuser -u $(esc "$SERVICE_USER") #" \
    "$SRC/deploy/$UNIT" > "$tmp"
install -d "$UNIT_DIR"
if ! cmp -s "$tmp" "$UNIT_DIR/$UNIT"; then
  install -m 0644 "$tmp" "$UNIT_DIR/$UNIT"
  say "installed $UNIT_DIR/$UNIT"
fi
$SYSTEMCTL daemon-reload
$SYSTEMCTL enable "$UNIT" >/dev/null
if [ "$start" = 1 ]; then
  $SYSTEMCTL restart "$UNIT"
  say "started $UNIT"
else
  say "enabled $UNIT; start it with: systemctl start ${UNIT%.service}"
fi
if [ "$build" = 0 ]; then
  say "llama-server was not built (--no-build); before the first start, run as root:"
  echo "  $build_cmd"
fi
