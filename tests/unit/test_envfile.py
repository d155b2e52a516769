"""The env file reads back as written: what render() writes, parse() (serve and doctor, after
reading the file as text) and sh (the Deployment) read as the same values, or render() refuses it,
naming the variable and the fix."""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import sys
import threading

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


class _Engine(http.server.BaseHTTPRequestHandler):
    """Stands in for dockerd, which cannot run here: it records the Env of the container the real
    docker client asks it to create (the client parses --env-file itself), then refuses it."""

    created: list[list[str]] = []

    def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Api-Version", "1.47")
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):
        self._reply(200, b"OK", "text/plain")

    def do_GET(self):
        self._reply(200, b"OK", "text/plain") if "_ping" in self.path else self._reply(404, b'{"message":"no"}')

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if "/containers/create" in self.path:
            self.created.append(json.loads(body)["Env"])
        self._reply(500, b'{"message":"recorded, not run"}')

    def log_message(self, *args):
        pass


def docker_reads(path, tmp_path) -> dict[str, str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Engine.created.clear()
    try:
        subprocess.run([shutil.which("docker"), "-H", f"tcp://127.0.0.1:{server.server_address[1]}", "run",
                        "--env-file", str(path), "busybox"], capture_output=True, env={"DOCKER_CONFIG": str(tmp_path)},
                       timeout=60)
    finally:
        server.shutdown()
    assert _Engine.created, "the docker client created no container"
    return dict(line.split("=", 1) for line in _Engine.created[0])


def kubectl_reads(path) -> dict[str, str]:
    out = subprocess.run(["kubectl", "create", "configmap", "x", f"--from-env-file={path}", "--dry-run=client",
                          "-o", "json"], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)["data"]


def test_the_docker_format_is_read_alike_by_docker_kubectl_and_warmer_or_refused(tmp_path):
    """`docker run --env-file` and `kubectl create configmap --from-env-file` keep quotes as part of
    the value, so the dotenv file's '/cache/my root' reached them quoted. The docker format writes
    values verbatim; what they would read otherwise than warmer is refused, naming the fix."""
    carried = {}
    for name, value in AWKWARD.items():
        try:
            EnvFile.of({name: value}).render("docker")
        except EnvFileError as e:  # the fix: what docker's readers take (shell lines they refuse)
            assert f"env {name} holds" in str(e) and "change the value, or write --env-format shell and source" in str(e)
            assert "\n" in value or value != value.rstrip(), name  # nothing it could carry
            continue
        carried[name] = value
    assert {"SPACE", "DOLLAR", "QUOTE", "DQ", "BOTH", "BS", "JSON"} - carried.keys() == {"JSON"}
    f = tmp_path / "vllm.env"
    f.write_bytes(EnvFile.of(carried).render("docker").encode())
    assert read_back(f) == carried
    readers = {"docker": lambda: docker_reads(f, tmp_path), "kubectl": lambda: kubectl_reads(f)}
    ran = [name for name in readers if shutil.which(name)]
    if not ran:
        pytest.skip("neither the docker nor the kubectl client is installed")
    for name in ran:
        got = readers[name]()
        assert {k: got.get(k) for k in carried} == carried, name


def test_a_value_that_is_not_utf8_is_refused_naming_it():
    """A root named in other bytes (os.fsdecode's surrogates) was a UnicodeEncodeError after the
    restore; it is refused when the env is rendered, which fetch does before it fetches."""
    with pytest.raises(EnvFileError, match="env A is not UTF-8 text"):
        EnvFile.of({"A": "/cache/caf\udce9/vllm"}).render("shell")


def test_an_env_file_bind_mounted_on_its_own_is_written_into(tmp_path, packed):
    """`docker run -v ./vllm.env:/out/vllm.env … --env-file /out/vllm.env`: a file that is a mount
    point cannot be replaced by a rename (EBUSY). The restore succeeded, then the command failed with
    exit 1, blaming the directory. The file is written into instead."""
    from tests.conftest import REPO

    host = tmp_path / "host.env"
    host.write_text("# the host's, before\n")
    inside = tmp_path / "out" / "vllm.env"
    inside.parent.mkdir()
    inside.write_text("")
    if subprocess.run(["mount", "--bind", str(host), str(inside)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount a file here (needs root)")
    try:
        out = subprocess.run([sys.executable, "-m", "warmer", "restore", str(packed("a").path), "--root",
                              str(tmp_path / "root"), "--env-file", str(inside)], capture_output=True, text=True,
                             cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stderr
        assert read_back(host)["VLLM_CACHE_ROOT"] == str(tmp_path / "root" / "vllm")  # seen on the host side
        assert not list(inside.parent.glob(".vllm.env.*.tmp"))
    finally:
        subprocess.run(["umount", "-l", str(inside)], check=False)
