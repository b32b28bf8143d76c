"""The README's throughput table is what `benchmarks/throughput.py --table` prints from the records
it names, so no figure in it is typed by hand."""
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def throughput():
    spec = importlib.util.spec_from_file_location("throughput", ROOT / "benchmarks" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_table_is_printed_from_its_records():
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- table: benchmarks/throughput\.py --table (.*?) -->\n((?:\|.*\n)+)", readme)
    assert found, "the README has no table comment followed by a table"
    records = found.group(1).split()
    for spec in records:
        assert (ROOT / spec.partition("@")[0]).is_file(), spec
    assert found.group(2) == throughput().table([str(ROOT / s) for s in records]) + "\n"


def test_table_figures_and_refusal(tmp_path):
    side = lambda tokens, peak: {"tokens_per_s": tokens, "peak_bytes": peak * 2**30, "finite": True,  # noqa: E731
                                 "loss_fell": True}
    rounds = [{"ours": side(90e3, 14), "peer": side(50e3, 25)}, {"ours": side(88e3, 14), "peer": side(44e3, 25)}]
    rounds[1]["peer"]["loss_fell"] = False
    row = {"combo": "llama-3.2-1b:qlora:kept", "model": "llama-3.2-1b", "method": "qlora",
           "ours": rounds[1]["ours"], "peer": rounds[0]["peer"], "speedup": 88e3 / 50e3, "rounds": rounds}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"environment": {"device": "NVIDIA H200"}, "rows": [row]}))
    lines = throughput().table([f"{path}@llama-3.2-1b:qlora:kept"]).splitlines()
    assert lines[2] == ("| llama-3.2-1b | qlora:kept | 88.0k | 14.0 GiB | 50.0k | 25.0 GiB | **1.760x** (1.800, 2.000) "
                        "| **no** | H200 | 2x: **not met** |")
    with pytest.raises(SystemExit, match="has no row 'llama-3.2-1b:lora'"):
        throughput().table([f"{path}@llama-3.2-1b:lora"])
    failed = dict(row, ours={"side": "ours", "error": "OutOfMemoryError: CUDA out of memory"}, rounds=[])
    del failed["speedup"]
    path.write_text(json.dumps({"environment": {"device": "NVIDIA H200"}, "rows": [failed]}))
    assert throughput().table([str(path)]).splitlines()[2] == \
        "| llama-3.2-1b | qlora:kept | ours: OutOfMemoryError: CUDA out of memory |" + " |" * 7
