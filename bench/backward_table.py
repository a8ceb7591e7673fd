# The README's backward table: medians of 3 passes of `attncore run --backward --json` per
# shape, backend (flash, math) and thread count (1, 2). Usage: bench/backward_table.py [attncore]
import json, subprocess, statistics, sys
exe = sys.argv[1] if len(sys.argv) > 1 else "build/release/attncore"
shapes = {
  "f32 D=128 L=2048": ["--heads-q","16","--seqlen-q","2048","--head-dim","128"],
  "f32 D=128 L=2048 causal": ["--heads-q","16","--seqlen-q","2048","--head-dim","128","--causal","lower-right"],
  "f32 D=128 L=4096 Hq=Hkv=8": ["--heads-q","8","--seqlen-q","4096","--head-dim","128"],
  "f32 D=64 L=2048": ["--heads-q","16","--seqlen-q","2048","--head-dim","64"],
  "bf16 D=128 L=2048": ["--heads-q","16","--seqlen-q","2048","--head-dim","128","--dtype","bf16"],
  "bf16 D=128 L=4096 Hq=Hkv=8": ["--heads-q","8","--seqlen-q","4096","--head-dim","128","--dtype","bf16"],
  "f32 D=128 L=2048 Hq=16 Hkv=4": ["--heads-q","16","--heads-kv","4","--seqlen-q","2048","--head-dim","128"],
  "bf16 D=128 L=2048 Hq=16 Hkv=4": ["--heads-q","16","--heads-kv","4","--seqlen-q","2048","--head-dim","128","--dtype","bf16"],
}
res = {}
for pas in range(3):
  for name, args in shapes.items():
    for threads in ("1", "2"):
      for backend in ("flash", "math"):
        out = subprocess.run([exe, "run", *args, "--backward", "--json", "--repeat", "2", "--threads", threads, "--backend", backend], capture_output=True, text=True).stdout
        d = json.loads(out)
        key = (name, threads, backend)
        res.setdefault(key, []).append((d["bwd_gflops"], d["bwd_gflops"] / d["peak_gflops"] * 100))
        print(name, threads, backend, round(d["bwd_gflops"],1), round(d["peak_gflops"],1), file=sys.stderr, flush=True)
for name in shapes:
  row = [name]
  for threads in ("1", "2"):
    f = statistics.median(x[0] for x in res[(name, threads, "flash")])
    fp = statistics.median(x[1] for x in res[(name, threads, "flash")])
    m = statistics.median(x[0] for x in res[(name, threads, "math")])
    row += [f"{f:.0f} ({fp:.0f}%)", f"{m:.0f}", f"{f/m:.1f}x"]
  print("| " + " | ".join(row) + " |")
