# Sourced by the GPU machine's scripts (run from the repository root): unpacks the Debian packages
# carried in .gpu-deps (scripts/gpu-deps.sh; that machine has no package registry) into $deps and
# puts their libraries on LD_LIBRARY_PATH.
deps=/tmp/spin-deps
mkdir -p "$deps"
for f in .gpu-deps/*.deb; do [ -e "$f" ] && dpkg-deb -x "$f" "$deps"; done
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
