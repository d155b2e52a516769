"""The env file reads back as written: what render() writes, parse() (serve and doctor, after
reading the file as text) and sh (the Deployment) read as the same values, or render() refuses it,
naming the variable and the fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from warmer.envfile import EnvFile, EnvFileError

# Values a recipe's [env] may hold: text, tabs and newlines; paths with spaces or quotes.
AWKWARD = {
    "SPACE": "/cache/my root/vllm", "DOLLAR": "$HOME/x", "QUOTE": "it's", "DQ": 'say "hi"', "BOTH": "it's $HOME",
    "BS": "a\\b", "HASH": "#not a comment", "EMPTY": "", "TRAIL": "x ", "EQ": "a=b", "TAB": "a\tb", "UTF8": "é 日本",
    "NL": "line1\nline2", "NL_END": "x\n", "NL_LOOKS_LIKE_LINES": "a\nexport B=1\n# c\n  d  ",
    "QUOTES_NL": "it's\n'quoted'\n", "DQ_NL": 'a "\n b', "JSON": '{\n  "k": ["v"]\n}', "LAST": "after them all",
}
# What no env file carries: control characters but tab and newline, Unicode's line separators.
UNSAFE = ["a\rb", "a\r\nb", "a\vb", "a\fb", "a\x1bb", "a\x1cb", "a\x7fb", "a\x85b", "a\u2028b", "a\u2029b"]


def read_back(path) -> dict[str, str]:
    """The file as serve and doctor read it: as text (Python's text mode), then parse()."""
    return EnvFile.parse(path.read_text(errors="replace"), str(path)).vars


def sourced(path) -> dict[str, str]:
    """The variables as sh sources the file (`set -a; . FILE`), as the shipped Deployment does."""
    dump = f"{sys.executable} -c 'import json, os; print(json.dumps(dict(os.environ)))'"
    out = subprocess.run(["sh", "-c", f'set -a; . "{path}"; set +a; exec {dump}'], capture_output=True, env={},
                         check=True)
    return json.loads(out.stdout)


def test_the_shell_format_carries_any_recipe_value_and_reads_back_the_same(tmp_path):
    f = tmp_path / "vllm.env"
    f.write_bytes(EnvFile.of(AWKWARD).render("shell").encode())  # as api.write_env writes it
    assert read_back(f) == AWKWARD
    got = sourced(f)
    assert {k: got.get(k) for k in AWKWARD} == AWKWARD


@pytest.mark.parametrize("name", AWKWARD)
def test_a_dotenv_file_reads_back_what_it_holds_or_refuses_it_naming_the_fix(tmp_path, name):
    value = AWKWARD[name]
    try:
        text = EnvFile.of({name: value}).render("dotenv")
    except EnvFileError as e:
        assert f"env {name} holds" in str(e) and "use --env-format shell" in str(e)
        assert "\n" in value or ("'" in value and "$" in value), name  # nothing it could carry
        return
    f = tmp_path / "vllm.env"
    f.write_bytes(text.encode())
    assert read_back(f) == {name: value}
    assert sourced(f).get(name) == value


def test_a_quote_alone_is_carried_by_dotenv():
    assert EnvFile.parse(EnvFile.of({"A": "it's"}).render("dotenv"))["A"] == "it's"


def test_a_trailing_newline_is_neither_a_name_nor_lost_from_a_value():
    with pytest.raises(EnvFileError, match="not a valid variable name"):
        EnvFile.of({"A\n": "1"})
    with pytest.raises(EnvFileError, match="env A holds a newline"):
        EnvFile.of({"A": "x\n"}).render("dotenv")


@pytest.mark.parametrize("fmt", ["shell", "dotenv"])
@pytest.mark.parametrize("value", UNSAFE, ids=ascii)
def test_a_control_character_is_refused_in_every_format_naming_it(fmt, value):
    with pytest.raises(EnvFileError, match=r"env A holds U\+[0-9A-F]{4}, a control character or line separator"):
        EnvFile.of({"A": value}).render(fmt)


def test_an_unterminated_quote_names_the_line_it_starts_on():
    text = "A=1\nexport B='x\n" + "C=2\n" * 50_000
    with pytest.raises(EnvFileError, match=r"env file:2: No closing quotation"):
        EnvFile.parse(text)
