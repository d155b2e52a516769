"""warmer.api, as a release pipeline uses it: the README's example runs as written (paths aside)."""

import re

import pytest

from tests.conftest import REPO, tiny_recipe, write_tiny_recipe
from warmer import api, build, restore
from warmer.errors import UsageError, WarmerError
from warmer.store import open_store


def _readme_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("### Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_bakes_an_image(tmp_path, packed, monkeypatch):
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, packed("a").path)
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    code = _readme_example()
    assignment = re.search(r"RECIPE, STORE, ROOT, GPUS = \(.*?\)\n", code, re.S).group(0)
    code = code.replace(assignment, f"RECIPE, STORE, ROOT, GPUS = {str(recipe)!r}, {store.url!r}, "
                                    f"{str(tmp_path / 'cache' / 'tiny')!r}, None\n")
    code = code.replace('"/etc/warmer/vllm.env"', repr(str(tmp_path / "vllm.env")))
    printed = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
    exec(compile(code, "README.md", "exec"), {})
    assert printed and printed[0].startswith("hit: key ")
    assert restore.active(tmp_path / "cache" / "tiny") is not None
    assert "export VLLM_CACHE_ROOT=" in (tmp_path / "vllm.env").read_text()


def test_a_miss_is_a_result_and_errors_share_one_base(tmp_path):
    got = api.fetch(tiny_recipe(), f"file://{tmp_path / 'empty'}", tmp_path / "root")
    assert not got.hit and got.status == "miss" and got.warnings
    with pytest.raises(UsageError) as e:
        api.recipe(tmp_path / "absent.toml")
    assert isinstance(e.value, WarmerError) and e.value.exit_code == 2


def test_a_bad_argument_a_pipeline_passes_is_a_usage_error(tmp_path):
    """The CLI's parser checks these; a pipeline calling the API got ValueError, which its
    `except WarmerError` did not catch."""
    for call in (lambda: api.fetch(tiny_recipe(), f"file://{tmp_path}", tmp_path / "root", deadline=0),
                 lambda: api.ls(f"file://{tmp_path}", deadline=-1),
                 lambda: api.pack(tmp_path, tiny_recipe(), tmp_path / "a.tar.zst", level=99)):
        with pytest.raises(UsageError, match="deadline 0|deadline -1|zstd level 99: give 1 to 22"):
            call()


def test_ls_by_recipe_file_needs_only_its_name(tmp_path, packed, monkeypatch):
    """`warmer ls --store S --recipe manifests/models/X.toml` on an operator's laptop: the recipe's
    ${VAR}s (the nodes' model path) are not set there, and listing a store needs its name alone."""
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, packed("a").path)
    recipe = write_tiny_recipe(tmp_path / "tiny.toml", model_path="${NODE_MODEL_DIR}/tiny")
    monkeypatch.delenv("NODE_MODEL_DIR", raising=False)
    with pytest.raises(UsageError, match="NODE_MODEL_DIR"):
        api.recipe(recipe)  # what fetch or build would say
    assert [r.recipe for r in api.ls(store.url, recipe).rows] == ["tiny"]
    assert api.ls(store.url, "tiny").rows == api.ls(store.url, recipe).rows
    with pytest.raises(UsageError, match="does not exist"):
        api.ls(store.url, tmp_path / "absent.toml")
