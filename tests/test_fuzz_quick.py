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
