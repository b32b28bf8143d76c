"""Whether runs of the throughput benchmark trained the same bits: each combination's losses, in
every record given and every round within one, against its first run's.

    python3 benchmarks/same_bits.py A.json B.json ...

Records of separate processes of one tree (`gpu_run.sh same`) must agree to the last bit: the
library's policy is that the same inputs and profile give the same bits. Exits 1 when any
combination's losses differ, naming the run and the first update where they do.
"""
import json
import sys


def runs(path: str):
    """(combo, where, losses) for every round of every row of a throughput record."""
    with open(path) as f:
        record = json.load(f)
    for row in record["rows"]:
        for k, one in enumerate(row.get("rounds") or [{"ours": row["ours"]}]):
            if "losses" in one["ours"]:
                yield row["combo"], f"{path} round {k + 1}", one["ours"]["losses"]


def main(paths: list[str]) -> int:
    first, differ = {}, False
    for path in paths:
        for combo, where, losses in runs(path):
            if combo not in first:
                first[combo] = (where, losses, [])
                continue
            ref_where, ref, same = first[combo]
            i = next((i for i, (a, b) in enumerate(zip(ref, losses)) if a != b), None)
            if i is None:       # runs of other lengths agree on the updates both timed
                same.append(where)
                continue
            differ = True
            print(f"{combo}: {where} differs from {ref_where} at timed update {i + 1}: {losses[i]!r} against {ref[i]!r}")
    for combo, (where, losses, same) in first.items():
        print(f"{combo}: {len(same)} of the other runs equal to {where} ({len(losses)} timed updates) on the "
              f"updates both timed")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
