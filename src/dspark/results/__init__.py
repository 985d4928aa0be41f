"""The curated record of results: results/<question>/ holds the current report(s) of one question (front matter
on top), the sweep's ledger and claims where it is a sweep, hand-written notes, and archive/ for superseded
versions a current claim cites. `python -m dspark.results` (`make results`) regenerates every sweep report from
its ledger and writes results/INDEX.md; `dspark.results.checks` holds what tests/test_results.py asserts.
"""

from dspark.results.build import build
from dspark.results.index import render_index

__all__ = ["build", "render_index"]
