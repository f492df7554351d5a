#!/usr/bin/env bash
# Install llama-gateway as a systemd service. Idempotent: run it again to upgrade.
#
#   sudo deploy/install.sh               install or upgrade, enable the unit (not started)
#   sudo deploy/install.sh --start       … and (re)start it
#   sudo deploy/install.sh --uninstall   stop, disable, remove unit and venv; keeps
#                                        /etc/llama-gateway and the cache (add --purge to drop them)
#
# What it does: a system user `llama-gateway` (groups video/render when present), a venv under
# /opt/llama-gateway/venv with this checkout installed, /etc/llama-gateway/gateway.yaml (from
# ./gateway.yaml, never overwritten) and llama-gateway.env, the llama-server build in
# /var/cache/llama-gateway (as the service user), and the unit in /etc/systemd/system.
# Paths can be overridden for packaging: PREFIX, CONF_DIR, CACHE_DIR, UNIT_DIR, SERVICE_USER,
# SYSTEMCTL, PYTHON.
set -euo pipefail

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

start=0 uninstall=0 purge=0 build=1
for a in "$@"; do
  case "$a" in
    --start) start=1 ;;
    --uninstall) uninstall=1 ;;
    --purge) purge=1 ;;
    --no-build) build=0 ;;   # skip provisioning llama-server now (the first start does it)
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $a" >&2; exit 2 ;;
  esac
done

say() { echo "install.sh: $*"; }
[ "$(id -u)" = 0 ] || { echo "install.sh: run as root" >&2; exit 1; }

if [ "$uninstall" = 1 ]; then
  if [ -f "$UNIT_DIR/$UNIT" ]; then
    $SYSTEMCTL disable --now "$UNIT" || true
    rm -f "$UNIT_DIR/$UNIT"
    $SYSTEMCTL daemon-reload || true
    say "removed $UNIT_DIR/$UNIT"
  fi
  rm -rf "$PREFIX" && say "removed $PREFIX"
  if [ "$purge" = 1 ]; then
    rm -rf "$CONF_DIR" "$CACHE_DIR" "$STATE_DIR" && say "purged $CONF_DIR $CACHE_DIR $STATE_DIR"
    if id "$SERVICE_USER" >/dev/null 2>&1 && [ "$SERVICE_USER" = llama-gateway ]; then
      userdel "$SERVICE_USER" && say "removed user $SERVICE_USER"
    fi
  else
    say "kept $CONF_DIR and $CACHE_DIR (use --purge to remove them)"
  fi
  exit 0
fi

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

# 2. the venv (upgrade in place)
mkdir -p "$PREFIX"
[ -x "$PREFIX/venv/bin/python" ] || "$PYTHON" -m venv "$PREFIX/venv"
"$PREFIX/venv/bin/python" -m pip install -q --upgrade pip
"$PREFIX/venv/bin/python" -m pip install -q --upgrade "$SRC"
cp -f "$SRC/README.md" "$PREFIX/"  # the unit's Documentation=
say "installed $("$PREFIX/venv/bin/llama-gateway" --version) into $PREFIX/venv"

# 3. config and environment (never overwrite an operator's files)
install -d -m 0755 "$CONF_DIR"
if [ ! -f "$CONF_DIR/gateway.yaml" ]; then
  sed 's/^listen: .*/listen: "127.0.0.1:11434"/' "$SRC/gateway.yaml" > "$CONF_DIR/gateway.yaml"
  say "wrote $CONF_DIR/gateway.yaml"
fi
if [ ! -f "$CONF_DIR/llama-gateway.env" ]; then
  sed "s#^LLAMA_GATEWAY_CACHE=.*#LLAMA_GATEWAY_CACHE=$CACHE_DIR#" "$SRC/deploy/llama-gateway.env" \
    > "$CONF_DIR/llama-gateway.env"
  chmod 0640 "$CONF_DIR/llama-gateway.env"
  chgrp "$(id -gn "$SERVICE_USER")" "$CONF_DIR/llama-gateway.env"
  say "wrote $CONF_DIR/llama-gateway.env"
fi
"$PREFIX/venv/bin/llama-gateway" check-config -c "$CONF_DIR/gateway.yaml" >/dev/null

# 4. cache and state, owned by the service user; llama-server built there once
install -d -o "$SERVICE_USER" -g "$(id -gn "$SERVICE_USER")" -m 0750 "$CACHE_DIR" "$STATE_DIR"
if [ "$build" = 1 ]; then
  say "finding or building llama-server in $CACHE_DIR (first time: minutes)"
  (cd / && runuser -u "$SERVICE_USER" -- env LLAMA_GATEWAY_CACHE="$CACHE_DIR" \
     "$PREFIX/venv/bin/llama-gateway" install-llama-server >/dev/null)
fi

# 5. the unit
unit_src="$SRC/deploy/$UNIT"
tmp="$(mktemp)"
sed -e "s#/opt/llama-gateway#$PREFIX#g" -e "s#/etc/llama-gateway#$CONF_DIR#g" \
    -e "s#/var/cache/llama-gateway#$CACHE_DIR#g" -e "s#/var/lib/llama-gateway#$STATE_DIR#g" \
    -e "s#^User=.*#User=$SERVICE_USER#" -e "s#^Group=.*#Group=$(id -gn "$SERVICE_USER")#" \
    "$unit_src" > "$tmp"
install -d "$UNIT_DIR"
if ! cmp -s "$tmp" "$UNIT_DIR/$UNIT"; then
  install -m 0644 "$tmp" "$UNIT_DIR/$UNIT"
  say "installed $UNIT_DIR/$UNIT"
fi
rm -f "$tmp"
$SYSTEMCTL daemon-reload
$SYSTEMCTL enable "$UNIT" >/dev/null
if [ "$start" = 1 ]; then
  $SYSTEMCTL restart "$UNIT"
  say "started $UNIT"
else
  say "enabled $UNIT; start it with: systemctl start ${UNIT%.service}"
fi
