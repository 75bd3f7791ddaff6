"""BENCHMARKS.md against the results it cites (issue 38): every section names the JSON under
`benches/results/` its figures come from, or says plainly that they are not reproducible from a
stored file; every file it names exists; and the table the review found out of step with its
JSON ("Streams beside a long prompt") is checked number by number."""

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC = (REPO / "BENCHMARKS.md").read_text()
RESULTS = REPO / "benches" / "results"
NOT_STORED = "not reproducible from a stored file"


def sections():
    """The `## ` sections of the document (each with its `### ` subsections), title -> text."""
    parts = re.split(r"^## ", DOC, flags=re.M)[1:]
    return {p.splitlines()[0]: p for p in parts}


def test_the_document_has_sections():
    # Guards the split below: a change of heading style would otherwise leave nothing to check.
    assert len(sections()) >= 20


@pytest.mark.parametrize("title", sorted(sections()))
def test_each_section_names_its_json_or_says_it_has_none(title):
    text = " ".join(sections()[title].split())  # a phrase may be broken across lines
    names_json = any((RESULTS / n).is_file() for n in re.findall(r"([\w.-]+\.(?:json|txt))`", text))
    assert names_json or NOT_STORED in text.lower(), f"section {title!r} cites no stored result and does not say so"


def test_every_results_file_named_exists():
    named = set(re.findall(r"benches/results/([\w.-]+\.(?:json|txt))", DOC))
    named |= set(re.findall(r"`([\w.-]+\.json)`", DOC))  # bare names beside a full path
    # Not results: `moe.py`'s default output, named as never kept, and a model's tokenizer file.
    named -= {"moe.json", "tokenizer.json"}
    missing = sorted(n for n in named if not (RESULTS / n).exists())
    assert not missing, f"BENCHMARKS.md names results that are not in benches/results/: {missing}"


def written(cell):
    """The numbers of a table cell as written, with the decimals each was written with."""
    return [(float(m.replace(",", "")), len(m.split(".")[1]) if "." in m else 0)
            for m in re.findall(r"\d[\d,]*(?:\.\d+)?", cell)]


def test_streams_beside_a_long_prompt_match_engine_prefill_json():
    text = next(t for title, t in sections().items() if title.startswith("Streams beside a long prompt"))
    assert "benches/results/engine_prefill.json" in text
    rows = {r["prefill_chunk"]: r for r in json.loads((RESULTS / "engine_prefill.json").read_text())["rows"]}
    seen = 0
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0] or cells[0].startswith(("`", "-")):
            continue
        chunk = None if cells[0].startswith("None") else int(written(cells[0])[0][0])
        row = rows[chunk]
        for cell, key, scale in ((cells[1], "itl_p50_ms", 1), (cells[2], "itl_p99_ms", 1),
                                 (cells[3], "long_ttft_s", 1)):
            value, decimals = written(cell)[0]
            assert value == round(row[key] * scale, decimals), (chunk, key, cell, row[key])
        seen += 1
    assert seen == 3
    # The prose's reading of the times to first token must agree with them too.
    chunked = [rows[128]["long_ttft_s"], rows[512]["long_ttft_s"]]
    whole = rows[None]["long_ttft_s"]
    assert max(chunked) / whole - 1 < 0.01 and "under 1%" in " ".join(text.split())
