#!/usr/bin/env bash
# Screenshot a pytorch profiler trace in Catapult's trace viewer (the viewer behind
# chrome://tracing), headless and offline: docs/pytorch-trace.png in the README.
#   docs/trace_screenshot/make.sh runs/NAME/profiles/fit-rank0-...training_step...pt.trace.json OUT.png
# Needs node and npm; the viewer page comes from the torch-tb-profiler wheel.
set -euo pipefail
trace=$(realpath "$1"); out=$(realpath -m "$2")
work=$(mktemp -d); trap 'kill "${server:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
here=$(dirname "$(realpath "$0")")
cp "$here"/{viewer.html,shot.js,package.json} "$work"/ && cp "$trace" "$work/trace.json"
cd "$work"
npm install --silent --no-audit --no-fund
cp node_modules/webcomponents.js/webcomponents.min.js .
pip download -q --no-deps torch-tb-profiler==0.4.3 -d wheel
python3 -m zipfile -e wheel/*.whl wheel/x
cp wheel/x/torch_tb_profiler/static/trace_viewer_full.html .
port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
python3 -m http.server "$port" --bind 127.0.0.1 >/dev/null 2>&1 & server=$!
until python3 -c "import socket; socket.create_connection(('127.0.0.1', $port))" 2>/dev/null; do
  kill -0 "$server"  # the server died: stop here
done
node shot.js "$port" "$out"
