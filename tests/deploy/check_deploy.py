#!/usr/bin/env python3
"""Structural checks of deploy/: the Kubeflow MPIJob and TFJob manifests and the Dockerfile.

Docker and Kubernetes cannot run on our machines, so this is what we can
check: the YAML parses, the objects have the kinds, replica counts and
resource keys the MPI Operator (kubeflow.org/v2beta1) needs, mpirun's -np
matches workers x slots, GPU counts match slots, every flag given to the
example exists in its --help, volumes are claimed, and the Dockerfile has
the stages docs/deployment.md names.

The program the jobs and the images run is the one `cmake --install` puts in
bin/: the example binary's own file name (diststrat-fashion-mnist; installed
programs carry the project's prefix, bin/ being shared with other packages).

Usage: check_deploy.py <repo root> <fashion_mnist binary>
"""
import glob
import os
import re
import subprocess
import sys

try:
    import yaml
except ImportError:
    print("SKIP: python3-yaml is not installed (scripts/setup.sh installs it)")
    sys.exit(77)

root, example = sys.argv[1], sys.argv[2]
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


help_text = subprocess.run([example, "--help"], capture_output=True, text=True, check=True).stdout
known_flags = set(re.findall(r"--[a-z][a-z0-9-]*", help_text))
RESOURCE_KEYS = {"cpu", "memory", "nvidia.com/gpu", "ephemeral-storage"}
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")


def check_resources(where, res):
    for section, values in res.items():
        check(section in ("requests", "limits"), f"{where}: unknown resources section '{section}'")
        for key, value in values.items():
            check(key in RESOURCE_KEYS, f"{where}: unknown resource key '{key}'")
            check(QUANTITY.match(str(value)) is not None, f"{where}: bad quantity {key}={value!r}")
    gpu_limit = res.get("limits", {}).get("nvidia.com/gpu")
    gpu_request = res.get("requests", {}).get("nvidia.com/gpu")
    if gpu_request is not None:
        # Extended resources: a request must equal its limit.
        check(gpu_request == gpu_limit, f"{where}: nvidia.com/gpu request {gpu_request} != limit {gpu_limit}")
    return gpu_limit


def check_tfjob(name, job, claims):
    """A TFJob (Kubeflow training operator, kubeflow.org/v1): every pod runs
    the example itself (no mpirun, no sshd), in the container the operator
    gives TF_CONFIG (named tensorflow, port tfjob-port), on a checkpoint
    volume the file claims; a chief and workers, all with the same
    arguments (they must agree on the job)."""
    check(job.get("apiVersion") == "kubeflow.org/v1", f"{name}: apiVersion {job.get('apiVersion')}")
    replicas = job["spec"].get("tfReplicaSpecs", {})
    check(set(replicas) == {"Chief", "Worker"}, f"{name}: tfReplicaSpecs has {sorted(replicas)}")
    check(replicas.get("Chief", {}).get("replicas") == 1, f"{name}: Chief replicas must be 1")
    nworkers = replicas.get("Worker", {}).get("replicas")
    check(isinstance(nworkers, int) and nworkers >= 1, f"{name}: Worker replicas {nworkers!r}")
    commands = []
    for role, rs in sorted(replicas.items()):
        where = f"{name} {role}"
        pod = rs["template"]["spec"]
        containers = pod["containers"]
        if not check(len(containers) == 1, f"{where}: {len(containers)} containers"):
            continue
        c = containers[0]
        check(c.get("name") == "tensorflow", f"{where}: the operator sets TF_CONFIG only in the container named tensorflow, not {c.get('name')!r}")
        check(c["image"] == "diststrat:cpu", f"{where}: image {c['image']}")
        ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
        check("tfjob-port" in ports, f"{where}: no port named tfjob-port (the TF_CONFIG port)")
        cmd = c.get("command", []) + c.get("args", [])
        commands.append(cmd)
        check("mpirun" not in cmd and "/usr/sbin/sshd" not in cmd, f"{where}: runs mpirun or sshd")
        installed = "/opt/diststrat/bin/" + os.path.basename(example)
        check(cmd[:1] == [installed], f"{where}: runs {cmd[:1]}, installed as {installed}")
        for arg in cmd[1:]:
            if arg.startswith("--"):
                check(arg in known_flags, f"{where}: fashion_mnist has no flag {arg}")
        check(cmd[cmd.index("--strategy") + 1] == "multi_worker" if "--strategy" in cmd else False,
              f"{where}: not --strategy multi_worker")
        check_resources(where, c.get("resources", {}))
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        ckpt = cmd[cmd.index("--checkpoint-dir") + 1] if "--checkpoint-dir" in cmd else None
        if check(ckpt is not None, f"{where}: no --checkpoint-dir"):
            covering = [n for n, m in mounts.items() if ckpt.startswith(m.rstrip("/") + "/")]
            if check(covering, f"{where}: checkpoint dir {ckpt} is not on a volume"):
                claim = volumes[covering[0]].get("persistentVolumeClaim", {}).get("claimName")
                check(claim in claims, f"{where}: volume claim {claim} is not defined in the file")
    check(len(commands) == 2 and commands[0] == commands[1],
          f"{name}: the chief and the workers run different commands")


manifests = sorted(glob.glob(os.path.join(root, "deploy", "k8s", "*.yaml")))
check(len(manifests) >= 2, f"expected a CPU and a GPU manifest, found {manifests}")
seen_variants = set()
for path in manifests:
    name = os.path.relpath(path, root)
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    claims = {d["metadata"]["name"] for d in docs if d.get("kind") == "PersistentVolumeClaim"}
    tfjobs = [d for d in docs if d.get("kind") == "TFJob"]
    if tfjobs:
        check(len(tfjobs) == 1, f"{name}: expected one TFJob, found {len(tfjobs)}")
        check_tfjob(name, tfjobs[0], claims)
        continue
    jobs = [d for d in docs if d.get("kind") == "MPIJob"]
    if not check(len(jobs) == 1, f"{name}: expected one MPIJob, found {len(jobs)}"):
        continue
    job = jobs[0]
    variant = "gpu" if "gpu" in os.path.basename(path) else "cpu"
    seen_variants.add(variant)
    check(job.get("apiVersion") == "kubeflow.org/v2beta1", f"{name}: apiVersion {job.get('apiVersion')}")
    spec = job["spec"]
    slots = spec.get("slotsPerWorker")
    check(isinstance(slots, int) and slots >= 1, f"{name}: slotsPerWorker {slots!r}")
    check(spec.get("mpiImplementation", "OpenMPI") == "OpenMPI", f"{name}: mpiImplementation")
    replicas = spec.get("mpiReplicaSpecs", {})
    check(set(replicas) == {"Launcher", "Worker"}, f"{name}: mpiReplicaSpecs has {sorted(replicas)}")
    launcher, worker = replicas.get("Launcher", {}), replicas.get("Worker", {})
    check(launcher.get("replicas") == 1, f"{name}: Launcher replicas {launcher.get('replicas')!r}")
    nworkers = worker.get("replicas")
    check(isinstance(nworkers, int) and nworkers >= 1, f"{name}: Worker replicas {nworkers!r}")

    lc = launcher["template"]["spec"]["containers"]
    check(len(lc) == 1, f"{name}: launcher has {len(lc)} containers")
    cmd = lc[0].get("command", []) + lc[0].get("args", [])
    check(cmd[:1] == ["mpirun"], f"{name}: launcher does not run mpirun: {cmd[:1]}")
    check(lc[0]["image"] == f"diststrat:{variant}", f"{name}: launcher image {lc[0]['image']}")
    np_value = None
    for flag in ("-np", "-n"):
        if flag in cmd:
            np_value = int(cmd[cmd.index(flag) + 1])
    check(np_value == nworkers * slots,
          f"{name}: mpirun -np {np_value} but {nworkers} workers x {slots} slots = {nworkers * slots}")
    prog = [i for i, a in enumerate(cmd) if re.search(r"/(diststrat-)?fashion[-_]mnist$", a)]
    if check(len(prog) == 1, f"{name}: launcher does not run the Fashion-MNIST example"):
        installed = "/opt/diststrat/bin/" + os.path.basename(example)
        check(cmd[prog[0]] == installed, f"{name}: program path {cmd[prog[0]]}, installed as {installed}")
        for arg in cmd[prog[0] + 1:]:
            if arg.startswith("--"):
                check(arg in known_flags, f"{name}: fashion_mnist has no flag {arg}")
    check_resources(f"{name} launcher", lc[0].get("resources", {}))
    check("nvidia.com/gpu" not in str(lc[0].get("resources", {})), f"{name}: the launcher requests GPUs")

    wspec = worker["template"]["spec"]
    wc = wspec["containers"]
    check(len(wc) == 1, f"{name}: worker has {len(wc)} containers")
    check(wc[0]["image"] == f"diststrat:{variant}", f"{name}: worker image {wc[0]['image']}")
    # sshd under the init that passes SIGTERM to the ranks (deploy/worker-init.sh).
    wcmd = wc[0].get("command", []) + wc[0].get("args", [])
    check(wcmd[:2] == ["/usr/local/bin/diststrat-worker-init", "/usr/sbin/sshd"],
          f"{name}: workers must run sshd under /usr/local/bin/diststrat-worker-init: {wcmd[:2]}")
    gpus = check_resources(f"{name} worker", wc[0].get("resources", {}))
    if variant == "gpu":
        check(gpus == slots, f"{name}: workers request {gpus} GPUs but slotsPerWorker is {slots}")
    else:
        check(gpus is None, f"{name}: the CPU variant requests GPUs")
    # Checkpoints must land on a volume the workers mount and the file claims.
    mounts = {m["name"]: m["mountPath"] for m in wc[0].get("volumeMounts", [])}
    volumes = {v["name"]: v for v in wspec.get("volumes", [])}
    ckpt = cmd[cmd.index("--checkpoint-dir") + 1] if "--checkpoint-dir" in cmd else None
    if check(ckpt is not None, f"{name}: no --checkpoint-dir"):
        covering = [n for n, m in mounts.items() if ckpt.startswith(m.rstrip("/") + "/")]
        if check(covering, f"{name}: checkpoint dir {ckpt} is not on a worker volume"):
            claim = volumes[covering[0]].get("persistentVolumeClaim", {}).get("claimName")
            check(claim in claims, f"{name}: volume claim {claim} is not defined in the file")
    # The preemption save needs time between SIGTERM and SIGKILL.
    grace = wspec.get("terminationGracePeriodSeconds", 30)
    env = {e["name"]: e["value"] for e in lc[0].get("env", [])}
    kill_after = int(env.get("OMPI_MCA_odls_base_sigkill_timeout", "0"))
    # mpirun delays the ranks' SIGTERM by T and their SIGKILL by 2T (Open MPI 4.1).
    check(kill_after > 0 and grace >= 2 * kill_after,
          f"{name}: terminationGracePeriodSeconds {grace} < 2 x mpirun's SIGKILL timeout {kill_after}")

check(seen_variants == {"cpu", "gpu"}, f"variants found: {sorted(seen_variants)}")

# The Dockerfile: the stages and bases docs/deployment.md describes.
with open(os.path.join(root, "deploy", "Dockerfile")) as f:
    dockerfile = f.read()
stages = dict((m.group(2), m.group(1)) for m in re.finditer(r"^FROM\s+(\S+)\s+AS\s+(\S+)", dockerfile, re.M))
check(set(stages) == {"sources", "build-cpu", "cpu", "build-gpu", "gpu"}, f"Dockerfile stages {sorted(stages)}")
check(stages.get("sources") == "scratch", "the sources stage is not FROM scratch")
args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", dockerfile, re.M))
# A fully qualified reference (docker.io/library/debian:...) names the same image.
unqualify = lambda ref: re.sub(r"^docker\.io/(library/)?", "", ref)
resolve = lambda base: unqualify(args.get(base[2:-1], base) if base.startswith("${") else base)
check(resolve(stages.get("cpu", "")).startswith("debian:"), "the CPU image is not Debian-based")
check(resolve(stages.get("build-gpu", "")).startswith("nvidia/cuda:") and "devel" in resolve(stages["build-gpu"]),
      "the GPU build stage is not a CUDA devel image")
check("libnccl-dev" in dockerfile and "libopenmpi-dev" in dockerfile, "Dockerfile lacks NCCL or Open MPI")
# The images' default command is an installed program, by its installed name.
for cmd_line in re.findall(r"^CMD\s+(\[.*\])", dockerfile, re.M):
    program = yaml.safe_load(cmd_line)[0]
    check(program == os.path.basename(example), f"Dockerfile: CMD runs {program}, installed as {os.path.basename(example)}")
for src in re.findall(r"^COPY\s+(?:--chown=\S+\s+)?(deploy/\S+)", dockerfile, re.M):
    check(os.path.exists(os.path.join(root, src)), f"Dockerfile copies missing {src}")
# Every image installs the workers' init where the manifests run it, executable
# (COPY keeps the file's mode, and the build context is `git archive HEAD`).
for stage in ("cpu", "gpu"):
    body = re.search(rf"^FROM\s+\S+\s+AS\s+{stage}\s*$(.*?)(?=^FROM\s|\Z)", dockerfile, re.M | re.S)
    check(body and re.search(r"^COPY\s+deploy/worker-init.sh\s+/usr/local/bin/diststrat-worker-init\s*$",
                             body.group(1), re.M),
          f"Dockerfile: stage {stage} does not install deploy/worker-init.sh as diststrat-worker-init")
check(os.access(os.path.join(root, "deploy", "worker-init.sh"), os.X_OK), "deploy/worker-init.sh is not executable")
# --elastic needs Gloo and hiredis: required in the CPU build, their runtime
# libraries in the CPU image.
cpu_body = re.search(r"^FROM\s+\S+\s+AS\s+cpu\s*$(.*?)(?=^FROM\s|\Z)", dockerfile, re.M | re.S)
check("-DDISTSTRAT_WITH_GLOO=ON" in dockerfile and "-DDISTSTRAT_WITH_REDIS=ON" in dockerfile,
      "Dockerfile: the CPU build does not require Gloo and Redis")
check(cpu_body and "libgloo0" in cpu_body.group(1) and "libhiredis" in cpu_body.group(1),
      "Dockerfile: the cpu image lacks Gloo's or hiredis' runtime library")

for f in failures:
    print("FAIL:", f)
if failures:
    sys.exit(1)
print(f"ok: {len(manifests)} manifests and the Dockerfile pass the structural checks")
