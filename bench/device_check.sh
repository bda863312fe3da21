#!/usr/bin/env bash
# kvtop's real-boundary checks on a machine with an NVIDIA GPU, in one short run (about a minute):
#
#   bash bench/device_check.sh [OUTDIR]      # OUTDIR defaults to $OUT, else /tmp/kvtop-device
#
# 1. bench/gpu_check.py --load: every NVML call GpuSource makes and its outcome, pinned copies
#    host->GPU->host next to the PCIe rates NVML reported, the host pinned-memory signals;
# 2. `kvtop snapshot --format json` against the simulated engine, with the real NVML: the GPU
#    objects a user's snapshot carries, checked against the schema;
# 3. the source and capture tests on the real kernel: the GPU source's unit tests, loopback capture,
#    and the bridged namespace (a container's veth and its bridge) where root may build one;
# 4. bench/capture_cost.py, one short load (no tcpdump baseline where it is not installed).
#
# Needs kvtop's dependencies importable by python3; where a wheel folder .whl/ is in the checkout
# (pip download ... -d .whl) and they are missing, they are installed from it into /tmp/site first. Each step's output is
# kept in OUTDIR; a failed step is reported and the rest still run. Exit status: the failed steps.
set -u
out=${1:-${OUT:-/tmp/kvtop-device}}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 2
if ! python3 -c "import msgspec, jsonschema, shtab, pytest_asyncio" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "device_check: cannot install .whl/"; exit 2; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
failed=0
step() {  # step NAME COMMAND...: run, keep its output in OUTDIR/NAME.txt, say how it ended
    local name=$1; shift
    echo "== $name: $*"
    "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    tail -n 40 "$out/$name.txt"
    echo "== $name: exit $rc"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

step nvidia-smi nvidia-smi -q -d MEMORY,PCIE,CLOCK
step gpu_check python3 -m bench.gpu_check --load --load-seconds 2 --mib 512

python3 -m kvtop sim-server --preset preemption-storm --port 18123 --duration 60 >"$out/sim.txt" 2>&1 &
sim=$!
sleep 3
step snapshot python3 - "$out" <<'EOF'
import json, pathlib, subprocess, sys
import jsonschema
schema = json.loads(pathlib.Path("kvtop/schemas/snapshot.schema.json").read_text())
p = subprocess.run([sys.executable, "-m", "kvtop", "snapshot", "--url", "http://127.0.0.1:18123",
                    "--duration", "4", "--interval", "1", "--format", "json"], capture_output=True, text=True,
                   timeout=60)
open(sys.argv[1] + "/snapshot.json", "w").write(p.stdout)
print(p.stderr[-2000:])
snap = json.loads(p.stdout)
jsonschema.validate(snap, schema)
for g in snap["gpus"]:
    print({k: v for k, v in g.items() if k != "processes"})
assert snap["gpus"] and not any(g.get("lost") for g in snap["gpus"]), "no live GPU in the snapshot"
EOF
kill "$sim" 2>/dev/null

step tests python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_source.py tests/test_host_source.py \
    tests/test_capture_live.py tests/test_capture_bridge.py tests/test_capture_tcp.py
step capture_cost python3 -m bench.capture_cost --streams 256 --seconds 4 --repeat 1
echo "device_check: $failed step(s) failed; outputs in $out"
exit "$failed"
