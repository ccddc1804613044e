"""Write the example task's prompt files: train.parquet and val.parquet in verl's layout, two data sources.

    python examples/your_task/make_data.py --out data/your_task

Each record: `data_source` ("add" or "copy"), `prompt` (chat messages), `ability`, `reward_model.ground_truth`, and
`extra_info` (split, index), as verl's data preprocessing scripts write them. "add": a sum of two digits ("3+4=",
answer "7"); "copy": repeat two digits ("copy 52:", answer "52").
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def record(source: str, question: str, answer: str, split: str, index: int) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index},
    }


def problems(split: str, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for index in range(count):
        if index % 2 == 0:
            a, b = rng.randint(0, 4), rng.randint(0, 4)
            records.append(record("add", f"{a}+{b}=", str(a + b), split, index))
        else:
            digits = f"{rng.randint(0, 9)}{rng.randint(0, 9)}"
            records.append(record("copy", f"copy {digits}:", digits, split, index))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/your_task"), help="the folder the two files go in")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split, count, seed in (("train", 2048, 0), ("val", 64, 1)):
        path = args.out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(problems(split, count, seed)), path)
        print(f"wrote {count} records to {path}")


if __name__ == "__main__":
    main()
