#!/bin/sh
# Install warmer on a node from the wheel you published, checked against its sha256 before pip
# reads it, into the Python environment vLLM serves from (the fingerprint reads its library
# versions). Never `pip install warmer` from a package index: no index serves a `warmer`
# distribution, and whoever registered the name would run code here, as root. cloud-init.yaml
# embeds this file; by hand, as root:
#
#   env WARMER_WHEEL_URL=https://.../warmer-0.1.0-py3-none-any.whl WARMER_WHEEL_SHA256=... sh install-warmer.sh
#
# WARMER_WHEEL_URL: where the wheel is (any URL curl reads; its last path segment is the wheel's file
#   name, which pip needs). WARMER_WHEEL_SHA256: the wheel's sha256 (`sha256sum` of the file you
#   published). README, "Where it runs", says how to build and publish it.
# VLLM_PYTHON: the Python vLLM serves with (default /opt/vllm/bin/python).
# WARMER_LINK: where the `warmer` command goes on PATH (default /usr/local/bin/warmer).
set -eu
url=${WARMER_WHEEL_URL:?set WARMER_WHEEL_URL: where the warmer wheel you published is}
sha256=${WARMER_WHEEL_SHA256:?set WARMER_WHEEL_SHA256: the sha256 of that wheel}
python=${VLLM_PYTHON:-/opt/vllm/bin/python}
link=${WARMER_LINK:-/usr/local/bin/warmer}

name=${url%%[?#]*}
name=${name##*/}
case $name in
  warmer-*.whl) ;;
  *) echo "install-warmer: $url does not end in a warmer wheel's file name (warmer-VERSION-py3-none-any.whl)" >&2; exit 2 ;;
esac
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
curl -fsSL --retry 3 -o "$dir/$name" "$url"
# The pin: pip never sees a file whose digest differs.
echo "$sha256  $dir/$name" | sha256sum -c --quiet -
# The file only: its dependencies (boto3, zstandard, ...) come from the index pip is set up with.
"$python" -m pip install --no-cache-dir "$dir/$name"
# pip puts the command in the interpreter's scripts directory: a venv's bin/, but /usr/local/bin
# for Debian's and Ubuntu's /usr/bin/python3. Where that is the link itself, there is nothing to link.
installed="$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/warmer"
[ "$installed" = "$link" ] || ln -sf "$installed" "$link"
"$link" --version
