# The README's backend-selection table: `attncore bench --select` forward and backward on 1 and
# 2 threads, one row per shape and dtype. Usage: bench/select_table.py [attncore] [passes]
import re, subprocess, sys
exe = sys.argv[1] if len(sys.argv) > 1 else "build/release/attncore"
passes = sys.argv[2] if len(sys.argv) > 2 else "5"
runs = {"fwd 1T": ["--threads", "1"], "fwd 2T": ["--threads", "2"],
        "bwd 1T": ["--threads", "1", "--backward"], "bwd 2T": ["--threads", "2", "--backward"]}
line = re.compile(r"^(\S.*?)\s{2,}(f32|bf16)\s+(\d+ \d+ \d+ \d+ \d+ \d+)\s+([\d.]+)\s+([\d.]+)"
                  r"\s+([\d.]+)\s+(\w+)\s+(\w+)\s+([\d.]+)x\s+([\d.]+)x")
data, order = {}, []
for run, args in runs.items():
  out = subprocess.run([exe, "bench", "--select", "--passes", passes, *args],
                       capture_output=True, text=True, check=True).stdout
  print(out, file=sys.stderr, flush=True)
  for text in out.splitlines():
    m = line.match(text)
    if not m:
      continue
    key = (m.group(1).strip(), m.group(2), m.group(3))
    if key not in order:
      order.append(key)
    data.setdefault(key, {})[run] = m.groups()[3:]
def ms(x):
  x = float(x)
  return f"{x:.3g}" if x < 10 else f"{x:.0f}" if x >= 100 else f"{x:.1f}"
print("| shape (B Hq Hkv Lq Lk D) | dtype | " +
      " | ".join(f"{r} flash / math ms | choice | choice/best | auto/best" for r in runs) + " |")
print("|---|---|" + "---|---|---|---|" * len(runs))
for key in order:
  row = [f"{key[0]} ({key[2]})", key[1]]
  for run in runs:
    flash, math, auto_ms, auto, best, ratio, auto_ratio = data[key][run]
    row += [f"{ms(flash)} / {ms(math)}", auto if auto == best else f"{auto} (best: {best})",
            f"{float(ratio):.2f}x", f"{float(auto_ratio):.2f}x"]
  print("| " + " | ".join(row) + " |")
