"""`tools.profiling.bulk_ids`: a bulk request's worker ids, unpacked and packed both ways."""

from __future__ import annotations

import json

import pytest

from tools.profiling import bulk_ids


def test_both_ways_are_timed_on_one_request_of_the_asked_size(tmp_path, capsys):
    out = tmp_path / "bulk_ids.json"
    assert bulk_ids.main(["--texts", "12", "--low", "20", "--high", "40", "--repeats", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].endswith("--repeats 3 --out " + str(out))
    assert 12 * 20 <= result["workload"]["tokens"] <= 12 * 40  # make_texts' lengths include the specials
    for way in ("int32_views", "int_lists"):
        row = result["per_request"][way]
        assert row["total_ms"] == pytest.approx(row["unpack_ms"] + row["pack_ms"], abs=1.5e-3)  # each rounded
        assert row["total_ms"] > 0
    assert json.loads(capsys.readouterr().out) == result
