"""The fuzz suite's quick mode (tests/fuzz/runner.py): no abort, hang, untyped error or corruption.

Long mode is the same runner with more mutations: `python tests/fuzz/runner.py --long` (or
CANDLEWICK_FUZZ_LONG=1); see its docstring for the classification.
"""

import io

from fuzz.runner import FAILING, run


def test_fuzz_quick():
    report = io.StringIO()
    counts, failures = run(seed=0, long_mode=False, out=report)
    print(report.getvalue())
    assert sum(counts.values()) > 150
    assert not failures, report.getvalue()
    assert all(counts.get(k, 0) == 0 for k in FAILING)


def test_a_case_whose_fixture_does_not_load_fails_the_run(monkeypatch):
    """The template family renders through a model loaded in the worker; if that load fails,
    every template input is untried, and the run must say so rather than pass (issue 38)."""
    from fuzz import runner
    from fuzz.cases import Case

    broken = Case("template", "fixture missing", {"kind": "template", "path": "/nonexistent/model.gguf",
                                                  "template": "{{ messages[0].content }}",
                                                  "messages": [{"role": "user", "content": "hi"}]})
    monkeypatch.setattr(runner, "generate", lambda *args: iter([broken]))
    counts, failures = run(seed=0, long_mode=False, out=io.StringIO())
    assert counts["setup-failed"] == 1
    assert [case.label for case, _ in failures] == ["fixture missing"]
