#!/usr/bin/env bash
# Whether a CPU-only build reaches any CUDA header. On a machine with the
# CUDA toolkit's headers on the compiler's default path (/usr/local/include
# here) a CPU-only build finds them and compiles, while on a fresh machine
# without the toolkit it fails. This preprocesses every source of a CPU-only
# build folder with each toolkit header shadowed by one that is an #error.
#   scripts/check-cpu-headers.sh [build-cpu]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-cpu}
toolkit=${MPT_CUDA_INCLUDE:-/usr/local/include}
grep -q '^MPT_WITH_CUDA:BOOL=OFF' "$build/CMakeCache.txt" 2>/dev/null ||
  { echo "check-cpu-headers: $build is not a build configured with -DMPT_WITH_CUDA=OFF" >&2; exit 2; }
cmake -S . -B "$build" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >/dev/null
shadow=$(mktemp -d)
trap 'rm -rf "$shadow"' EXIT
for header in "$toolkit"/cu*.h "$toolkit"/nccl*.h "$toolkit"/nv*.h; do
  [[ -e $header ]] && echo "#error \"$(basename "$header"): a CUDA header in a CPU-only build\"" >"$shadow/$(basename "$header")"
done
python3 - "$build/compile_commands.json" "$shadow" <<'EOF'
import concurrent.futures, json, os, shlex, subprocess, sys
commands, shadow = json.load(open(sys.argv[1])), sys.argv[2]
def preprocess(c):
    args, keep, skip = shlex.split(c["command"]), [], False
    for a in args[1:]:
        if skip or a == "-c":
            skip = False
            continue
        if a == "-o":
            skip = True
            continue
        keep.append(a)
    p = subprocess.run([args[0], "-I" + shadow, "-E", "-o", os.devnull] + keep, cwd=c["directory"],
                       capture_output=True, text=True)
    return c["file"], p.returncode, p.stderr
bad = 0
with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
    for source, rc, err in pool.map(preprocess, commands):
        if rc:
            bad += 1
            print(source + ":\n  " + "\n  ".join(l for l in err.splitlines() if "error" in l)[:600])
print(f"check-cpu-headers: {len(commands)} sources, {bad} reach a CUDA header")
sys.exit(1 if bad else 0)
EOF
