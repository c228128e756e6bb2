"""Every Python example of the README runs as written: ``>>>`` blocks as doctests (output
compared, ``...`` matches anything), plain blocks executed in a scratch folder."""

import doctest
import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2 and any(b.lstrip().startswith(">>>") for b in BLOCKS)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path):
    block = BLOCKS[index]
    cwd = os.getcwd()
    os.chdir(tmp_path)  # examples may write files (composer.save(model, "ckpt"))
    try:
        if block.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(block, {}, f"README[{index}]", None, 0)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
            runner.run(test)
            assert runner.failures == 0 and runner.tries > 0
        else:
            exec(compile(block, f"README[{index}]", "exec"), {})
    finally:
        os.chdir(cwd)
