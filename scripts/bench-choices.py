#!/usr/bin/env python3
"""n choices of one long prompt against a running `thaw serve` (or any OpenAI-compatible server).

Usage: scripts/bench-choices.py [PORT] [N]
Six completions requests of an ~830-token prompt (each prompt different from the last, so no
request finds the previous one in the prefix cache), `n` choices each, 16 tokens per choice;
prints the median wall time per request. Only the standard library.
"""
import json
import statistics
import sys
import time
import urllib.request

port = sys.argv[1] if len(sys.argv) > 1 else "8000"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 4
walls = []
for k in range(6):
    prompt = (f"Report {k}. " + " ".join(f"item{i} is worth {i * 7 % 13} coins;" for i in range(90))
              + " Summarize.")
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.8, "seed": k, "n": n,
            "ignore_eos": True}
    t = time.time()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps(body).encode(), {"content-type": "application/json"})
    r = json.load(urllib.request.urlopen(req))
    walls.append(time.time() - t)
u = r["usage"]
print(f"prompt tokens {u['prompt_tokens']}, n={n}: wall ms median {statistics.median(walls) * 1e3:.0f}"
      f" ({', '.join(f'{w * 1e3:.0f}' for w in walls)})")
