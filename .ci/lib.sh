# Shared by the .ci/setup*.sh scripts (sourced, not run).
# pip_in VENV ARGS...: pip in that venv, quiet. This kind of machine's pip config names local index folders
#   that may not exist, and pip then warns once per package: only those lines are dropped (under pipefail
#   pip's own exit status still decides).
# needs_install STAMP FILE...: true when STAMP is missing or older than any FILE (a set-up script or the
#   constraints it installs under), so reruns are a few-second check and an edit reinstalls.
pip_in() {
  local venv=$1; shift
  "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
needs_install() {
  local stamp=$1; shift
  [ -f "$stamp" ] || return 0
  local f
  for f in "$@"; do [ "$f" -nt "$stamp" ] && return 0; done
  return 1
}
