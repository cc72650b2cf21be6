"""The comparison page's generator (``benchmarks.report``): its feature table, and the page
rendered again from the saved results.json, which is the published page to the byte."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from benchmarks import features, report

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_the_feature_table_has_every_scheduler_and_cites_every_source() -> None:
    section = report.features()
    lines = section.splitlines()
    header = next(line for line in lines if line.startswith("| feature |"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == [
        "feature",
        "celery_driftsafe",
        "Celery beat",
        "django-celery-beat",
        "RedBeat",
        "Temporal schedules",
        "Kubernetes CronJob",
    ]
    rows = lines[lines.index(header) + 2 :]
    rows = rows[: next(i for i, line in enumerate(rows) if not line.startswith("| "))]
    assert len(rows) == len(features.ROWS) >= 15
    for line, (feature, cells) in zip(rows, features.ROWS, strict=True):
        parts = [cell.strip() for cell in line.strip("|").split("|")]
        assert parts[0] == feature and len(parts) == 7, line
        assert all(parts[1:]), f"{feature}: an empty cell"
        assert set(cells) == {key for key, _ in features.COLUMNS}
    # every [n] names a listed source, and every source is cited
    cited = {int(n) for n in re.findall(r"\[(\d+)\]", "\n".join(rows))}
    assert cited == set(range(1, len(features.SOURCES) + 1))
    for n, url in enumerate(features.SOURCES, start=1):
        assert f"{n}. <{url}>" in lines
    assert "allow, skip, buffer one, buffer all" in section


def test_the_page_renders_from_results_json_deterministically_and_as_published(
    tmp_path: Path,
) -> None:
    saved = DOCS / report.STATIC / "results.json"
    results = json.loads(saved.read_text())
    images = {name: caption for name, _, caption in report.PLOTS}
    first = report.render_page(results, images)
    assert report.render_page(json.loads(saved.read_text()), images) == first
    assert first.count("## Features") == 1
    # the way the page is rendered again, without plotting: --render-only into a copy of docs/
    static = tmp_path / report.STATIC
    shutil.copytree(DOCS / report.STATIC, static)
    from benchmarks.compare import main

    main(["--render-only", "--docs", str(tmp_path)])
    page = (tmp_path / "comparison.md").read_text()
    assert page == (DOCS / "comparison.md").read_text(), (
        "docs/comparison.md differs from its generator: python -m benchmarks compare --render-only"
    )
    assert page == first
    for name in images:  # linked as they are: none drawn again
        assert (static / name).read_bytes() == (DOCS / report.STATIC / name).read_bytes()
