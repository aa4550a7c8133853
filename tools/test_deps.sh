#!/usr/bin/env bash
# The system tools some tests need and a fresh machine lacks: Debian's chromium (the dashboard in
# a real browser), ping (the lab's jitter and loss test), nftables (cut links between lab
# peers, NAT routers) and, for the mesh's tests, wireguard-go, wireguard-tools and tcpdump.
# Installed with apt where this runs as root on Debian; elsewhere nothing happens and
# those tests skip with their reason. Never fails: a test run goes on without them.
need=()
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || need+=(chromium)
command -v ping >/dev/null || need+=(iputils-ping)
command -v nft >/dev/null || need+=(nftables)
# without recommends: wireguard-tools recommends a kernel image, which a container cannot use
lean=()
command -v wireguard-go >/dev/null || lean+=(wireguard-go)
command -v wg >/dev/null || lean+=(wireguard-tools)
command -v tcpdump >/dev/null || lean+=(tcpdump)
[ "${#need[@]}" -eq 0 ] && [ "${#lean[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "test-deps: ${need[*]} ${lean[*]} missing (not root with apt): the tests that need them are skipped"
  exit 0
fi
echo "test-deps: installing ${need[*]} ${lean[*]} (apt)"
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
if ! apt-get update -qq; then
  echo "test-deps: apt-get update failed; the tests that need ${need[*]} ${lean[*]} are skipped"
  exit 0
fi
if [ "${#need[@]}" -gt 0 ] && ! apt_install "${need[@]}"; then
  echo "test-deps: could not install ${need[*]}; the tests that need them are skipped"
fi
if [ "${#lean[@]}" -gt 0 ] && ! apt_install --no-install-recommends "${lean[@]}"; then
  echo "test-deps: could not install ${lean[*]}; the tests that need them are skipped"
fi
exit 0
