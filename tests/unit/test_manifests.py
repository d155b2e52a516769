"""Every YAML in manifests/ parses and has the fields its kind requires; the manifests agree with
the recipes and the SKU catalogue they run (no cluster, no Docker engine: parsing and checks)."""

import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
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


def fetch_init_containers() -> list[tuple[Path, dict, dict]]:
    """(file, Deployment, its init container running `warmer fetch`) of every shipped Deployment:
    the S3 one (warmer-fetch) and the OCI one (warmer-fetch-oci) alike."""
    out = []
    for path, d in of_kind("Deployment"):
        for c in d["spec"]["template"]["spec"].get("initContainers", []):
            if c.get("command", [])[:2] == ["warmer", "fetch"]:
                out.append((path, d, c))
    return out


FETCHING = fetch_init_containers()


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


# --- credentials: what each pod reaches its store with -------------------------------------------

IRSA = "eks.amazonaws.com/role-arn"


def store_containers() -> list[tuple[Path, dict, dict, str]]:
    """(file, workload, container, its WARMER_STORE) of every container that runs warmer against a store."""
    out = []
    for path, doc in WORKLOADS:
        ps = pod_spec(doc)
        for c in ps.get("initContainers", []) + ps["containers"]:
            if re.search(r"\bwarmer (fetch|build|publish)\b", " ".join(c.get("command", []) + c.get("args", []))):
                out.append((path, doc, c, container_env(c).get("WARMER_STORE", "")))
    return out


def test_every_container_on_s3_takes_the_same_optional_secret():
    """Static keys (MinIO, Ceph, no IRSA) come from the warmer-s3 secret the README's steps create,
    optional where the service account brings them: every container that fetches from or publishes
    to s3:// takes it, or that one alone has no credentials (a silent cold start, a failed publish)."""
    on_s3 = [(path, c) for path, _, c, store in store_containers() if store.startswith("s3://")]
    assert {path.name for path, _ in on_s3} == {
        "vllm-deployment.yaml", "warmer-prefetch-daemonset.yaml", "k8s-build-job.yaml"}
    for path, c in on_s3:
        assert c.get("envFrom") == [{"secretRef": {"name": "warmer-s3", "optional": True}}], f"{path.name}: {c['name']}"
        assert container_env(c).get("AWS_REGION"), f"{path.name}: {c['name']}"


def test_service_accounts_promise_only_the_access_warmer_uses():
    """warmer reads S3 credentials from boto3's chain (IRSA, Pod Identity, keys) and registry ones
    from docker and podman auth files: no GCP credential path, so no account carries a GKE
    workload-identity annotation that would promise one. The pods read; the build Job publishes,
    under an account of its own that may write."""
    accounts = of_kind("ServiceAccount")
    for p, d in accounts:
        assert not [a for a in d["metadata"].get("annotations", {}) if a.startswith("iam.gke.io/")], p.name
    on_s3 = [(path, doc) for path, doc, _, store in store_containers() if store.startswith("s3://")]

    def account_of(path: Path, doc: dict) -> tuple[Path, dict]:
        """The account a workload names: the one in its own file, else an S3 Deployment's (the
        DaemonSet shares the pods' account)."""
        name = pod_spec(doc).get("serviceAccountName")
        assert name, f"{path.name} runs as the namespace's `default` account"
        found = [(p, d) for p, d in accounts if d["metadata"]["name"] == name and p == path] or \
            [(p, d) for p, d in accounts if d["metadata"]["name"] == name and p in {q for q, _ in on_s3}]
        assert found, f"{path.name}: no shipped ServiceAccount {name}"
        return found[0]

    for path, doc in on_s3:
        _, sa = account_of(path, doc)
        assert IRSA in sa["metadata"].get("annotations", {}), f"{path.name}: {sa['metadata']['name']}"
    (job_path, job), = of_kind("Job")
    writer_path, writer = account_of(job_path, job)
    assert writer_path == job_path  # shipped beside the Job, as the pods' account is beside them
    readers = [account_of(p, d)[1] for p, d in WORKLOADS if d["kind"] != "Job"]
    assert writer["metadata"]["name"] not in {r["metadata"]["name"] for r in readers}
    assert writer["metadata"]["annotations"][IRSA] not in {r["metadata"].get("annotations", {}).get(IRSA)
                                                           for r in readers}
    assert "s3:PutObject" in job_path.read_text()  # its comment says what the role must allow


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
    # Matrix values reach the script through env (a value spliced into its text would be code).
    root = argv[argv.index("--root") + 1]
    assert root.startswith("$") and step["env"][root.lstrip("$")] == "${{ matrix.root }}"
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


def test_every_deployment_is_checked_against_its_recipe():
    """The agreement tests below run on every Deployment that fetches, not only on the S3 one."""
    assert sorted(p.name for p, _, _ in FETCHING) == sorted(p.name for p, _ in of_kind("Deployment"))
    assert {c["name"] for _, _, c in FETCHING} == {"warmer-fetch", "warmer-fetch-oci"}


@pytest.mark.parametrize("path,deployment,init", FETCHING, ids=[p.name for p, _, _ in FETCHING])
def test_deployment_serves_exactly_what_its_recipe_warmed(path, deployment, init):
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


@pytest.mark.parametrize("path,deployment,init", FETCHING, ids=[p.name for p, _, _ in FETCHING])
def test_init_container_fetches_into_the_root_ci_builds_at_and_vllm_sources_its_env(path, deployment, init):
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
    for mount_path in (str(Path(root).parent), str(Path(env_file).parent)):
        assert mounts[init["name"]][mount_path] == mounts["vllm"][mount_path]
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


# The ENTRYPOINT of the image the `warmer` stage builds FROM (vllm-project/vllm docker/Dockerfile,
# stage vllm-openai): whatever `docker run IMAGE ARGS` gives goes after it, unless a stage resets it.
VLLM_ENTRYPOINT = ["vllm", "serve"]
WARMER_IMAGE = "registry.example.com/vllm-warmer:v0.32.0"  # the `warmer` target's tag, as the files write it
# docker run's options that take a value as the next word (the ones the docs use, and their kin).
_DOCKER_RUN_VALUED = {"--gpus", "-v", "--volume", "-p", "--publish", "-w", "--workdir", "-e", "--env", "--name",
                      "--entrypoint", "-u", "--user", "--network", "--ipc", "--shm-size"}


def dockerfile_entrypoints() -> dict[str, list[str]]:
    """Each stage's effective ENTRYPOINT, as Docker resolves it: the stage's own last one, else the
    one of the stage it is FROM, else the base image's (vLLM's)."""
    out: dict[str, list[str]] = {}
    stage = None
    for op, rest in _dockerfile_instructions():
        if op == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            base, stage = words[0], words[-1]
            out[stage] = out.get(base, VLLM_ENTRYPOINT)
        elif op == "ENTRYPOINT" and stage:
            out[stage] = json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
    return out


def documented_docker_runs() -> list[tuple[str, str, list[str]]]:
    """(where, image, what follows the image) of every `docker run` the README and the Dockerfile write."""
    out = []
    for path in (REPO / "README.md", MANIFESTS / "docker" / "Dockerfile"):
        text = path.read_text().replace("\\\n", " ")
        for m in re.finditer(r"docker run ([^`\n]*)", text):
            words = shlex.split(re.split(r"\s[>|;]|&&", m.group(1))[0])
            i = 0
            while words[i].startswith("-"):
                i += 1 if "=" in words[i] or words[i] not in _DOCKER_RUN_VALUED else 2
            out.append((f"{path.name}: {m.group(0)}", words[i], words[i + 1:]))
    return out


def test_docker_run_with_a_command_runs_that_command():
    """`docker run IMAGE warmer fingerprint --json` (the baked build's fingerprint) and `docker run
    IMAGE bash scripts/gpu-accept.sh` run what they name only where the `warmer` image resets vLLM's
    ENTRYPOINT (else: `vllm serve warmer fingerprint --json`); the baked images keep theirs, which
    takes vLLM's flags."""
    entrypoints = dockerfile_entrypoints()
    runs = documented_docker_runs()
    with_a_command = [(where, image, argv) for where, image, argv in runs if argv and not argv[0].startswith("-")]
    assert {argv[0] for _, _, argv in with_a_command} == {"warmer", "bash"}, runs
    for where, image, argv in with_a_command:
        assert image in (WARMER_IMAGE, "IMAGE"), where
        assert entrypoints["warmer"] + argv == argv, f"{where} runs {entrypoints['warmer'] + argv}"
    flags_only = [(where, argv) for where, _, argv in runs if argv and argv[0].startswith("-")]
    assert flags_only
    for stage in ("baked", "baked-from-file"):
        assert entrypoints[stage] == ["/usr/local/bin/vllm-serve-warm"], stage
    # The pods run that image with their own command: args alone would follow its ENTRYPOINT.
    for path, doc in WORKLOADS:
        for c in pod_spec(doc).get("initContainers", []) + pod_spec(doc)["containers"]:
            if c["image"] == WARMER_IMAGE:
                assert c.get("command"), f"{path.name}: {c['name']}"


def test_skus_and_recipes_in_manifests_agree():
    for f in sorted((MANIFESTS / "models").glob("*.toml")):
        for t in tomllib.loads(f.read_text()).get("targets", []):
            assert t in SKUS, f"{f.name} targets {t}, missing from skus.toml"


def test_dockerfile_baked_stages_hand_the_root_to_the_user_vllm_runs_as():
    """The baked stages restore as root at image build: --owner hands the restored root to vLLM's
    user, and the image then runs as that user, the pods' runAsUser."""
    ins = _dockerfile_instructions()
    args = dict(rest.split("=", 1) for op, rest in ins if op == "ARG" and "=" in rest)
    owner = '--owner "${VLLM_UID}:${VLLM_GID}"'
    runs = [rest for op, rest in ins if op == "RUN"]
    (fetch,) = [r for r in runs if "warmer fetch" in r]
    (restore_run,) = [r for r in runs if "warmer restore" in r]
    assert owner in fetch and owner in restore_run
    stages: dict[str, list] = {"": []}  # "": the global ARGs before the first FROM
    current = stages[""]
    for op, rest in ins:
        if op == "FROM":
            current = stages.setdefault(rest.split()[-1], [])
        current.append((op, rest))
    for name in ("baked", "baked-from-file"):
        users = [rest for op, rest in stages[name] if op == "USER"]
        assert users == ["${VLLM_UID}:${VLLM_GID}"], name
        assert {("ARG", "VLLM_UID"), ("ARG", "VLLM_GID")} <= set(stages[name])  # global ARGs, brought in
    for _, deployment, _ in FETCHING:
        sec = pod_spec(deployment)["securityContext"]
        assert (int(args["VLLM_UID"]), int(args["VLLM_GID"])) == (sec["runAsUser"], sec["runAsGroup"])


# --- ownership: the serving process owns what it writes (DESIGN rule 10) -----------------------

def _writable_hostpaths(ps: dict, c: dict) -> dict[str, str]:
    """{mountPath: volume name} of the hostPath volumes a container mounts writable."""
    volumes = {v["name"]: v for v in ps.get("volumes", [])}
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])
            if "hostPath" in volumes[m["name"]] and not m.get("readOnly")}


@pytest.mark.parametrize("path,doc", [x for x in WORKLOADS if x[1]["kind"] != "Job"],
                         ids=lambda x: getattr(x, "name", None) or x["kind"])
def test_a_hostpath_cache_is_handed_to_the_pods_user_by_one_chown(path, doc):
    """warmer and vLLM run as the pod's non-root user; a hostPath the kubelet creates is root's
    (0755), so a first init container, cache-owner, hands each writable hostPath mount point to
    that user: root with CHOWN alone, one non-recursive chown, nothing else."""
    ps = pod_spec(doc)
    sec = ps["securityContext"]
    uid, gid = sec["runAsUser"], sec["runAsGroup"]
    assert sec["runAsNonRoot"] is True and uid != 0 and gid != 0
    inits, containers = ps.get("initContainers", []), ps["containers"]
    others = [c for c in inits + containers if c["name"] != "cache-owner"]
    writable = {p: v for c in others for p, v in _writable_hostpaths(ps, c).items()}
    assert writable, "a hostPath cache is what these manifests ship"
    owner = inits[0]
    assert owner["name"] == "cache-owner", [c["name"] for c in inits]
    argv = owner["command"] + owner.get("args", [])
    assert argv[:2] == ["chown", f"{uid}:{gid}"] and "-R" not in argv and "--recursive" not in argv
    assert sorted(argv[2:]) == sorted(writable), (argv, writable)
    assert {m["mountPath"]: m["name"] for m in owner["volumeMounts"]} == writable
    cs = owner["securityContext"]
    assert cs["runAsUser"] == 0 and cs["runAsNonRoot"] is False
    assert cs["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert cs["allowPrivilegeEscalation"] is False and cs["readOnlyRootFilesystem"] is True
    assert {"cpu", "memory"} <= set(owner["resources"]["requests"]) <= set(owner["resources"]["limits"])
    # Everything else runs as the pod's user: no other container overrides it.
    for c in others:
        cs = c.get("securityContext", {})
        assert cs.get("runAsUser", uid) == uid and cs.get("runAsGroup", gid) == gid, c["name"]
        assert "add" not in cs.get("capabilities", {}), c["name"]


# --- Pod Security Standards: the Job is "restricted"; the pods differ only by their hostPaths ----

# The capabilities "baseline" lets a container add; "restricted" lets it add NET_BIND_SERVICE only.
_BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                  "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}


def pod_security_violations(ps: dict) -> list[str]:
    """What the Pod Security admission's "restricted" profile refuses in a pod spec
    (kubernetes.io/docs/concepts/security/pod-security-standards, both the baseline and the
    restricted controls), one line per violation."""
    out = []
    for k in ("hostNetwork", "hostPID", "hostIPC"):
        if ps.get(k):
            out.append(f"pod: {k}")
    pod_sec = ps.get("securityContext", {})
    for v in ps.get("volumes", []):
        kind = (set(v) - {"name"}).pop()
        if kind not in _RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {kind}")
    if pod_sec.get("seccompProfile", {}).get("type") == "Unconfined":
        out.append("pod: seccomp Unconfined")
    for c in ps.get("initContainers", []) + ps["containers"]:
        cs, n = c.get("securityContext", {}), c["name"]
        if cs.get("privileged"):
            out.append(f"{n}: privileged")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{n}: hostPort")
        if cs.get("allowPrivilegeEscalation") is not False:
            out.append(f"{n}: allowPrivilegeEscalation")
        if cs.get("runAsNonRoot", pod_sec.get("runAsNonRoot")) is not True:
            out.append(f"{n}: runAsNonRoot")
        if cs.get("runAsUser", pod_sec.get("runAsUser")) == 0:
            out.append(f"{n}: runAsUser 0")
        seccomp = cs.get("seccompProfile", pod_sec.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{n}: seccompProfile {seccomp}")
        caps = cs.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{n}: capabilities not dropped")
        for cap in caps.get("add", []):
            if cap != "NET_BIND_SERVICE":
                out.append(f"{n}: adds {cap}" + ("" if cap in _BASELINE_CAPS else " (beyond baseline)"))
    return out


def test_the_build_job_passes_pod_security_restricted():
    (path, job), = of_kind("Job")
    assert pod_security_violations(pod_spec(job)) == []


@pytest.mark.parametrize("path,doc", [x for x in WORKLOADS if x[1]["kind"] != "Job"],
                         ids=lambda x: getattr(x, "name", None) or x["kind"])
def test_pods_break_restricted_only_by_their_hostpaths_and_cache_owner(path, doc):
    """A hostPath needs a "privileged" namespace (baseline refuses it too); beyond the hostPath
    volumes themselves and cache-owner's root with CHOWN, every container is "restricted"."""
    ps = pod_spec(doc)
    hostpaths = {f"volume {v['name']}: hostPath" for v in ps["volumes"] if "hostPath" in v}
    owner = {"cache-owner: runAsNonRoot", "cache-owner: runAsUser 0", "cache-owner: adds CHOWN"}
    assert set(pod_security_violations(ps)) <= hostpaths | owner
    assert pod_security_violations({"containers": [{"name": "c"}]}) == [
        "c: allowPrivilegeEscalation", "c: runAsNonRoot", "c: seccompProfile None", "c: capabilities not dropped"]


def test_every_declared_volume_is_mounted():
    """A volume no container mounts is a mistake waiting to happen (the OCI Deployment once declared
    the `tmp` its read-only init container needed, and never mounted it)."""
    for path, doc in WORKLOADS:
        ps = pod_spec(doc)
        mounted = {m["name"] for c in ps.get("initContainers", []) + ps["containers"] for m in c.get("volumeMounts", [])}
        assert {v["name"] for v in ps["volumes"]} <= mounted, (path.name, {v["name"] for v in ps["volumes"]} - mounted)
        for c in ps.get("initContainers", []) + ps["containers"]:
            if c.get("securityContext", {}).get("readOnlyRootFilesystem") and c["name"] != "cache-owner":
                assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, (path.name, c["name"])


# --- time is bounded (DESIGN rule 9) ------------------------------------------------------------

def _deadline(c: dict) -> int:
    value = container_env(c).get("WARMER_DEADLINE")
    assert value is not None, f"{c['name']} sets no WARMER_DEADLINE: a stalled store must not hold it"
    return int(value)


def test_every_fetch_has_its_deadline_and_every_build_a_timeout():
    # The init containers: below the vLLM container's startup window, which a cold start must fit.
    for path, d in of_kind("Deployment"):
        ps = pod_spec(d)
        (vllm,) = [c for c in ps["containers"] if c["name"] == "vllm"]
        probe = vllm["startupProbe"]
        for c in ps["initContainers"]:
            if c["name"].startswith("warmer-fetch"):
                assert 0 < _deadline(c) <= 600 < probe["periodSeconds"] * probe["failureThreshold"], path.name
    # The prefetch rounds: each ends before the next is due.
    (path, ds), = of_kind("DaemonSet")
    (prefetch,) = pod_spec(ds)["containers"]
    sleep = int(re.search(r"\bsleep (\d+)", prefetch["args"][0]).group(1))
    assert 0 < _deadline(prefetch) < sleep
    # The systemd unit: within its start timeout, and the timer's period.
    unit = (MANIFESTS / "node" / "warmer-prefetch.service").read_text()
    deadline = int(re.search(r"^Environment=WARMER_DEADLINE=(\d+)$", unit, re.M).group(1))
    timeout = re.search(r"^TimeoutStartSec=(\d+)h$", unit, re.M)
    assert 0 < deadline < int(timeout.group(1)) * 3600
    # The build Job and every workflow job end on their own.
    (path, job), = of_kind("Job")
    assert job["spec"]["activeDeadlineSeconds"] > 0
    (wf_path,) = [p for p in YAMLS if p.parent.name == "ci" and "jobs" in docs(p)[0]]
    for name, j in docs(wf_path)[0]["jobs"].items():
        assert 0 < j.get("timeout-minutes", 0) <= 120, f"{name} has no timeout-minutes"


def test_the_prefetch_rounds_of_nodes_that_joined_together_drift_apart():
    """The DaemonSet's rounds were exactly an hour apart: nodes that joined at once (a first apply, a
    scaled node group) hit the store in the same seconds every hour, for good. The timer has
    RandomizedDelaySec; the loop sleeps a random 0 to 600 s more each round, drawn by its own sh."""
    (_, ds), = of_kind("DaemonSet")
    (prefetch,) = pod_spec(ds)["containers"]
    loop = prefetch["args"][0]
    draw = next(line.strip() for line in loop.splitlines() if line.strip().startswith("jitter="))
    pause = next(line.strip() for line in loop.splitlines() if '"$(( jitter' in line)
    script = f"{draw}\necho \"{pause.removeprefix('sleep ').strip(chr(34))}\""
    drawn = {int(subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout)
             for _ in range(12)}
    assert all(0 <= x < 600 for x in drawn) and len(drawn) > 1, drawn


def test_the_timer_is_boot_relative_without_persistent():
    """Persistent= catches up missed OnCalendar= runs only: beside OnBootSec=/OnUnitActiveSec= it
    does nothing, and says something false."""
    timer = (MANIFESTS / "node" / "warmer-prefetch.timer").read_text()
    keys = {line.split("=", 1)[0] for line in timer.splitlines() if "=" in line and not line.startswith("#")}
    assert {"OnBootSec", "OnUnitActiveSec"} <= keys
    assert "Persistent" not in keys or "OnCalendar" in keys


# --- the systemd unit: vLLM's user, one privileged line, the path CI built at -------------------

def _unit(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", ";")):
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_the_unit_runs_as_vllms_user_with_one_privileged_line():
    unit = _unit((MANIFESTS / "node" / "warmer-prefetch.service").read_text())
    user, group = unit["User"][0], unit["Group"][0]
    assert user not in ("root", "0") and group not in ("root", "0")
    (pre,) = unit["ExecStartPre"]
    # `+`: this line alone runs with full privileges; it makes the writable paths that user's.
    argv = shlex.split(pre)
    assert argv[:6] == ["+/usr/bin/install", "-d", "-o", user, "-g", user if group == user else group]
    writable = unit["ReadWritePaths"][0].split()
    assert argv[-len(writable):] == writable and "/cache" in writable
    assert all(not line.startswith(("+", "!")) for line in unit["ExecStart"])
    (start,) = unit["ExecStart"]
    fetch = shlex.split(start)
    assert fetch[1:3] == ["fetch", "--all"] and fetch[fetch.index("--root-base") + 1] == matrix.DEFAULT_ROOT_BASE
    metrics = fetch[fetch.index("--metrics-file") + 1]
    assert str(Path(metrics).parent) in writable
    assert unit["ProtectSystem"] == ["strict"] and unit["NoNewPrivileges"] == ["yes"]
    # NVML reads the GPUs' device nodes, and the store is across the network.
    assert "PrivateDevices" not in unit and "PrivateNetwork" not in unit and "IPAddressDeny" not in unit


# --- cloud-init: the units it writes are the shipped ones, byte for byte -------------------------

def _cloud_init() -> dict:
    text = (MANIFESTS / "node" / "cloud-init.yaml").read_text()
    assert text.startswith("#cloud-config\n")
    return yaml.safe_load(text)


def test_cloud_init_embeds_the_shipped_units_and_downloads_nothing_unpinned():
    ci = _cloud_init()
    files = {f["path"]: f for f in ci["write_files"]}
    for name in ("warmer-prefetch.service", "warmer-prefetch.timer"):
        assert files[f"/etc/systemd/system/{name}"]["content"] == (MANIFESTS / "node" / name).read_text(), name
    (script,) = [f for f in files.values() if f["content"] == (MANIFESTS / "node" / "install-warmer.sh").read_text()]
    assert script["permissions"] == "0755"
    commands = [c if isinstance(c, list) else shlex.split(c) for c in ci["runcmd"]]
    assert not [c for c in commands if {"curl", "wget"} & set(c)], "the units come embedded, not downloaded"
    (install,) = [c for c in commands if script["path"] in c]
    env = dict(a.split("=", 1) for a in install if "=" in a)
    assert re.fullmatch(r"[0-9a-f]{64}", env["WARMER_WHEEL_SHA256"])
    assert env["WARMER_WHEEL_URL"].endswith(".whl")
    assert ["systemctl", "start", "warmer-prefetch.service"] in commands
    assert commands.index(install) < commands.index(["systemctl", "start", "warmer-prefetch.service"])
    # runcmd runs after multi-user.target: a vllm.service the image enables started cold before the
    # fetch, and only a restart after it puts vLLM on the caches at first boot
    assert commands.index(["systemctl", "start", "warmer-prefetch.service"]) < commands.index(
        ["systemctl", "restart", "vllm.service"])


# --- install-warmer.sh: the `warmer` command is linked from where pip put it ---------------------

@pytest.fixture
def python_beside_no_scripts(tmp_path) -> tuple[Path, Path]:
    """(an interpreter, the directory pip puts its commands in), two different places, as for
    Debian's /usr/bin/python3 (commands in /usr/local/bin): a real venv's python behind a wrapper
    elsewhere. The wrapper's `-m pip install` stands in for pip: it writes the console script where
    pip would, the venv's scripts directory."""
    for tool in ("curl", "sha256sum"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not installed here: install-warmer.sh runs it")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    where = "import sysconfig; print(sysconfig.get_path('scripts'))"
    scripts = Path(subprocess.run([str(venv / "bin" / "python"), "-c", where], capture_output=True, text=True,
                                  check=True).stdout.strip())
    console_script = shlex.quote(str(scripts / "warmer"))
    wrapper = tmp_path / "system" / "python3"
    wrapper.parent.mkdir()
    wrapper.write_text(f"""#!/bin/sh
if [ "$1 $2 $3" = "-m pip install" ]; then
  printf '#!/bin/sh\\necho warmer 0.1.0\\n' > {console_script} && chmod +x {console_script}
  exit
fi
exec {shlex.quote(str(venv / "bin" / "python"))} "$@"
""")
    wrapper.chmod(0o755)
    assert scripts != wrapper.parent
    return wrapper, scripts


def _install_warmer(tmp_path: Path, python: Path, link: Path) -> subprocess.CompletedProcess:
    wheel = tmp_path / "warmer-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"a stand-in: the wrapper's pip never reads it")
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "VLLM_PYTHON": str(python), "WARMER_LINK": str(link),
           "WARMER_WHEEL_URL": wheel.as_uri(), "WARMER_WHEEL_SHA256": hashlib.sha256(wheel.read_bytes()).hexdigest()}
    return subprocess.run(["sh", str(MANIFESTS / "node" / "install-warmer.sh")], env=env, capture_output=True,
                          text=True, timeout=120)


def test_install_warmer_links_the_command_from_the_interpreters_scripts_directory(tmp_path, python_beside_no_scripts):
    python, scripts = python_beside_no_scripts
    link = tmp_path / "bin" / "warmer"
    link.parent.mkdir()
    out = _install_warmer(tmp_path, python, link)
    assert out.returncode == 0, out.stdout + out.stderr
    assert link.resolve() == (scripts / "warmer").resolve() and "warmer 0.1.0" in out.stdout


def test_install_warmer_keeps_pips_command_where_it_is_the_link(tmp_path, python_beside_no_scripts):
    """Debian's system Python: pip's command is /usr/local/bin/warmer, the default link; linking it
    to itself would replace it with a loop."""
    python, scripts = python_beside_no_scripts
    out = _install_warmer(tmp_path, python, scripts / "warmer")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not (scripts / "warmer").is_symlink() and "warmer 0.1.0" in out.stdout


def test_container_jobs_name_no_runner_temp_path_the_container_may_not_have():
    """In a container job, `${{ runner.temp }}` can expand to the host's path in one step and the
    container's in another (actions/runner#965, #2498): the files written in one and uploaded by
    the next then miss each other, and the upload keeps nothing (if-no-files-found: ignore)."""
    wf = yaml.safe_load((MANIFESTS / "ci" / "github-warm-caches.yml").read_text())
    for name, job in wf["jobs"].items():
        if "container" in job:
            for step in job["steps"]:
                text = json.dumps({k: step.get(k) for k in ("run", "env", "with")})
                assert "runner.temp" not in text, (name, step.get("name"))
