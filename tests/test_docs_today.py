"""The documents describe today: dates, session numbers, issue numbers and commit hashes
stand on the results page alone (docs/results.md: each measurement with its date, machine
or card, commit and command); README.md and every other page say how hpcdist works now and
link there for numbers."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = re.compile(r"20\d\d-\d\d-\d\d|\bsession \d+|\bsession\b(?!\.sh)|[Ii]ssue \d+|"
                      r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


def test_only_the_results_page_keeps_dates_sessions_issues_and_commits():
    pages = [os.path.join(ROOT, "README.md")] + [
        os.path.join(ROOT, "docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
        if n.endswith(".md") and n != "results.md"]
    found = []
    for path in pages:
        for i, line in enumerate(open(path), 1):
            for m in NOTEBOOK.finditer(line):
                found.append(f"{os.path.relpath(path, ROOT)}:{i}: {m.group(0)!r} in "
                             f"{line.strip()[:100]!r}")
    assert not found, "\n".join(found)


def test_the_results_page_holds_the_measurements_the_pages_link_to():
    text = open(os.path.join(ROOT, "docs", "results.md")).read()
    for heading in ("## CPU: the GPT step against PyTorch eager",
                    "## DiLoCo over slow links (the cluster in a box)", "## GPU",
                    "### What ran where (date, card, commit)"):
        assert heading in text
