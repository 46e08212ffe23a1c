#!/usr/bin/env bash
# Tracing changes no output byte: a split over two local rpc servers (CPU backend), run with the
# trace off and then on, must generate the same text; the traces of the second run must merge.
#
#   trace_tools/cpu_check.sh [MODEL.gguf] [OUT_DIR]
#
# Without MODEL a tiny test model is made. OUT_DIR (default: a temporary folder) keeps the trace
# files and the logs. Prints how many completions and bytes were compared and whether merge.py
# accepted the traces. Exit status 0 only when every request succeeded with the expected token
# count and content, the texts are identical, and merge.py accepted every trace file.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
PY="${PYTHON:-python}"
MODEL="${1:-}"
OUT="${2:-}"
if [[ -z "$OUT" ]]; then
    OUT="$(mktemp -d "${TMPDIR:-/tmp}/pyllama-cpu-check.XXXXXX")"
fi
mkdir -p "$OUT"
if [[ -z "$MODEL" ]]; then
    MODEL="$OUT/tiny.gguf"
    "$PY" -m pyllama.models.make --preset tiny --out "$MODEL" >/dev/null
fi
cd "$ROOT"
exec "$PY" - "$MODEL" "$OUT" <<'EOF'
import glob, http.client, json, os, re, signal, subprocess, sys, time

model, out = sys.argv[1], sys.argv[2]
PROMPTS = ["The little cat sat on the", "Once upon a time", "A B C D", "1 2 3 4 5", "hello world",
           "In the beginning"]
N_PREDICT = 24
procs = []


def start(args, name, pattern, env=None):
    log = open(os.path.join(out, name + ".log"), "w")
    p = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, env={**os.environ, **(env or {})})
    procs.append(p)
    deadline = time.monotonic() + 120
    for line in p.stderr:
        log.write(line)
        m = re.search(pattern, line)
        if m:
            # keep draining so the child never blocks on a full pipe
            import threading
            threading.Thread(target=lambda: [log.write(x) for x in p.stderr], daemon=True).start()
            return p, m.group(1)
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"cpu_check: {name} did not start (see {log.name})")


def stop_all():
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    procs.clear()


def complete(port, prompt):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "ignore_eos": True,
                       "cache_prompt": False})
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    if r.status != 200:
        raise SystemExit(f"cpu_check: HTTP {r.status} for {prompt!r}: {data[:200]!r}")
    doc = json.loads(data)
    if not doc.get("content"):
        raise SystemExit(f"cpu_check: no content for {prompt!r}")
    if doc.get("tokens_predicted") != N_PREDICT:
        raise SystemExit(f"cpu_check: {doc.get('tokens_predicted')} tokens for {prompt!r}, expected {N_PREDICT}")
    return doc["content"]


def run(traced):
    env = {"PYLLAMA_TRACE": ""}
    extra = []
    if traced:
        extra = ["--trace", os.path.join(out, "trace.jsonl")]
    tag = "on" if traced else "off"
    try:
        eps = []
        for i in range(2):
            _, ep = start(["pyllama.rpc_server", "--port", "0", "-t", "1", *extra], f"rpc{i}-{tag}",
                          r"listening on (\S+)", env)
            eps.append(ep)
        _, port = start(["pyllama.server", "-m", model, "--port", "0", "-t", "1", "--rpc", ",".join(eps),
                         "--device", "RPC0,RPC1", "-np", "2", "--pipeline-groups", "2", "-c", "1024", *extra],
                        f"server-{tag}", r"listening on http://[^:]+:(\d+)", env)
        port = int(port)
        deadline = time.monotonic() + 120
        while True:  # the model loads after the port is bound
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("cpu_check: the server did not become ready")
            time.sleep(0.1)
        return [complete(port, p) for p in PROMPTS]
    finally:
        stop_all()


try:
    for f in glob.glob(os.path.join(out, "trace*.jsonl")):
        os.unlink(f)
    off = run(False)
    on = run(True)
finally:
    stop_all()
nbytes = sum(len(t.encode()) for t in off)
if off != on:
    bad = [i for i, (a, b) in enumerate(zip(off, on)) if a != b]
    print(f"cpu_check: FAILED: completions {bad} differ with the trace on", file=sys.stderr)
    sys.exit(1)
print(f"cpu_check: compared {len(off)} completions, {nbytes} bytes: identical with the trace off and on")
files = sorted(glob.glob(os.path.join(out, "trace*.jsonl")))
if len(files) != 3:
    print(f"cpu_check: FAILED: expected 3 trace files (server and two rpc servers), found {len(files)}",
          file=sys.stderr)
    sys.exit(1)
m = subprocess.run([sys.executable, "trace_tools/merge.py", *files, "--summary"], capture_output=True, text=True)
if m.returncode != 0:
    print(f"cpu_check: FAILED: merge.py rejected the traces: {m.stderr.strip()}", file=sys.stderr)
    sys.exit(1)
with open(os.path.join(out, "merge-summary.txt"), "w") as fh:
    fh.write(m.stdout)
print(f"cpu_check: merge.py accepted {len(files)} trace files ({out})")
EOF
