#!/usr/bin/env bash
# Builds and runs the loopback transport tests (a program per area, listed in `tests`) and the links' tests
# against strangers (test_links_security.cc): ASan+UBSan (the main run), ThreadSanitizer, and an unsanitized
# build whose RSS check is meaningful. Exits non-zero on any build or test failure.
# Usage: native/tests/run_loopback_tests.sh [asan|tsan|plain]...   (default: all three)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
native="$(dirname "$here")"
out="${LOOPBACK_BUILD_DIR:-${TMPDIR:-/tmp}/perseus_loopback_tests}"
mkdir -p "$out"
tests=(test_loopback_collectives test_loopback_ring test_loopback_p2p test_loopback_nonblocking test_loopback_comms
       test_loopback_failures test_links_security)
srcs=("$native/transport_loopback.cc" "$native/transport_loopback_world.cc" "$native/transport_loopback_collectives.cc"
      "$native/algorithms.cc" "$native/huge_pages.cc" "$native/ring.cc" "$native/links.cc" "$native/kernels.cc"
      "$native/common.cc")
common_flags=(-std=c++17 -g -Wall -Wextra -Werror -pthread)

build_and_run() {  # name, extra flags...: the sources compiled once into $out/name, each test linked against them
  local name="$1"; shift
  local dir="$out/$name" src test objects=()
  mkdir -p "$dir"
  echo "== $name: build"
  for src in "${srcs[@]}"; do
    objects+=("$dir/$(basename "${src%.cc}").o")
    g++ "${common_flags[@]}" "$@" -c "$src" -o "${objects[-1]}"
  done
  for test in "${tests[@]}"; do
    g++ "${common_flags[@]}" "$@" "$here/$test.cc" "${objects[@]}" -o "$dir/$test"
  done
  echo "== $name: run"
  local launch=()
  # ThreadSanitizer cannot map its shadow memory under the kernel's full address-space randomisation
  # (it crashes at start-up on some kernels): run it with randomisation off.
  if [ "$name" = tsan ] && command -v setarch >/dev/null; then launch=(setarch "$(uname -m)" -R); fi
  for test in "${tests[@]}"; do
    timeout 120 "${launch[@]}" "$dir/$test"
  done
}

variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=(asan tsan plain)
for v in "${variants[@]}"; do
  case "$v" in
    asan) ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
            build_and_run asan -O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined \
            -fno-omit-frame-pointer ;;
    # target_clones dispatches through ifunc resolvers, which run before ThreadSanitizer is initialised.
    tsan) TSAN_OPTIONS=halt_on_error=1 build_and_run tsan -O1 -fsanitize=thread -DPERSEUS_NO_TARGET_CLONES ;;
    plain) build_and_run plain -O2 ;;
    *) echo "unknown variant $v (asan, tsan, plain)" >&2; exit 2 ;;
  esac
done
echo "== loopback tests: all passed"
