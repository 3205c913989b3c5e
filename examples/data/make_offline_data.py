"""Writes the small offline example data sets next to this file (deterministic).

    python examples/data/make_offline_data.py

* ``sft_chat.jsonl``: chat records (``messages``) about small sums, some of
  them two-turn, for ``examples/sft_chat.yaml``;
* ``preferences.jsonl``: ``prompt`` / ``chosen`` / ``rejected`` pairs (a
  correct and a wrong sum, both as sentences) for ``examples/rm_preferences.yaml``.
"""
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    rng = random.Random(0)
    problems = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(problems)
    with open(os.path.join(HERE, "sft_chat.jsonl"), "w") as f:
        for i, (a, b) in enumerate(problems[:80]):
            msgs = [
                {"role": "user", "content": f"What is {a} + {b}? Answer with just the number."},
                {"role": "assistant", "content": str(a + b)},
            ]
            if i % 4 == 0:
                c = rng.randrange(10)
                msgs += [
                    {"role": "user", "content": f"And plus {c}?"},
                    {"role": "assistant", "content": str(a + b + c)},
                ]
            f.write(json.dumps({"id": f"sft-{i}", "messages": msgs}) + "\n")
    with open(os.path.join(HERE, "preferences.jsonl"), "w") as f:
        for i, (a, b) in enumerate(problems[:96]):
            wrong = a + b + rng.choice((-3, -2, -1, 1, 2, 3))
            f.write(json.dumps({
                "id": f"pref-{i}",
                "prompt": f"What is {a} + {b}?",
                "chosen": f"{a} + {b} = {a + b}.",
                "rejected": f"{a} + {b} = {wrong}.",
            }) + "\n")


if __name__ == "__main__":
    main()
