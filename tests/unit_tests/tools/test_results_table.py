"""The README's measured table is generated from the newest committed results file."""

import json
import os

from tests.conftest import REPO


def test_readme_table_is_generated_from_the_newest_results_file(load_tool):
    results_table = load_tool("results_table")
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    assert results_table.readme_section() in readme, "run python3 tools/results_table.py --update-readme"


def test_compact_and_render(load_tool, tmp_path):
    results_table = load_tool("results_table")

    def run(mode, ms, peak, pool=None):
        graphs = {"pool_reserved_bytes": pool, "graphs": 4} if pool else {}
        return {
            "config": "dense8", "mode": mode, "ms_per_iter": ms, "pipelined_ms_per_iter": ms - 0.5,
            "tflops_per_gpu": 100.0, "peak_device_bytes": peak, "losses": [1.0], "graphs": graphs,
            "regular_map": [[1, []]],
        }  # fmt: skip

    raw = [run("eager", 10.0, 2**30), run("local:layer", 5.0, 2**30 + 2**24, 64 * 2**20)]
    raw.append(run("eager", 12.0, 2**30))  # a repeat: the median of 10 and 12
    src, dst = tmp_path / "results.json", tmp_path / "compact.json"
    src.write_text(json.dumps(raw))
    results_table.main(["--compact", str(src), str(dst)])
    compact = json.loads(dst.read_text())
    assert "losses" not in compact[0] and compact[1]["pool_reserved_bytes"] == 64 * 2**20
    text = results_table.render(compact, str(dst))
    assert "| 8-layer | eager | 11.00, median of 2 | 10.50 |" in text
    assert "| 8-layer | graphs, whole layer | 5.00 (0.45 x eager) | 4.50 | 100 | 1.016 | +1.6% | 64 |" in text
