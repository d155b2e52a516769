"""The examples in docstrings are tests: where an example explains faster than prose, it must hold."""

import doctest

import pytest

from warmer import compat, fingerprint


@pytest.mark.parametrize("module", [compat, fingerprint], ids=lambda m: m.__name__)
def test_docstring_examples_hold(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 2 and result.failed == 0, result
