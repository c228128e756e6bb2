"""The documentation holds: every Python example of README.md, CONTRIBUTING.md and docs/*.md runs
as written, each in a fresh interpreter that has imported nothing (``>>>`` blocks as doctests,
output compared, ``...`` matching anything; plain blocks executed in a scratch folder); every
docs page is linked from the README; every relative link points at a file that exists; the
README stays a front page (under 200 lines); nothing refers to documents outside the repository.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [README, ROOT / "CONTRIBUTING.md", *PAGES]
FENCE = re.compile(r"```python\n(.*?)```", flags=re.S)


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


EXAMPLES = [(path, i) for path in DOCUMENTS for i in range(len(FENCE.findall(path.read_text())))]


def test_the_readme_has_python_examples():
    blocks = FENCE.findall(README.read_text())
    assert len(blocks) >= 2 and any(b.lstrip().startswith(">>>") for b in blocks)


DRIVER = """
import doctest, re, sys
name = f"{sys.argv[3]}[{sys.argv[2]}]"
block = re.findall(r"```python\\n(.*?)```", open(sys.argv[1]).read(), flags=re.S)[int(sys.argv[2])]
if block.lstrip().startswith(">>>"):
    test = doctest.DocTestParser().get_doctest(block, {}, name, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    sys.exit(0 if runner.failures == 0 and runner.tries > 0 else 1)
exec(compile(block, name, "exec"), {})
"""


@pytest.mark.parametrize(("path", "index"), EXAMPLES,
                         ids=[f"{_name(p)}[{i}]" for p, i in EXAMPLES])
def test_example_runs(path, index, tmp_path):
    # Each example in a fresh interpreter (in a scratch folder: examples may write files), as a
    # reader runs it: what it uses must be reachable from its own imports, not from modules
    # this test process imported for other tests (``composer.zoo`` after ``import composer``).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(path), str(index), _name(path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) < 200


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(path: Path) -> list[str]:
    # Links in prose only: a fenced block is code, whatever it contains.
    prose = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return LINK.findall(prose)


def test_every_docs_page_is_linked_from_the_readme():
    assert PAGES, "docs/ has no pages"
    linked = {(ROOT / link.split("#")[0]).resolve() for link in _links(README)}
    assert [_name(p) for p in PAGES if p.resolve() not in linked] == []


@pytest.mark.parametrize("path", DOCUMENTS, ids=[_name(p) for p in DOCUMENTS])
def test_relative_links_point_at_files(path):
    broken = []
    for link in _links(path):
        target = link.split("#")[0]
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # an anchor, a URL
            continue
        if not (path.parent / target).exists():
            broken.append(link)
    assert broken == []


# Documents that live outside the repository (the workspace's design and reference notes):
# the repository's own pages hold what the code needs to cite.
OUTSIDE = re.compile("|".join([r"\.\./shared/", r"\bDESIGN(\.md|\s*§)", r"\bREFERENCE(\.md|\s+P\d"
                               r"|\s+section)", r"\bDEVELOPERS\.md"]))


def test_nothing_cites_documents_outside_the_repository():
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "pyproject.toml"]
    for folder in ("docs", "composer", "tools", "zoo", "tests", "bench"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    found = [f"{_name(p)}:{n}" for p in files if p != Path(__file__).resolve()
             for n, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert found == []
