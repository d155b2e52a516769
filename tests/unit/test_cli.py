"""The command line as a person and a pipeline meet it: flags where they type them, usage errors
that say what to type, dry runs that say so, output cut short by `head`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, make_cache_tree, run_warmer, tiny_recipe, write_tiny_recipe
from warmer import build, restore
from warmer.store import open_store


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WARMER_STORE", "WARMER_ROOT")}
    return {**env, **kw}


@pytest.fixture
def store_with_one(tmp_path, packed):
    """A file store holding one published artifact of the tiny recipe."""
    store = open_store(f"file://{tmp_path / 'store'}")
    p = packed("a")
    return store, p, build.publish(store, p.path)


# -- 4. -q after the command ----------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["-q", "--quiet"])
def test_quiet_after_the_command_silences_a_fetch(tmp_path, flag):
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    args = ["fetch", recipe, "--store", f"file://{tmp_path / 'empty'}", "--root", tmp_path / "root"]
    loud = run_warmer(*args)
    assert loud.returncode == 0 and "miss" in loud.stderr, loud.stderr
    quiet = run_warmer(*args, flag)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert quiet.stdout == loud.stdout  # the env is still printed


def test_quiet_after_the_command_is_the_same_as_before_it(tmp_path, store_with_one):
    store, p, _ = store_with_one
    url = f"{store.url}/index/tiny/{p.artifact.key[:12]}"
    before = run_warmer("-q", "rm", url)
    after = run_warmer("rm", url, "-q")
    assert before.returncode == after.returncode == 0, after.stderr
    assert before.stderr == after.stderr == ""  # the dry run's line is progress: quiet drops it


# -- 5. --json covers argparse's errors; --store from the env is not "required" --------------------

@pytest.mark.parametrize("argv", [["ls", "--json", "--no-such-flag"], ["gc", "--store", "file:///x", "--json"],
                                  ["--json", "fetch", "--max-bytes", "lots"]])
def test_json_covers_usage_errors_argparse_finds(argv):
    out = run_warmer(*argv, env=_env())
    assert out.returncode == 2
    doc = json.loads(out.stdout)
    assert doc["kind"] == "usage" and doc["exit_code"] == 2 and doc["error"]
    assert "usage:" in out.stderr


def test_store_is_the_flag_or_the_env_and_usage_says_neither_is_required(tmp_path):
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    missing = run_warmer("build", recipe, "--root", tmp_path / "root", env=_env())
    assert missing.returncode == 2
    assert "--store" in missing.stderr and "WARMER_STORE" in missing.stderr, missing.stderr
    for env in (_env(), _env(WARMER_STORE=f"file://{tmp_path / 's'}")):
        usage = run_warmer("build", "--help", env=env).stdout.split("\n\n")[0]
        assert "[--store URL]" in usage and "[--root ROOT]" in usage, usage
    json_missing = run_warmer("explain", recipe, "--json", env=_env())
    assert json_missing.returncode == 2 and "WARMER_STORE" in json.loads(json_missing.stdout)["error"]


# -- 6. did you mean ------------------------------------------------------------------------------

def test_a_mistyped_command_gets_a_suggestion():
    out = run_warmer("fecth", "x")
    assert out.returncode == 2 and "did you mean fetch?" in out.stderr, out.stderr
    out = run_warmer("matrix", "manifests", "--format", "gihub")
    assert out.returncode == 2 and "did you mean github?" in out.stderr


# -- 7. the env file's path, not the temporary one beside it ----------------------------------------

def test_an_env_file_that_is_a_stream_is_written_into_not_replaced(tmp_path, packed):
    """`--env-file /dev/stdout` (a link to the process's stdout) or /dev/null: as root, replacing
    either by a file would break every later process of the node. Links in tmp_path stand in."""
    p = packed("a")
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    stdout = tmp_path / "stdout"
    stdout.symlink_to("/proc/self/fd/1")
    out = run_warmer("restore", p.path, "--root", tmp_path / "root", "--recipe", recipe, "--env-file", stdout)
    assert out.returncode == 0 and "TORCHINDUCTOR_CACHE_DIR=" in out.stdout, out.stderr
    assert stdout.is_symlink()
    # stdout redirected into a file (`... --env-file /dev/stdout > vllm.env`): the link leads to a
    # regular file, and is still written through, not replaced.
    redirected = tmp_path / "vllm.env"
    with open(redirected, "w") as f:
        out = subprocess.run([sys.executable, "-m", "warmer", "restore", str(p.path), "--root", str(tmp_path / "root"),
                              "--recipe", str(recipe), "--env-file", str(stdout)], stdout=f, stderr=subprocess.PIPE,
                             text=True, cwd=REPO)
    assert out.returncode == 0 and "TORCHINDUCTOR_CACHE_DIR=" in redirected.read_text(), out.stderr
    assert stdout.is_symlink()
    if os.geteuid() == 0:  # a null device of its own (the real one's numbers), as root alone may make
        null = tmp_path / "null"
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        out = run_warmer("restore", p.path, "--root", tmp_path / "root", "--recipe", recipe, "--env-file", null)
        assert out.returncode == 0 and stat.S_ISCHR(os.lstat(null).st_mode), out.stderr
    # A FIFO that no process reads: said at once, not a fetch held until something reads it.
    fifo = tmp_path / "env.fifo"
    os.mkfifo(fifo)
    out = run_warmer("restore", p.path, "--root", tmp_path / "root", "--recipe", recipe, "--env-file", fifo,
                     timeout=60)
    assert out.returncode != 0 and "a FIFO that no process reads" in out.stderr, out.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_an_env_file_that_cannot_be_written_is_named(tmp_path, packed):
    p = packed("a")
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    target = tmp_path / "no-such-dir" / "x.env"
    out = run_warmer("restore", p.path, "--root", tmp_path / "root", "--recipe", recipe, "--env-file", target)
    assert out.returncode == 2 and not (tmp_path / "root").exists()  # said before the restore: the operator's
    assert str(target) in out.stderr and ".tmp" not in out.stderr, out.stderr
    # A directory this user may not write in. Root writes anywhere (CI runs as root): there the CLI
    # drops to nobody once imported, as test_restore_safety.py's test_missing_permissions does.
    base = Path(tempfile.mkdtemp(prefix="warmer-envfile-"))  # pytest's tmp dirs are private to their owner
    try:
        base.chmod(0o755)
        for src, name in ((p.path, "a.tar.zst"), (recipe, "tiny.toml")):
            shutil.copy(src, base / name)
            (base / name).chmod(0o644)
        (base / "work").mkdir()
        if os.geteuid() == 0:
            os.chown(base / "work", 65534, 65534)
        locked = base / "locked"
        locked.mkdir(mode=0o555)
        # Everything is imported first (the recipe's load imports jsonschema): this Python may sit
        # where nobody cannot read, under /root.
        script = ("import os, sys; from pathlib import Path; from warmer import cli, recipe\n"
                  "recipe.load(Path(sys.argv[sys.argv.index('--recipe') + 1]))\n"
                  "if os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
                  "sys.exit(cli.main(sys.argv[1:]))\n")
        out = subprocess.run([sys.executable, "-c", script, "restore", str(base / "a.tar.zst"), "--root",
                              str(base / "work" / "root"), "--recipe", str(base / "tiny.toml"), "--env-file",
                              str(locked / "x.env")], capture_output=True, text=True, cwd=REPO)
        assert out.returncode == 2 and "is not a directory this user can write" in out.stderr, out.stderr
        assert str(locked / "x.env") in out.stderr and ".tmp" not in out.stderr, out.stderr
        assert not (base / "work" / "root").exists()
    finally:
        shutil.rmtree(base)


# -- 9. sizes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("size, ok", [("256GiB", True), ("512MiB", True), ("10GB", True), ("4096", True),
                                      ("1e9", False), ("lots", False), ("10G", False), ("-1", False)])
def test_max_bytes_takes_sizes_with_units(tmp_path, packed, size, ok):
    from warmer import cli
    if ok:
        assert cli.parser().parse_args(["restore", "f", "--root", "r", "--max-bytes", size]).max_bytes == \
            {"256GiB": 256 << 30, "512MiB": 512 << 20, "10GB": 10 ** 10, "4096": 4096}[size]
        return
    out = run_warmer("restore", "f", "--root", tmp_path, "--max-bytes", size)
    assert out.returncode == 2 and "is not a size" in out.stderr and "256GiB" in out.stderr, out.stderr


def test_max_bytes_with_a_unit_is_enforced(tmp_path, packed):
    p = packed("a")
    out = run_warmer("restore", p.path, "--root", tmp_path / "root", "--max-bytes", "1KiB")
    assert out.returncode == 1 and "1024" in out.stderr, out.stderr
    assert not (tmp_path / "root" / "vllm").exists()


# -- 2. rm without --yes is a dry run ---------------------------------------------------------------

def test_rm_without_yes_is_a_dry_run_that_says_what_it_would_do(store_with_one):
    store, p, published = store_with_one
    url = f"{store.url}/index/tiny/{p.artifact.key[:12]}"
    dry = run_warmer("rm", url)
    assert dry.returncode == 0, dry.stderr
    assert "would remove" in dry.stderr and "would be deleted" in dry.stderr and "--yes" in dry.stderr
    assert re.search(r"(?<!would be )deleted", dry.stderr) is None, dry.stderr  # nothing claims it happened
    doc = json.loads(run_warmer("rm", url, "--json").stdout)
    assert doc["dry_run"] is True and doc["would_delete_blob"] is True and "blob_deleted" not in doc
    assert store.get_index("tiny", p.artifact.key) is not None and store.has_blob(published.blob)


# -- 3. ls --recipe FILE, and the roots' ROOT column -------------------------------------------------

def test_ls_takes_the_recipe_file_as_everywhere_else(tmp_path, store_with_one):
    store, p, _ = store_with_one
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    by_file = run_warmer("ls", "--store", store.url, "--recipe", recipe, "--json")
    by_name = run_warmer("ls", "--store", store.url, "--recipe", "tiny", "--json")
    assert by_file.returncode == by_name.returncode == 0, by_file.stderr
    assert [r["key"] for r in json.loads(by_file.stdout)] == [r["key"] for r in json.loads(by_name.stdout)] == \
        [p.artifact.key]
    absent = run_warmer("ls", "--store", store.url, "--recipe", tmp_path / "absent.toml")
    assert absent.returncode == 2 and "absent.toml does not exist" in absent.stderr


def test_ls_root_base_shows_each_root(tmp_path, packed):
    base = tmp_path / "cache"
    restore.restore_file(packed("a").path, base / "tiny")
    (base / "lost+found").mkdir()  # a dedicated disk's, not a root: not listed as one
    out = run_warmer("ls", "--root-base", base)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()
    assert header.split()[:2] == ["RECIPE", "ROOT"] and row.split()[:2] == ["tiny", str(base / "tiny")]


# -- 11. inspect for a person ------------------------------------------------------------------------

def test_inspect_without_json_is_a_summary_and_with_json_the_json(store_with_one):
    store, p, published = store_with_one
    text = run_warmer("inspect", p.path)
    assert text.returncode == 0, text.stderr
    assert not text.stdout.lstrip().startswith("{")
    for want in (p.artifact.key, "recipe:     tiny", p.artifact.created_at, "inductor", "signed:     no"):
        assert want in text.stdout, text.stdout
    entry = run_warmer("inspect", f"{store.url}/index/tiny/{p.artifact.key[:12]}").stdout
    assert f"blob:       {published.blob}" in entry and "published" in entry
    doc = json.loads(run_warmer("inspect", p.path, "--json").stdout)
    assert doc["key"] == p.artifact.key and doc["signed"] is False


# -- 8. a model path that is not there ------------------------------------------------------------------

@pytest.mark.parametrize("command", ["build", "verify"])
def test_a_missing_model_path_is_a_usage_error_before_any_engine(tmp_path, command):
    model = tmp_path / "models" / "absent"
    recipe = write_tiny_recipe(tmp_path / "tiny.toml", model_path=str(model))
    args = [command, recipe, "--root", tmp_path / "root", "--workdir", tmp_path / "work"]
    out = run_warmer(*args, *(["--store", f"file://{tmp_path / 's'}"] if command == "build" else []), timeout=60)
    assert out.returncode == 2, out.stderr
    assert str(model) in out.stderr and "model.path" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "work").exists() or not list((tmp_path / "work").glob("*.log"))  # no engine ran


# -- 15, 16. restore checks the recipe, and writes the env without one ------------------------------------

def test_restore_refuses_another_recipes_env_unless_forced(tmp_path, packed):
    p = packed("a")  # built for tiny_recipe(): max_model_len 128
    other = write_tiny_recipe(tmp_path / "longer.toml", max_model_len=256)
    root, env_file = tmp_path / "root", tmp_path / "vllm.env"
    out = run_warmer("restore", p.path, "--root", root, "--recipe", other, "--env-file", env_file)
    assert out.returncode == 2, out.stderr
    assert "max_model_len" in out.stderr and "128" in out.stderr and "256" in out.stderr and "--force" in out.stderr
    assert not root.exists() and not env_file.exists()  # refused before anything was written
    renamed = tmp_path / "other.toml"
    renamed.write_text(write_tiny_recipe(tmp_path / "t.toml").read_text().replace('name = "tiny"', 'name = "other"'))
    out = run_warmer("restore", p.path, "--root", root, "--recipe", renamed)
    assert out.returncode == 2 and "recipe tiny" in out.stderr and "recipe other" in out.stderr
    forced = run_warmer("restore", p.path, "--root", root, "--recipe", other, "--env-file", env_file, "--force")
    assert forced.returncode == 0, forced.stderr
    assert "--force" in forced.stderr and env_file.exists()
    # -q is errors only: the warning that it restored anyway is not one (the logger's warnings got through)
    quiet = run_warmer("restore", p.path, "--root", tmp_path / "root2", "--recipe", other, "--force", "-q")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_restore_writes_the_env_from_the_artifact_when_no_recipe_is_given(tmp_path, packed):
    p = packed("a")
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    root = tmp_path / "root"
    with_recipe, without = tmp_path / "with.env", tmp_path / "without.env"
    out = run_warmer("restore", p.path, "--root", root, "--recipe", recipe, "--env-file", with_recipe)
    assert out.returncode == 0, out.stderr
    out = run_warmer("restore", p.path, "--root", root, "--env-file", without)
    assert out.returncode == 0, out.stderr
    assert without.read_text() == with_recipe.read_text()
    assert f"VLLM_CACHE_ROOT={root / 'vllm'}" in without.read_text()


def test_restore_prints_an_env_a_shell_can_eval(tmp_path, packed):
    """`eval "$(warmer restore FILE --root DIR --recipe R)"`, as for fetch: stdout holds the export
    lines alone (the report goes to stderr); without them stdout still has the report."""
    p = packed("a")
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    root = tmp_path / "root"
    script = 'set -e; eval "$("$@")"; printf %s "$VLLM_CACHE_ROOT"'
    out = subprocess.run(["bash", "-c", script, "-", sys.executable, "-m", "warmer", "restore", str(p.path),
                          "--root", str(root), "--recipe", str(recipe)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout == str(root / "vllm"), out.stderr
    assert "status: restored" in out.stderr
    plain = run_warmer("restore", p.path, "--root", tmp_path / "root2")
    assert plain.returncode == 0 and "status: restored" in plain.stdout, plain.stderr


def test_a_recipe_rebuilt_from_an_artifact_is_the_recipe_it_was_built_with(packed):
    from warmer.recipe import Recipe

    for recipe in (tiny_recipe(), tiny_recipe(max_num_seqs=4)):
        art = packed(f"r{len(recipe.engine)}", recipe=recipe).artifact
        assert Recipe.from_artifact(art).digest() == art.recipe.digest == recipe.digest()


# -- 17. stdout closed early -----------------------------------------------------------------------

def _closed_stdout(*args) -> subprocess.CompletedProcess:
    """The CLI with a stdout whose reader is gone before it writes (as after `| head -c1`)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "warmer", *map(str, args)], stdout=write,
                              stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=120)
    finally:
        os.close(write)
    return proc


@pytest.mark.parametrize("command", ["ls", "ls-json", "inspect", "fetch"])
def test_a_closed_stdout_ends_quietly_as_coreutils_do(tmp_path, store_with_one, command):
    store, p, _ = store_with_one
    recipe = write_tiny_recipe(tmp_path / "tiny.toml", model_path="/models/other")  # a miss: the env goes to stdout
    args = {"ls": ["ls", "--store", store.url], "ls-json": ["ls", "--store", store.url, "--json"],
            "inspect": ["inspect", p.path], "fetch": ["fetch", recipe, "--store", store.url, "--root",
                                                      tmp_path / "root", "-q"]}[command]
    proc = _closed_stdout(*args)
    assert proc.stderr == "", proc.stderr  # no traceback, no error line
    assert proc.returncode == -signal.SIGPIPE  # the shell says 141, as for `ls | head`
    yes = subprocess.run("yes | head -c1 >/dev/null; echo ${PIPESTATUS[0]}", shell=True, executable="/bin/bash",
                         capture_output=True, text=True)
    assert yes.stdout.strip() == str(128 + signal.SIGPIPE)  # what coreutils do, for comparison


def test_a_store_that_is_not_there_is_still_an_error_with_a_closed_stdout(tmp_path):
    proc = _closed_stdout("ls", "--store", f"file://{tmp_path / 'absent'}")
    assert proc.returncode == 1 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


# -- the commands are warmer/cli's modules ------------------------------------------------------------

def test_the_commands_are_found_in_the_package_in_the_order_help_lists_them():
    from warmer import cli
    found = cli.commands()
    assert [cli.name_of(m) for m in found] == [
        "fingerprint", "explain", "build", "pack", "publish", "fetch", "restore", "verify", "flashinfer-check",
        "inspect", "ls", "gc", "rm", "matrix", "serve", "doctor"]
    assert len({m.ORDER for m in found}) == len(found) and all(m.HELP for m in found)


def test_a_command_imports_no_other_commands_module_and_its_usage_errors_show_them_all():
    code = ("import sys\nfrom warmer.cli import main\ntry:\n    main(['fetch', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('warmer.cli')), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stderr.strip() == "['warmer.cli', 'warmer.cli.fetch', 'warmer.cli.render']", out.stderr
    # An error argparse reports at the top (an unknown flag) still names every command in its usage line.
    bad = run_warmer("fetch", "--no-such-flag")
    assert bad.returncode == 2 and "{fingerprint,explain,build," in bad.stderr and ",doctor}" in bad.stderr, bad.stderr


# -- an env file fetch cannot write is a usage error before the fetch; a recipe path that is a folder --

def _recipe_with_env(tmp_path, line: str) -> Path:
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    recipe.write_text(recipe.read_text().replace('VLLM_USE_AOT_COMPILE = "0"', f'VLLM_USE_AOT_COMPILE = "0"\n{line}'))
    return recipe


def test_fetch_refuses_a_value_dotenv_cannot_carry_before_fetching_and_shell_carries_it(tmp_path):
    recipe = _recipe_with_env(tmp_path, 'X_HEADERS = """X-A: 1\nX-B: it\'s $2"""')
    root, env_file = tmp_path / "root", tmp_path / "vllm.env"
    args = ["fetch", recipe, "--store", f"file://{tmp_path / 'empty'}", "--root", root, "--env-file", env_file]
    refused = run_warmer(*args, env=_env())  # the default format: dotenv
    assert refused.returncode == 2, refused.stderr
    assert "env X_HEADERS holds a newline" in refused.stderr and "use --env-format shell" in refused.stderr
    assert not root.exists() and not env_file.exists()  # nothing fetched, nothing written
    shell = run_warmer(*args, "--env-format", "shell", env=_env())
    assert shell.returncode == 0 and "miss" in shell.stderr, shell.stderr  # a miss never fails the pod
    # what serve and doctor read back of the file fetch just wrote
    from warmer.envfile import EnvFile
    assert EnvFile.parse(env_file.read_text(), str(env_file))["X_HEADERS"] == "X-A: 1\nX-B: it's $2"


def test_restore_refuses_a_value_dotenv_cannot_carry_before_restoring(tmp_path):
    """As fetch: the root was activated first, then no env file written, exit 1."""
    from warmer.recipe import load

    recipe = _recipe_with_env(tmp_path, 'X_HEADERS = """X-A: 1\nX-B: 2"""')
    make_cache_tree(tmp_path / "src")
    art = tmp_path / "a.tar.zst"
    build.pack_root(tmp_path / "src", load(recipe), art)
    root, env_file = tmp_path / "root", tmp_path / "vllm.env"
    args = ["restore", art, "--root", root, "--recipe", recipe, "--env-file", env_file]
    refused = run_warmer(*args, env=_env())
    assert refused.returncode == 2, refused.stderr
    assert "env X_HEADERS holds a newline" in refused.stderr and "use --env-format shell" in refused.stderr
    assert not root.exists() and not env_file.exists()
    without = [a for a in args if a not in ("--recipe", recipe)]  # the env for the artifact's own recipe
    refused = run_warmer(*without, env=_env())
    assert refused.returncode == 2 and "env X_HEADERS holds a newline" in refused.stderr, refused.stderr
    assert not root.exists() and not env_file.exists()
    shell = run_warmer(*args, "--env-format", "shell", env=_env())
    assert shell.returncode == 0 and restore.active(root) is not None, shell.stderr


def test_an_env_file_fetch_could_not_write_is_refused_before_fetching(tmp_path):
    """A root named in bytes that are not UTF-8 was a traceback once the root was restored; an
    --env-file that is a directory blamed its (writable) parent."""
    recipe, store = write_tiny_recipe(tmp_path / "tiny.toml"), f"file://{tmp_path / 'empty'}"
    root = os.fsdecode(bytes(tmp_path) + b"/caf\xe9")
    out = run_warmer("fetch", recipe, "--store", store, "--root", root, "--env-file", tmp_path / "vllm.env",
                     "--env-format", "shell", env=_env())
    assert out.returncode == 2 and "is not UTF-8 text" in out.stderr, out.stderr
    assert not os.path.exists(root)
    out = run_warmer("fetch", recipe, "--store", store, "--root", root, env=_env())  # export lines on stdout
    assert out.returncode == 2 and "is not UTF-8 text" in out.stderr and not os.path.exists(root), out.stderr
    out = run_warmer("fetch", recipe, "--store", store, "--root", tmp_path / "root", "--env-file", tmp_path, env=_env())
    assert out.returncode == 2 and f"--env-file {tmp_path} is a directory" in out.stderr, out.stderr


def test_fetch_writes_a_quote_into_a_dotenv_file_after_a_miss(tmp_path):
    recipe = _recipe_with_env(tmp_path, "X_NOTE = \"it's\"")
    env_file = tmp_path / "vllm.env"
    out = run_warmer("fetch", recipe, "--store", f"file://{tmp_path / 'empty'}", "--root", tmp_path / "root",
                     "--env-file", env_file, env=_env())
    assert out.returncode == 0, out.stderr
    got = subprocess.run(["sh", "-c", f'. "{env_file}"; printf %s "$X_NOTE"'], capture_output=True, text=True)
    assert got.stdout == "it's"


@pytest.mark.parametrize("command", [["fetch", "--store", "file:///nowhere", "--root", "/nowhere"],
                                     ["serve", "--root", "/nowhere", "--dry-run"],
                                     ["explain", "--store", "file:///nowhere"]])
def test_a_recipe_path_that_is_a_directory_is_a_usage_error_naming_it(tmp_path, command):
    out = run_warmer(command[0], tmp_path, *command[1:], "--json", env=_env())
    doc = json.loads(out.stdout)
    assert out.returncode == 2 and doc["kind"] == "usage", out.stdout
    assert doc["error"].startswith(f"recipe {tmp_path} is a directory"), doc["error"]


def test_a_build_that_fails_verify_is_one_json_document(tmp_path, monkeypatch, capsys):
    """CI reads `warmer build --json` with one json.loads: a build refused for its recompiles says
    its error and what it measured in one object, not two documents one after the other."""
    from warmer import api, cli

    measured = build.BuildResult("tiny", "ab" * 32, "file:///s", "built", files=5)

    def refused(*args, **kw):
        raise build.BuildError("verify found 3 recompiled file(s): not publishing", measured)

    monkeypatch.setattr(api, "build", refused)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main's SIGTERM handler stays out of pytest
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    code = cli.main(["build", str(recipe), "--store", f"file://{tmp_path / 's'}", "--root", str(tmp_path / "r"),
                     "--json"])
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert code == doc["exit_code"] == 1 and doc["kind"] == "error" and "recompiled" in doc["error"]
    assert doc["report"] == measured.to_json()
    cli.main(["build", str(recipe), "--store", f"file://{tmp_path / 's'}", "--root", str(tmp_path / "r")])
    assert "recipe tiny  key abababababababab" in capsys.readouterr().out  # a person still reads the report


def test_a_bug_under_json_is_still_one_json_document_and_its_traceback(tmp_path, monkeypatch, capsys):
    """A script reading `--json` gets an object naming the failure even when warmer itself fails
    (a bug: here an exception no command expects, standing in for one); the traceback goes to stderr,
    and without --json it is Python's as ever."""
    from warmer import api, cli

    def broken(*args, **kw):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(api, "ls", broken)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main's SIGTERM handler stays out of pytest
    code = cli.main(["ls", "--store", f"file://{tmp_path}", "--json"])
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert code == doc["exit_code"] == 1 and doc["kind"] == "internal"
    assert doc["error"] == "unexpected ZeroDivisionError: division by zero (a bug in warmer)"
    assert "Traceback" in out.err and "in broken" in out.err
    with pytest.raises(ZeroDivisionError):
        cli.main(["ls", "--store", f"file://{tmp_path}"])


def test_help_shows_env_defaults_that_hold_a_percent_sign():
    """argparse %-formats help texts: an env value with a % in it (an URL-escaped prefix) crashed
    --help, where each env-backed flag shows its value now."""
    env = {**os.environ, "WARMER_STORE": "s3://bucket/a%20b", "WARMER_ROOT": "/cache/%d", "WARMER_OWNER": "1000:%s"}
    out = run_warmer("fetch", "--help", env=env)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "now s3://bucket/a%20b" in text and "now /cache/%d" in text and "now 1000:%s" in text


def test_a_fetch_whose_stderr_is_gone_still_writes_its_env_and_result(tmp_path, store_with_one):
    """A log pipe that died (its reader gone) or stderr closed at start (`2>&-`): the fetch restored
    its root, then died of the broken pipe on its report (SIGPIPE: no env file, nothing on stdout),
    or wrote a traceback into stdout's JSON. What it says on stderr is at best now."""
    store, _, _ = store_with_one
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    argv = [sys.executable, "-m", "warmer", "fetch", str(recipe), "--store", store.url, "--json"]
    read, write = os.pipe()
    os.close(read)  # no reader: every write to it fails with EPIPE
    try:
        gone = subprocess.run([*argv, "--root", str(tmp_path / "a"), "--env-file", str(tmp_path / "a.env")],
                              stdout=subprocess.PIPE, stderr=write, text=True, cwd=REPO, timeout=120)
    finally:
        os.close(write)
    assert gone.returncode == 0 and (tmp_path / "a.env").is_file()
    assert json.loads(gone.stdout)["status"] == "hit"
    closed = subprocess.run([*argv, "--root", str(tmp_path / "b")], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            timeout=120, preexec_fn=lambda: os.close(2))
    assert closed.returncode == 0 and json.loads(closed.stdout)["status"] == "hit", closed.stdout


@pytest.mark.parametrize("level", ["23", "0", "-5", "three"])
def test_a_pack_level_zstd_does_not_have_is_a_usage_error(tmp_path, level):
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    make_cache_tree(tmp_path / "root")
    out = run_warmer("pack", tmp_path / "root", "--recipe", recipe, "-o", tmp_path / "a.tar.zst", "--level", level)
    assert out.returncode == 2 and "not a zstd level" in out.stderr and "Traceback" not in out.stderr, out.stderr
