# Sourced by the set-up scripts (tools/setup_*.sh, tools/check_wheel.sh, tools/check_lower_bounds.sh): an
# environment or a built wheel is made once per machine and reused for as long as what it was made from has not
# changed. What it was made from is a hash of some words (the Python's version, the extras, ...) and of the
# contents of some files; the hash is kept next to what was made.
#
#   inputs_hash WORD... -- PATH...   16 hex digits: the words, then every file under the PATHs (byte for byte;
#                                    compiled files and caches left out)
#   is_current DIR HASH              true when DIR was made from HASH (and DIR/bin/python runs, for a venv)
#   mark_current DIR HASH            record that DIR is now made from HASH
#   SOURCES                          the paths a wheel of perseus is built from

SOURCES=(perseus native setup.py pyproject.toml README.md)

inputs_hash() {
  local words=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do words+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  {
    printf '%s\n' "${words[@]}"
    find "$@" -type f ! -name '*.pyc' ! -name '*.so' ! -name '*.o' ! -path '*/__pycache__/*' \
      ! -path '*.egg-info/*' -print0 | LC_ALL=C sort -z | xargs -0 -r sha1sum
  } | sha1sum | cut -c1-16
}

is_current() {
  local dir="$1" hash="$2"
  [ "$(cat "$dir/.perseus-inputs" 2>/dev/null)" = "$hash" ] || return 1
  [ ! -e "$dir/bin" ] || "$dir/bin/python" -c "" 2>/dev/null
}

mark_current() {
  echo "$2" >"$1/.perseus-inputs"
}

# cached_wheel PYTHON DIR WORD...: prints the path of a perseus wheel that PYTHON built from a copy of SOURCES
# (nothing of an earlier build in the tree can slip into it, and the tree is not written to), kept in DIR and
# reused while the sources, the Python and the WORDs (say, which MPI) are the same. The copy keeps the native
# core the editable install compiled, which setup.py takes when it was built from the same inputs.
cached_wheel() {
  local py="$1" dir="$2" hash src
  shift 2
  hash="$(inputs_hash "$("$py" -VV)" "$@" -- "${SOURCES[@]}")"
  if ! is_current "$dir" "$hash" || ! compgen -G "$dir/perseus-*.whl" >/dev/null; then
    rm -rf "$dir"
    mkdir -p "$dir"
    src="$(mktemp -d "${TMPDIR:-/tmp}/perseus-src.XXXXXX")"
    cp -r "${SOURCES[@]}" "$src/"
    find "$src" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} + 2>/dev/null || true
    "$py" -m pip wheel -q --no-deps -w "$dir" "$src" >&2 || { rm -rf "$src"; return 1; }
    rm -rf "$src"
    mark_current "$dir" "$hash"
  fi
  ls "$dir"/perseus-*.whl
}
