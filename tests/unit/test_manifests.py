"""Every YAML in manifests/ parses and has the fields its kind requires; the manifests agree with
the recipes and the SKU catalogue they run (no cluster, no Docker engine: parsing and checks)."""

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from warmer import compat, matrix, serving
from warmer.recipe import load

MANIFESTS = REPO / "manifests"
# Kubernetes objects and GitHub workflows; cloud-init user data (#cloud-config) is checked on its own.
YAMLS = sorted(p for ext in ("yaml", "yml") for p in MANIFESTS.rglob(f"*.{ext}")
               if not p.read_text().startswith("#cloud-config"))
SKUS = matrix.load_skus(MANIFESTS / "skus.toml")
GPU_PRODUCTS = {s.node_selector.get("nvidia.com/gpu.product") for s in SKUS.values()} - {None}


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in YAMLS for d in docs(p) if "apiVersion" in d]


def of_kind(kind: str) -> list[tuple[Path, dict]]:
    return [(p, d) for p, d in k8s_docs() if d["kind"] == kind]


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of command and args: $(VAR) from the container's env, $$ escapes,
    and a reference to an undefined var stays as written."""
    return _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def container_env(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def init_container(name: str = "warmer-fetch") -> tuple[dict, dict]:
    """(the Deployment, its init container) of manifests/k8s/."""
    for _, d in of_kind("Deployment"):
        for c in d["spec"]["template"]["spec"].get("initContainers", []):
            if c["name"] == name:
                return d, c
    raise AssertionError(f"no Deployment in manifests/k8s has an init container {name}")


def command_of(c: dict, **env_overrides) -> list[str]:
    """The init container's argv as the kubelet runs it, with env values overridden (bucket, paths)."""
    env = {**container_env(c), **env_overrides}
    return [k8s_expand(a, env) for a in c.get("command", []) + c.get("args", [])]


def pod_spec(d: dict) -> dict:
    return d["spec"]["template"]["spec"] if d["kind"] in ("Deployment", "Job", "DaemonSet") else d["spec"]


# --- every YAML parses and has what its kind requires ------------------------------------------

def test_manifests_exist_for_each_user():
    names = {p.relative_to(MANIFESTS).as_posix() for p in YAMLS}
    assert any(n.startswith("ci/") for n in names if docs(MANIFESTS / n) and "jobs" in docs(MANIFESTS / n)[0])
    assert of_kind("Job") and of_kind("Deployment") and (MANIFESTS / "docker" / "Dockerfile").is_file()


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.relative_to(MANIFESTS).as_posix())
def test_yaml_parses_into_known_kinds(path):
    found = docs(path)
    assert found, f"{path} is empty"
    for d in found:
        assert isinstance(d, dict)
        if "jobs" in d:  # a GitHub Actions workflow
            continue
        assert {"apiVersion", "kind", "metadata"} <= set(d), f"{path}: {sorted(d)}"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"]), d["metadata"]["name"]
        assert d["kind"] in ("Deployment", "Job", "Service", "ServiceAccount", "DaemonSet"), d["kind"]


WORKLOADS = [x for x in k8s_docs() if x[1]["kind"] in ("Deployment", "Job", "DaemonSet")]


@pytest.mark.parametrize("path,doc", WORKLOADS, ids=lambda x: getattr(x, "name", None) or x["kind"])
def test_workloads_have_the_fields_their_kind_requires(path, doc):
    spec = doc["spec"]
    if doc["kind"] in ("Deployment", "DaemonSet"):
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
    else:
        assert spec["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    ps = pod_spec(doc)
    volumes = {v["name"]: v for v in ps.get("volumes", [])}
    assert len(volumes) == len(ps.get("volumes", [])), "volume names must be unique"
    for c in ps.get("initContainers", []) + ps["containers"]:
        assert c["name"] and c["image"] and (c.get("command") or c.get("args"))
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, f"{c['name']} mounts undefined volume {m['name']}"
            assert m["mountPath"].startswith("/")
        for e in c.get("env", []):
            assert set(e) & {"value", "valueFrom"}, e
        # Every $(VAR) in the command is defined in the container's env: the kubelet would
        # pass an undefined one through as text.
        for arg in c.get("command", []) + c.get("args", []):
            for m in _REF.finditer(arg):
                assert m.group(0) == "$$" or m.group(1) in container_env(c), f"{c['name']}: {m.group(0)}"
    for v in volumes.values():
        assert set(v) & {"hostPath", "emptyDir", "configMap", "secret", "persistentVolumeClaim"}, v
    # Scheduled onto a GPU SKU of the catalogue, asking for GPUs (a prefetch DaemonSet takes none).
    product = ps["nodeSelector"]["nvidia.com/gpu.product"]
    assert product in GPU_PRODUCTS, f"{product} is not a node_selector in manifests/skus.toml"
    if doc["kind"] != "DaemonSet":
        assert any(c["resources"]["limits"]["nvidia.com/gpu"] >= 1 for c in ps["containers"])


@pytest.mark.parametrize("path,doc", [x for x in WORKLOADS if x[1]["kind"] != "Job"],
                         ids=lambda x: getattr(x, "name", None) or x["kind"])
def test_pods_an_operator_would_accept(path, doc):
    """Requests and limits (no BestEffort pod, evicted first), no privilege, a service account."""
    ps = pod_spec(doc)
    sec = ps["securityContext"]
    assert sec["runAsNonRoot"] is True and sec["seccompProfile"]["type"] == "RuntimeDefault"
    assert ps["serviceAccountName"]
    for c in ps.get("initContainers", []) + ps["containers"]:
        r = c["resources"]
        assert {"cpu", "memory"} <= set(r["requests"]) and "memory" in r["limits"], c["name"]
        cs = c["securityContext"]
        assert cs["allowPrivilegeEscalation"] is False and cs["capabilities"]["drop"] == ["ALL"], c["name"]
        if c["name"].startswith(("warmer", "prefetch")):  # warmer's own containers (vLLM's writes)
            assert cs["readOnlyRootFilesystem"] is True, c["name"]
    if doc["kind"] == "Deployment":
        assert doc["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # exactly the GPUs present
        (vllm,) = [c for c in ps["containers"] if c["name"] == "vllm"]
        assert vllm["livenessProbe"] and vllm["readinessProbe"] and vllm["startupProbe"]
        (sa,) = [d for p, d in of_kind("ServiceAccount") if p == path]
        assert sa["metadata"]["name"] == ps["serviceAccountName"]
        assert {"eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account"} <= set(sa["metadata"]["annotations"])


def test_services_select_a_deployment():
    pods = [d["spec"]["template"]["metadata"]["labels"] for _, d in of_kind("Deployment")]
    for path, svc in of_kind("Service"):
        assert svc["spec"]["ports"]
        assert any(svc["spec"]["selector"].items() <= labels.items() for labels in pods), path


def test_github_workflow_runs_matrix_then_build_per_sku():
    (path,) = [p for p in YAMLS if p.parent.name == "ci" and "jobs" in docs(p)[0]]
    wf = docs(path)[0]
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads the bare key `on` as true
    assert on and "workflow_dispatch" in on
    plan, build = wf["jobs"]["plan"], wf["jobs"]["build"]
    for job in (plan, build):
        assert job["runs-on"] and job["steps"]
    assert any("warmer matrix manifests/ --format github" in s.get("run", "") and "GITHUB_OUTPUT" in s["run"]
               for s in plan["steps"])
    assert build["needs"] == "plan"
    assert build["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert build["runs-on"] == "${{ matrix.runs_on }}" and build["container"]["image"] == "${{ matrix.image }}"
    (step,) = [s for s in build["steps"] if "warmer build" in s.get("run", "")]
    argv = shlex.split(step["run"].replace("\\\n", " "))
    assert argv[argv.index("--root") + 1] == "${{ matrix.root }}"
    assert argv[argv.index("--step-summary") + 1] == "$GITHUB_STEP_SUMMARY"
    assert argv[argv.index("--store") + 1] == "$WARMER_STORE" and wf["env"]["WARMER_STORE"].startswith("s3://")
    # Every matrix field the workflow reads is one `warmer matrix` writes.
    used = set(re.findall(r"(?<![.\w])matrix\.([a-z_]+)", path.read_text()))
    entry = matrix.entries([MANIFESTS], SKUS, MANIFESTS / "skus.toml")[0][0]
    assert {"runs_on", "image", "root", "recipe", "gpus"} <= used <= set(entry), used - set(entry)


# --- the Deployment agrees with its recipe -----------------------------------------------------

def _serve(c: dict, env: dict) -> tuple[list[str], list[str]]:
    """(warmer serve's own argv, the flags it passes on to vLLM) of a container, $(VAR) expanded."""
    argv = [k8s_expand(a, env) for a in command_of(c)]
    assert argv[:2] == ["warmer", "serve"], argv
    cut = argv.index("--") if "--" in argv else len(argv)
    return argv[:cut], argv[cut + 1:]


def test_deployment_serves_exactly_what_its_recipe_warmed():
    deployment, init = init_container()
    recipe_name = container_env(init)["WARMER_RECIPE"]
    recipe = load(MANIFESTS / "models" / f"{recipe_name}.toml")
    (vllm,) = [c for c in pod_spec(deployment)["containers"] if c["name"] == "vllm"]
    own, passed = _serve(vllm, container_env(vllm))
    fetch_argv = [k8s_expand(a, container_env(init)) for a in command_of(init)]
    # The recipe, root and env file the init container fetched with: `warmer serve` turns the recipe's
    # model, revision and every [engine] arg into flags (vLLM hashes them into its compile key).
    assert own[2] == fetch_argv[2] and own[own.index("--root") + 1] == fetch_argv[fetch_argv.index("--root") + 1]
    assert own[own.index("--env-file") + 1] == fetch_argv[fetch_argv.index("--env-file") + 1]
    assert not serving.hashed_extra_flags(passed), passed  # only server flags are added by hand
    cmd = serving.command(recipe)
    assert recipe.model in cmd and all(f"--{k.replace('_', '-')}" in cmd for k in recipe.engine)
    # LLM(), which warms, and `vllm serve` default max_num_batched_tokens differently: pinned.
    assert "max_num_batched_tokens" in recipe.engine
    # Scheduled on a SKU the recipe targets, with the GPUs it needs, in the init container too
    # (the fingerprint counts the GPUs it sees).
    selector = pod_spec(deployment)["nodeSelector"]
    assert any(SKUS[t].node_selector.items() <= selector.items() for t in recipe.targets)
    need = compat.gpus_needed(recipe.identity())
    assert init["resources"]["limits"]["nvidia.com/gpu"] == vllm["resources"]["limits"]["nvidia.com/gpu"] == need
    assert init["image"] == vllm["image"]


def test_init_container_fetches_into_the_root_ci_builds_at_and_vllm_sources_its_env():
    deployment, init = init_container()
    argv = command_of(init)
    assert argv[:2] == ["warmer", "fetch"] and "--require" not in argv  # a miss starts the pod, slowly
    recipe_name = container_env(init)["WARMER_RECIPE"]
    root = argv[argv.index("--root") + 1]
    assert root == f"{matrix.DEFAULT_ROOT_BASE}/{recipe_name}"
    env_file = argv[argv.index("--env-file") + 1]
    # sh sources it: values with spaces (FLASHINFER_CUDA_ARCH_LIST="9.0a 10.0a") need its quoting.
    assert argv[argv.index("--env-format") + 1] == "shell"
    (vllm,) = [c for c in pod_spec(deployment)["containers"] if c["name"] == "vllm"]
    own, _ = _serve(vllm, container_env(vllm))
    assert own[own.index("--env-file") + 1] == env_file  # `warmer serve` loads it; on a miss it says so
    # Both containers mount the cache and the env file's volume at the same paths.
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (init, vllm)}
    for path in (str(Path(root).parent), str(Path(env_file).parent)):
        assert mounts["warmer-fetch"][path] == mounts["vllm"][path]
    # The recipe reaches the pod through the ConfigMap made from manifests/models/.
    recipe_path = argv[2]
    (recipes_mount,) = [m for m in init["volumeMounts"] if recipe_path.startswith(m["mountPath"] + "/")]
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    assert "configMap" in volumes[recipes_mount["name"]]
    assert (MANIFESTS / "models" / Path(recipe_path).name).is_file()


def test_build_job_builds_at_the_serving_root_into_an_empty_volume():
    (path, job), = of_kind("Job")
    (c,) = pod_spec(job)["containers"]
    argv = command_of(c)
    recipe_name = container_env(c)["WARMER_RECIPE"]
    assert argv[:2] == ["warmer", "build"]
    assert argv[argv.index("--root") + 1] == f"{matrix.DEFAULT_ROOT_BASE}/{recipe_name}"
    cache = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}[matrix.DEFAULT_ROOT_BASE]
    assert "emptyDir" in {v["name"]: v for v in pod_spec(job)["volumes"]}[cache]
    recipe = load(MANIFESTS / "models" / f"{recipe_name}.toml")
    assert any(SKUS[t].node_selector.items() <= pod_spec(job)["nodeSelector"].items() for t in recipe.targets)


def test_k8s_expand_follows_the_kubelet():
    env = {"A": "x", "B": "y"}
    assert k8s_expand("$(A)/$(B)-$(C)-$$(A)", env) == "x/y-$(C)-$(A)"


# --- the Dockerfile stage ----------------------------------------------------------------------

def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (MANIFESTS / "docker" / "Dockerfile").read_text()
    text = re.sub(r"<<'EOF'.*?\nEOF\n", "<<heredoc\n", text, flags=re.S)  # heredoc bodies are not instructions
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            op, _, rest = line.strip().partition(" ")
            out.append((op.upper(), rest))
    return out


def test_dockerfile_stages_bake_caches_at_the_serving_root_without_credentials_in_the_image():
    ins = _dockerfile_instructions()
    stages = [rest.split()[-1] for op, rest in ins if op == "FROM"]
    assert stages == ["warmer", "baked", "baked-from-file"]
    runs = [rest for op, rest in ins if op == "RUN"]
    (fetch,) = [r for r in runs if "warmer fetch" in r]
    assert "--require" in fetch and "--mount=type=secret" in fetch
    # A builder without GPUs: the target GPUs come from a saved fingerprint in the build context.
    assert "--gpus-from /tmp/gpus.json" in fetch and "source=${GPUS_FROM},target=/tmp/gpus.json" in fetch
    assert "--device" not in fetch
    assert '--root "/cache/${RECIPE}"' in fetch and "--env-file /etc/warmer/vllm.env --env-format shell" in fetch
    (restore_run,) = [r for r in runs if "warmer restore" in r]
    assert "--mount=type=bind" in restore_run and "--recipe" in restore_run
    assert "--env-file /etc/warmer/vllm.env --env-format shell" in restore_run
    # Credentials never as ARG or ENV: those stay in the image's history.
    names = [rest.split("=")[0] for op, rest in ins if op in ("ARG", "ENV")]
    assert not [n for n in names if re.search(r"SECRET|ACCESS_KEY|TOKEN|PASSWORD", n)], names
    # The baked images start vLLM with the env the restore wrote.
    assert ("ENTRYPOINT", '["/usr/local/bin/vllm-serve-warm"]') in ins
    text = (MANIFESTS / "docker" / "Dockerfile").read_text()
    assert 'exec warmer serve "/etc/warmer/recipes/${WARMER_RECIPE}.toml" --root "$root" --env-file /etc/warmer/vllm.env' \
        in text and 'root="/cache/${WARMER_RECIPE}"' in text
    assert [rest for op, rest in ins if op == "ENV"].count("WARMER_RECIPE=${RECIPE}") == 2


def test_skus_and_recipes_in_manifests_agree():
    for f in sorted((MANIFESTS / "models").glob("*.toml")):
        for t in tomllib.loads(f.read_text()).get("targets", []):
            assert t in SKUS, f"{f.name} targets {t}, missing from skus.toml"
