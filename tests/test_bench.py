"""The benchmark's plumbing on a minimal run: rows, keys, the exact reference, files. No timing asserts."""

from __future__ import annotations

import json

import pytest

from jagg_core.bench import EXACT, ROW_KEYS, BenchOptions, Variant, run_bench, write_outputs


@pytest.fixture(scope="module")
def rows():
    options = BenchOptions(models=["tiny-sd3"], windows=(2,), modes=("cached",), joints=(True,), fracs=(),
                           repeats=1, warmup=0, iterations=1, seeds=(0,))
    assert options.grid(0) == [EXACT, Variant("cached", 2, True)]
    return run_bench(options, threads=2, log=lambda line: None)


def test_rows_have_the_required_keys(rows):
    assert [(r["section"], r["mode"]) for r in rows] == [
        ("train_phase", "exact"), ("train_phase", "cached"), ("iteration", "exact"), ("iteration", "cached")]
    for row in rows:
        assert set(ROW_KEYS) <= set(row), set(ROW_KEYS) - set(row)
        assert row["model"] == "tiny-sd3" and row["params_m"] > 0 and row["seconds"] > 0


def test_exact_is_the_reference_and_window_two_is_exact(rows):
    exact, window_two = rows[0], rows[1]
    assert exact["speedup"] == 1.0 and exact["grad_cosine"] == pytest.approx(1.0)
    assert exact["peak_mem_ratio"] == 1.0 and exact["peak_mem_basis"]
    assert window_two["window"] == 2 and window_two["grad_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert window_two["grad_rel_err"] < 1e-4
    assert window_two["peak_mem_ratio"] > 0


def test_outputs_are_written(rows, tmp_path):
    paths = {"json_path": tmp_path / "out" / "bench.json", "table_path": tmp_path / "bench.md",
             "plot_path": tmp_path / "reward.png"}
    table = write_outputs(rows, **paths)
    assert json.loads(paths["json_path"].read_text()) == json.loads(json.dumps(rows))
    assert paths["table_path"].read_text() == table and "| tiny-sd3 |" in table
    assert paths["plot_path"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
