#!/usr/bin/env bash
# The system tools some tests need and a fresh machine lacks: Debian's chromium (the dashboard in
# a real browser), ping (the lab's jitter and loss test) and nftables (cut links between lab
# peers). Installed with apt where this runs as root on Debian; elsewhere nothing happens and
# those tests skip with their reason. Never fails: a test run goes on without them.
need=()
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || need+=(chromium)
command -v ping >/dev/null || need+=(iputils-ping)
command -v nft >/dev/null || need+=(nftables)
[ "${#need[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "test-deps: ${need[*]} missing (not root with apt): the tests that need them are skipped"
  exit 0
fi
echo "test-deps: installing ${need[*]} (apt)"
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; }; then
  echo "test-deps: could not install ${need[*]}; the tests that need them are skipped"
fi
exit 0
