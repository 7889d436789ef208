"""A fake `gcloud` for `gcloud compute tpus tpu-vm` and `gcloud compute tpus queued-resources`:
a simulated Cloud TPU zone whose workers are directories on this machine.

Simulated, and where each behaviour comes from:
- `tpu-vm create NAME --accelerator-type=T --version=V [--spot]` waits for the node and
  leaves it READY (gcloud waits for the long-running operation unless --async; the node
  states are the TPU API's Node.State: CREATING, READY, PREEMPTED, TERMINATED, ...: "REST
  Resource: projects.locations.nodes"). A name in use fails with ALREADY_EXISTS.
- The runtime version must suit the accelerator ("TPU software versions":
  tpu-ubuntu2204-base for v2-v4, v2-alpha-tpuv5-lite for v5e, v2-alpha-tpuv5 for v5p,
  v2-alpha-tpuv6e for v6e); the API rejects others with INVALID_ARGUMENT.
- `describe NAME --format=value(...)` prints the projected field; `value()` joins a list's
  items with `;` (`gcloud topic formats`, `gcloud topic projections`). A missing resource is
  `NOT_FOUND` on stderr, exit 1.
- `tpu-vm ssh NAME --worker=all|N --command=CMD` runs CMD on every (or one) worker, all
  workers at once, through the user's shell on the VM (bash here) and returns when they
  have all returned, failing if one failed ("Connect to a TPU VM", `gcloud compute tpus
  tpu-vm ssh`). A process started in the background survives the session. A worker here is
  a directory: its HOME, and its /tmp as LIBTPU_LOCKFILE's directory; its PATH has the
  image's python3, Python 3.10 on the Ubuntu 22.04 images, and curl.
- `tpu-vm scp SRC NAME:DEST` or `NAME:SRC DEST`, `--worker=all|N` (`gcloud compute tpus
  tpu-vm scp`).
- `queued-resources create NAME --node-id=N --accelerator-type=T --runtime-version=V
  [--spot]`, `describe --format=value(state.state)`, `delete --force --quiet` ("Manage
  queued resources"; QueuedResourceState.State): a request goes ACCEPTED, then
  WAITING_FOR_RESOURCES until capacity frees up, then PROVISIONING and ACTIVE, when its
  node exists and is READY. Deleting a queued resource whose node exists needs --force,
  which deletes the node too. Here each describe is one tick of the clock: the request
  waits FAKE_QUEUE_TICKS ticks (default 2; `never`: capacity never frees up).
- Preemption (`preempt`, called by the tests): a spot TPU VM's node becomes PREEMPTED and
  its processes are killed at once: Cloud TPU promises no notice before it preempts a Spot
  VM ("Manage TPU Spot VMs"; FAKE_PREEMPT_NOTICE=N gives N seconds of SIGTERM first, as
  Compute Engine's Spot VMs get 30); a queued resource's spot node is deleted and the
  request becomes SUSPENDED ("Manage queued resources": a preempted spot queued resource is
  SUSPENDED and must be deleted and created again).
- stderr is not output: gcloud writes its status messages, warnings and update notices to
  stderr and a command's result to stdout ("Scripting gcloud CLI commands"; the periodic
  "Updates are available for some Google Cloud CLI components" notice, which
  `gcloud config set component_manager/disable_update_check true` turns off). With
  FAKE_GCLOUD_NOISE=1 every command writes such a notice and a warning to stderr.
- Failures that are not about the resource (`fault`, set by the tests in
  $FAKE_STATE/faults.json: for each verb, the failures its next calls meet, in order):
  `503`, `500` and `429` are the API's UNAVAILABLE, INTERNAL and RESOURCE_EXHAUSTED
  ("API design guide: Errors", google.rpc.Code and its HTTP mapping; UNAVAILABLE and
  RESOURCE_EXHAUSTED are the ones to retry with backoff); `network` is gcloud failing to
  reach the API; `capacity` is a stock-out, the create's operation failing with code 8
  (RESOURCE_EXHAUSTED) and "There is no more capacity in the zone ..." (the Create Node API
  fails when capacity is short; queued resources wait for it instead: "Manage queued
  resources") and creating nothing; `255` is an SSH connection that could not be made or
  dropped (ssh(1): "ssh exits ... with 255 if an error occurred"), the command not run. The
  wording of each message is the fake's; the status names and codes are the API's.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import common

FAKES = os.path.dirname(os.path.abspath(__file__))
RUNTIMES = {
    "v2": "tpu-ubuntu2204-base",
    "v3": "tpu-ubuntu2204-base",
    "v4": "tpu-ubuntu2204-base",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}


def error(command: str, message: str, code: int = 1):
    common.fail(f"({command})", message, code)


FAULTS = {
    "503": "[HTTP 503] UNAVAILABLE: The service is currently unavailable.",
    "500": "[HTTP 500] INTERNAL: Internal error encountered.",
    "429": "[HTTP 429] RESOURCE_EXHAUSTED: Quota exceeded for quota metric 'Read requests' "
    "of service 'tpu.googleapis.com'.",
}


def noise() -> None:
    if os.environ.get("FAKE_GCLOUD_NOISE") == "1":
        print(
            "WARNING: Property validation for compute/zone was skipped.\n\n"
            "Updates are available for some Google Cloud CLI components.  To install them,\n"
            "please run:\n  $ gcloud components update\n",
            file=sys.stderr,
        )


def fault(verb: str) -> str | None:
    """The next failure scripted for `verb` (consumed), or None."""
    with common.locked():
        faults = common.load("faults.json", {})
        if not faults.get(verb):
            return None
        kind = faults[verb].pop(0)
        common.save("faults.json", faults)
    return kind


def fail_with(kind: str, where: str, zone: str) -> None:
    if kind == "network":
        print(
            "ERROR: gcloud crashed (ConnectionError): HTTPSConnectionPool(host="
            "'tpu.googleapis.com', port=443): Max retries exceeded",
            file=sys.stderr,
        )
        sys.exit(1)
    if kind == "capacity":
        error(
            where,
            '{"code": 8, "message": "There is no more capacity in the zone \\"'
            + zone
            + '\\"; you can try in another zone where Cloud TPU Nodes are offered '
            '(see https://cloud.google.com/tpu/docs/regions) [EID: 0x5eed]"}',
        )
    if kind == "255":
        print("ssh: connect to host 10.130.0.2 port 22: Connection timed out", file=sys.stderr)
        sys.exit(255)
    error(where, FAULTS[kind])


def split(argv: list[str]) -> tuple[list[str], dict]:
    positional, flags = [], {}
    for arg in argv:
        if arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            flags[key] = value if eq else True
        else:
            positional.append(arg)
    return positional, flags


def cluster() -> dict:
    return common.load("tpu.json", {"nodes": {}, "queued": {}})


def node_dir(name: str, incarnation: int) -> str:
    return os.path.join(common.state_dir(), "tpus", f"{name}.{incarnation}")


def worker_home(name: str, node: dict, worker: int) -> str:
    return os.path.join(node_dir(name, node["incarnation"]), f"worker-{worker}")


def new_node(state: dict, name: str, accelerator: str, runtime: str, spot: bool, where: str):
    generation = accelerator.split("-")[0]
    if RUNTIMES.get(generation) != runtime:
        error(
            where,
            f"INVALID_ARGUMENT: runtime version {runtime!r} is not supported for accelerator "
            f"type {accelerator!r}",
        )
    incarnation = state.get("incarnations", 0) + 1
    state["incarnations"] = incarnation
    node = {
        "state": "READY",
        "accelerator": accelerator,
        "runtime": runtime,
        "spot": spot,
        "workers": int(os.environ.get("FAKE_TPU_WORKERS", "2")),
        "incarnation": incarnation,
    }
    install_worker_tools()
    for worker in range(node["workers"]):
        os.makedirs(os.path.join(worker_home(name, node, worker), "tmp"))
    state["nodes"][name] = node
    return node


def kill_processes(name: str, node: dict, notice: float = 0.0) -> None:
    """Stops every process started on the node's workers (SIGTERM, then SIGKILL)."""
    import psutil

    marker = f"{name}.{node['incarnation']}"
    victims = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("FAKE_TPU_NODE") == marker:
                victims.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    for process in victims:
        try:
            process.send_signal(signal.SIGTERM if notice else signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    if notice:
        _, alive = psutil.wait_procs(victims, timeout=notice)
        for process in alive:
            process.kill()


def remove_node(state: dict, name: str) -> None:
    node = state["nodes"].pop(name)
    kill_processes(name, node)


def describe(resource: dict, fmt: str, name: str) -> str:
    field = fmt[len("value(") : -1] if fmt.startswith("value(") else ""
    if field == "networkEndpoints[].ipAddress":
        return ";".join(f"10.130.0.{i + 2}" for i in range(resource["workers"]))
    if field in ("state", "state.state"):
        return resource["state"]
    return json.dumps(resource)


def worker_bin() -> str:
    """The directory of the image's tools on every worker's PATH (python3, curl)."""
    return os.path.join(common.state_dir(), "worker-bin")


def install_worker_tools() -> None:
    """Puts the image's tools in place, once, before the first node exists. It runs under
    the cluster's lock (nodes are created under it), never beside an `ssh` (which runs
    without the lock): two ssh sessions that each made the directory raced, one failing on
    the other's directory or running a worker before its tools were written."""
    bin_dir = worker_bin()
    if os.path.isdir(bin_dir):
        return
    os.makedirs(bin_dir)
    for tool in ("python3", "curl"):
        path = os.path.join(bin_dir, tool)
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\nexec "{sys.executable}" "{FAKES}/worker_tools.py" {tool} "$@"\n')
        os.chmod(path, 0o755)


def worker_environment(name: str, node: dict, worker: int) -> dict:
    bin_dir = worker_bin()
    home = worker_home(name, node, worker)
    env = {
        k: v for k, v in os.environ.items() if k.startswith(("FAKE_", "LANG", "LC_")) or k == "TERM"
    }
    env.update(
        HOME=home,
        PATH=f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        LIBTPU_LOCKFILE=os.path.join(home, "tmp", "libtpu_lockfile"),
        FAKE_TPU_NODE=f"{name}.{node['incarnation']}",
        FAKE_TPU_WORKER=str(worker),
        FAKE_TPU_WORKERS=str(node["workers"]),
    )
    return env


def workers(node: dict, flag) -> list[int]:
    if flag in (True, None):
        return [0]
    return list(range(node["workers"])) if flag == "all" else [int(flag)]


def ready_node(state: dict, name: str, where: str) -> dict:
    node = state["nodes"].get(name)
    if node is None:
        error(where, f"NOT_FOUND: Resource 'nodes/{name}' was not found")
    if node["state"] != "READY":
        error(where, f"node {name} is {node['state']}: its workers cannot be reached", 255)
    return node


def tpu_vm(verb: str, positional: list[str], flags: dict) -> int:
    where = f"gcloud.compute.tpus.tpu-vm.{verb}"
    state = cluster()
    if verb == "create":
        name = positional[0]
        if name in state["nodes"]:
            error(where, f"ALREADY_EXISTS: node {name} already exists")
        new_node(state, name, flags["accelerator-type"], flags["version"], "spot" in flags, where)
        common.save("tpu.json", state)
        return 0
    if verb == "describe":
        node = state["nodes"].get(positional[0])
        if node is None:
            error(where, f"NOT_FOUND: Resource 'nodes/{positional[0]}' was not found")
        print(describe(node, flags.get("format", ""), positional[0]))
        return 0
    if verb == "delete":
        if positional[0] not in state["nodes"]:
            error(where, f"NOT_FOUND: Resource 'nodes/{positional[0]}' was not found")
        remove_node(state, positional[0])
        common.save("tpu.json", state)
        return 0
    if verb == "ssh":
        name = positional[0]
        node = ready_node(state, name, where)
        runs = [
            subprocess.Popen(
                ["bash", "-c", flags["command"]],
                cwd=worker_home(name, node, w),
                env=worker_environment(name, node, w),
            )
            for w in workers(node, flags.get("worker"))
        ]
        return max(run.wait() for run in runs)
    if verb == "scp":
        source, dest = positional
        remote_is_dest = ":" in dest
        name, remote = (dest if remote_is_dest else source).split(":", 1)
        node = ready_node(state, name, where)
        for w in workers(node, flags.get("worker")):
            path = os.path.join(worker_home(name, node, w), remote.removeprefix("~/"))
            if remote_is_dest:
                shutil.copy(source, path)
            elif not os.path.exists(path):
                error(where, f"scp: {remote}: No such file or directory")
            else:
                shutil.copy(path, dest)
        return 0
    error(where, f"the fake does not know tpu-vm {verb}")


def queued_resources(verb: str, positional: list[str], flags: dict) -> int:
    where = f"gcloud.compute.tpus.queued-resources.{verb}"
    state = cluster()
    name = positional[0]
    request = state["queued"].get(name)
    if verb == "create":
        if request is not None:
            error(where, f"ALREADY_EXISTS: queued resource {name} already exists")
        generation = flags["accelerator-type"].split("-")[0]
        if RUNTIMES.get(generation) != flags["runtime-version"]:
            error(
                where,
                f"INVALID_ARGUMENT: runtime version {flags['runtime-version']!r} is "
                f"not supported for accelerator type {flags['accelerator-type']!r}",
            )
        state["queued"][name] = {
            "state": "ACCEPTED",
            "ticks": 0,
            "node_id": flags["node-id"],
            "accelerator": flags["accelerator-type"],
            "runtime": flags["runtime-version"],
            "spot": "spot" in flags,
        }
        common.save("tpu.json", state)
        return 0
    if request is None:
        error(where, f"NOT_FOUND: Resource 'queuedResources/{name}' was not found")
    if verb == "describe":
        waiting = os.environ.get("FAKE_QUEUE_TICKS", "2")
        request["ticks"] += 1
        if request["state"] == "ACCEPTED":
            request["state"] = "WAITING_FOR_RESOURCES"
        elif request["state"] == "WAITING_FOR_RESOURCES" and waiting != "never":
            if request["ticks"] > int(waiting):
                request["state"] = "PROVISIONING"
        elif request["state"] == "PROVISIONING":
            new_node(
                state,
                request["node_id"],
                request["accelerator"],
                request["runtime"],
                request["spot"],
                where,
            )
            request["state"] = "ACTIVE"
        common.save("tpu.json", state)
        print(describe(request, flags.get("format", ""), name))
        return 0
    if verb == "delete":
        if request["node_id"] in state["nodes"]:
            if "force" not in flags:
                error(
                    where,
                    f"FAILED_PRECONDITION: queued resource {name} has a node; "
                    "delete it with --force",
                )
            remove_node(state, request["node_id"])
        del state["queued"][name]
        common.save("tpu.json", state)
        return 0
    error(where, f"the fake does not know queued-resources {verb}")


def preempt(name: str) -> None:
    """Preempts the spot node `name` (a plain TPU VM or a queued resource's)."""
    with common.locked():
        _preempt(name)


def _preempt(name: str) -> None:
    state = cluster()
    notice = float(os.environ.get("FAKE_PREEMPT_NOTICE", "0"))
    request = next((r for r in state["queued"].values() if r["node_id"] == name), None)
    node = state["nodes"][name]
    assert node["spot"], f"only spot nodes are preempted; {name} is not one"
    kill_processes(name, node, notice)
    if request is not None:
        del state["nodes"][name]
        request["state"] = "SUSPENDED"
    else:
        node["state"] = "PREEMPTED"
    common.save("tpu.json", state)


def main(argv):
    if argv[:1] == ["--fake-preempt"]:  # the tests' hook, not a gcloud command
        preempt(argv[1])
        return 0
    common.record("gcloud", argv)
    noise()
    positional, flags = split(argv)
    if positional[:2] != ["compute", "tpus"] or len(positional) < 4:
        error("gcloud", f"the fake knows only `compute tpus ...`, not {argv}")
    group, verb, rest = positional[2], positional[3], positional[4:]
    kind = fault(verb)
    if kind is not None:
        fail_with(kind, f"gcloud.compute.tpus.{group}.{verb}", flags.get("zone", ""))
    if group == "tpu-vm" and verb in ("ssh", "scp"):
        return tpu_vm(verb, rest, flags)  # reads the state; commands run without the lock
    with common.locked():
        if group == "tpu-vm":
            return tpu_vm(verb, rest, flags)
        if group == "queued-resources":
            return queued_resources(verb, rest, flags)
    error("gcloud", f"the fake does not know `compute tpus {group}`")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
