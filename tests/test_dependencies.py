"""Declared dependency ranges leave out versions with known code-execution bugs."""
import os
import re

from packaging.requirements import Requirement

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _requirement(name):
    with open(os.path.join(REPO, "setup.py")) as f:
        found = re.findall(r'"(' + name + r'[<>=!~][^"]*)"', f.read())
    assert len(found) == 1, found
    return Requirement(found[0])


def test_pyarrow_excludes_the_versions_of_cve_2023_47248():
    """pyarrow 0.14.0 to 14.0.0 deserialise untrusted IPC and Parquet data unsafely
    (arbitrary code execution); 14.0.1 fixed it."""
    specifier = _requirement("pyarrow").specifier
    assert not specifier.contains("14.0.0") and not specifier.contains("13.0.0")
    assert specifier.contains("14.0.1") and specifier.contains("25.0.1")
