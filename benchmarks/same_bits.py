"""Whether runs of the throughput benchmark trained the same bits: each combination's losses, in
every record given and every round within one, against its first run's.

    python3 benchmarks/same_bits.py A.json B.json ...

Records of separate processes of one tree (`gpu_run.sh same`) must agree to the last bit: the
library's policy is that the same inputs and profile give the same bits. Exits 1 when any
combination's losses differ, naming the run and the first update where they do: a warm-up
update's where both records kept them (a run that leaves the others there did so before timing).
"""
import json
import sys


def runs(path: str):
    """(combo, where, warm-up losses or None, timed losses) for every round of every row of a
    throughput record."""
    with open(path) as f:
        record = json.load(f)
    for row in record["rows"]:
        for k, one in enumerate(row.get("rounds") or [{"ours": row["ours"]}]):
            if "losses" in one["ours"]:
                yield row["combo"], f"{path} round {k + 1}", one["ours"].get("warmup_losses"), one["ours"]["losses"]


def first_difference(a: list | None, b: list | None) -> int | None:
    """The first index where a and b differ, over the updates both hold (None: none, or no a or b)."""
    return next((i for i, (x, y) in enumerate(zip(a or [], b or [])) if x != y), None)


def main(paths: list[str]) -> int:
    first, differ = {}, False
    for path in paths:
        for combo, where, warm, losses in runs(path):
            if combo not in first:
                first[combo] = (where, warm, losses, [])
                continue
            ref_where, ref_warm, ref, same = first[combo]
            w, i = first_difference(ref_warm, warm), first_difference(ref, losses)
            if w is None and i is None:       # runs of other lengths agree on the updates both timed
                same.append(where)
                continue
            differ = True
            what, mine, theirs = (f"warm-up update {w + 1}", warm[w], ref_warm[w]) if w is not None else (
                f"timed update {i + 1}", losses[i], ref[i])
            print(f"{combo}: {where} differs from {ref_where} at {what}: {mine!r} against {theirs!r}")
    for combo, (where, _, losses, same) in first.items():
        print(f"{combo}: {len(same)} of the other runs equal to {where} ({len(losses)} timed updates) on the "
              f"updates both timed")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
