"""48 chats of varied length for the tiny chat model (``tests/assets/trl-2proc/varied.jsonl``): sums and
differences with 0–60 filler words in the question and 0–40 in the answer, so that the rows of one per-device batch
are padded by very different amounts (6 to about 130 tokens). Seeded; every answer holds " is ".

    python examples/trl-multiprocess/varied_chats.py --out tests/assets/trl-2proc/varied.jsonl
"""

import argparse
import json
import random

WORDS = ["alpha", "beta", "gamma", "delta", "theta", "kappa", "omega"]

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--rows", type=int, default=48)
opts = p.parse_args()
rng = random.Random(67)
rows = []
for _ in range(opts.rows):
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    ask = " ".join(rng.choice(WORDS) for _ in range(rng.choice([0, 1, 3, 8, 20, 35, 60])))
    tell = " ".join(rng.choice(WORDS) for _ in range(rng.choice([0, 2, 5, 15, 40])))
    if rng.random() < 0.5:
        q, ans = f"What is {a} plus {b}? {ask}".strip(), f"{a} plus {b} is {a + b}. {tell}".strip()
    else:
        q, ans = f"What is {a} minus {b}? {ask}".strip(), f"{a} minus {b} is {a - b}. {tell}".strip()
    rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]})
with open(opts.out, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
