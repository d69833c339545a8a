"""Container serves: the podman argv (golden), their config keys, CDI specs, the unit's type,
the fingerprint with the image, and how a container's processes are told apart."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from gpud.config import ServeConfig, config_warnings, parse_config
from gpud.core.launch import cdi_device_name, fingerprint, serve_argv, show_commands
from gpud.core.observation import DeviceSample, ProcessDraw
from gpud.daemon import _warnings
from gpud.errors import ConfigError
from gpud.host import cdi
from gpud.host.cgroups import container_of_cgroup_file, serve_of_cgroup_file
from gpud.host.simulation import SimulatedBackend, SimulatedDevice, register_process
from gpud.host.unit_properties import UnitSpec, build_properties

DIGEST = "docker.io/vllm/vllm-openai@sha256:" + "0123456789abcdef" * 4
LIBPOD_ID = "3f2a1b4c5d6e" + "0" * 52


def _serve(**container: Any) -> ServeConfig:
    return ServeConfig.model_validate({
        "role": "r", "vram_mib": 14336, "port": 30001,
        "environment": {"HF_TOKEN": "hf_secret"},
        "vllm": {"model": "leon-se/gemma-4-E4B-it-FP8-Dynamic", "max_model_len": 32768},
        "container": {"image": DIGEST, **container}})


def test_podman_argv_golden() -> None:
    serve = _serve(volumes=["/var/lib/hf:/root/.cache/huggingface"], shm_size="16g")
    argv = serve_argv(serve, total_mib=32607, device_index=3, vllm_executable="vllm",
                      name="fast", cdi_devices=["GPU-3f6c"],
                      forward_env=["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HF_TOKEN",
                                   "VLLM_NO_USAGE_STATS"])
    assert argv == [
        "podman", "run", "--rm", "--replace", "--name", "gpud-serve-fast",
        "--cgroups=split", "--sdnotify=conmon", "-d", "--pull=never",
        "--device=nvidia.com/gpu=GPU-3f6c", "--publish=127.0.0.1:30001:30001",
        "--shm-size=16g", "--volume=/var/lib/hf:/root/.cache/huggingface:ro",
        "--env=HF_TOKEN", "--env=VLLM_NO_USAGE_STATS", "--stop-timeout=30",
        DIGEST,
        # the image's entrypoint is `vllm serve`; inside, vLLM listens on the container's own
        # interfaces; utilization exactly as for a bare serve (14336 / 32607)
        "leon-se/gemma-4-E4B-it-FP8-Dynamic", "--host", "0.0.0.0", "--port", "30001",
        "--gpu-memory-utilization", "0.4396", "--max-model-len", "32768",
        "--shutdown-timeout", "20",
    ]
    assert not any("hf_secret" in arg for arg in argv)  # values travel in the environment


def test_podman_argv_args_serve_options() -> None:
    serve = ServeConfig.model_validate({
        "role": "r", "vram_mib": 5120, "port": 30007, "stop_timeout_s": 45.5,
        "container": {"image": "localhost/ocr:1", "pull": "missing", "ipc": "host",
                      "volumes": ["/srv/a:/a:rw", "/srv/b:/b:z", "models:/models"],
                      "args": ["--port", "{port}", "--util", "{gpu_memory_utilization}",
                               "--gpu", "{device_index}"]}})
    argv = serve_argv(serve, total_mib=32607, device_index=2, vllm_executable="vllm",
                      name="ocr", cdi_devices=["2", "3"], forward_env=[])
    assert argv == [
        "podman", "run", "--rm", "--replace", "--name", "gpud-serve-ocr",
        "--cgroups=split", "--sdnotify=conmon", "-d", "--pull=missing",
        "--device=nvidia.com/gpu=2", "--device=nvidia.com/gpu=3",
        "--publish=127.0.0.1:30007:30007", "--ipc=host",
        "--volume=/srv/a:/a:rw", "--volume=/srv/b:/b:z,ro", "--volume=models:/models:ro",
        "--stop-timeout=46", "localhost/ocr:1",
        # inside, the serve's device is 0: CDI injected it alone
        "--port", "30007", "--util", "0.1570", "--gpu", "0",
    ]


def test_podman_argv_publishes_on_the_serves_host() -> None:
    serve = ServeConfig.model_validate({
        "role": "r", "vram_mib": 14336, "port": 30001,
        "vllm": {"model": "m", "host": "::"}, "container": {"image": DIGEST}})
    argv = serve_argv(serve, total_mib=32607, device_index=0, vllm_executable="vllm",
                      name="fast", cdi_devices=["0"])
    assert "--publish=[::]:30001:30001" in argv
    assert argv[argv.index("--host") + 1] == "0.0.0.0"


@pytest.mark.parametrize(("container", "extra", "problem"), [
    ({"args": ["x"]}, {}, "with a [vllm] table what follows the image is the table's argv"),
    ({"volumes": ["/a"]}, {}, "must be SOURCE:DESTINATION[:OPTIONS]"),
    ({"volumes": ["/a:rel"]}, {}, "the destination must be an absolute path"),
    ({"volumes": ["/a:/b:bogus"]}, {}, "unknown option 'bogus'"),
    ({"shm_size": "lots"}, {}, "shm_size: 'lots' must be a number"),
    ({"shm_size": "16g", "ipc": "host"}, {}, "shm_size: not with ipc = \"host\""),
    ({"engine": "docker"}, {}, "container.engine: must be one of"),
    ({"pull": "always"}, {}, "container.pull: must be one of"),
    ({"image": "-it"}, {}, "is not an image reference"),
    ({}, {"command": ["/bin/x"]}, "a container serve has no command"),
    ({}, {"vllm": {"model": "m", "executable": "/opt/vllm"}}, "vllm.executable: not with a"),
])
def test_container_config_problems(container: dict[str, Any], extra: dict[str, Any],
                                   problem: str) -> None:
    serve: dict[str, Any] = {"role": "r", "vram_mib": 1024, "vllm": {"model": "m"},
                             "container": {"image": DIGEST, **container}, **extra}
    if "command" in extra:
        del serve["vllm"]
    with pytest.raises(ConfigError) as err:
        parse_config(_toml(serve), "t.toml")
    assert any(problem in p for p in err.value.problems), err.value.problems


def _toml(serve: dict[str, Any]) -> str:
    lines = ['[roles.r]\ndevice = "0"\n[serves.s]']
    for key, value in serve.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {json.dumps(value)}")
    for key, value in serve.items():
        if isinstance(value, dict):
            lines.append(f"[serves.s.{key}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in value.items()]
    return "\n".join(lines) + "\n"


def test_an_image_by_tag_is_a_warning_not_an_error() -> None:
    cfg = parse_config(_toml({"role": "r", "vram_mib": 1024, "vllm": {"model": "m"},
                              "container": {"image": "docker.io/vllm/vllm-openai:latest"}}), "t")
    assert [w.split(":")[0] for w in config_warnings(cfg)] == ["serves.s.container.image"]
    pinned = parse_config(_toml({"role": "r", "vram_mib": 1024, "vllm": {"model": "m"},
                                 "container": {"image": DIGEST}}), "t")
    assert config_warnings(pinned) == []


def test_a_tensor_parallel_container_without_shared_memory_is_warned_about() -> None:
    base = ("[roles.a]\ndevice = \"0\"\ncapacity_mib = 32607\n"
            "[roles.b]\ndevice = \"1\"\ncapacity_mib = 32607\n"
            "[serves.s]\nroles = [\"a\", \"b\"]\nvram_mib = 8000\nport = 30001\n"
            f"[serves.s.vllm]\nmodel = \"m\"\n[serves.s.container]\nimage = \"{DIGEST}\"\n")
    assert config_warnings(parse_config(base, "t")) == [
        "serves.s.container: tensor parallel over 2 devices in a container with podman's 64 MiB "
        "/dev/shm: set container.shm_size (e.g. \"16g\") or container.ipc = \"host\""]
    assert config_warnings(parse_config(base + 'shm_size = "16g"\n', "t")) == []
    assert config_warnings(parse_config(base + 'ipc = "host"\n', "t")) == []


def test_check_config_says_when_no_cdi_spec_offers_a_gpu(tmp_path: Path) -> None:
    cfg = parse_config(_toml({"role": "r", "vram_mib": 1024, "vllm": {"model": "m"},
                              "container": {"image": DIGEST}}), "t")
    assert any("no CDI spec offers nvidia.com/gpu" in w for w in _warnings(cfg, (tmp_path,)))
    (tmp_path / "nvidia.json").write_text(json.dumps(
        {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [{"name": "0"}]}))
    assert not any("CDI" in w for w in _warnings(cfg, (tmp_path,)))


def test_show_commands_prints_the_podman_argv() -> None:
    cfg = parse_config(_toml({"role": "r", "vram_mib": 14336, "port": 30001,
                              "vllm": {"model": "m"}, "container": {"image": DIGEST}}), "t")
    devices = (DeviceSample("GPU-a", 0, "", "", 32607, None, None),)
    lines = show_commands(cfg, devices, "test", cdi_names={"0"})
    argv = [line for line in lines if line.startswith("  argv: ")]
    assert argv == [f"  argv: podman run --rm --replace --name gpud-serve-s --cgroups=split "
                    "--sdnotify=conmon -d --pull=never --device=nvidia.com/gpu=0 "
                    "--publish=127.0.0.1:30001:30001 --env=VLLM_ENGINE_READY_TIMEOUT_S "
                    "--env=VLLM_NO_USAGE_STATS --env=VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS "
                    f"--stop-timeout=30 {DIGEST} m --host 0.0.0.0 --port 30001 "
                    "--gpu-memory-utilization 0.4396 --shutdown-timeout 20"]
    refused = show_commands(cfg, devices, "test", cdi_names=set())
    assert any("refused: no CDI spec offers nvidia.com/gpu=GPU-a" in line for line in refused)


def test_cdi_names_prefer_the_uuid() -> None:
    assert cdi_device_name("GPU-a", 1, {"1", "GPU-a", "all"}) == "GPU-a"
    assert cdi_device_name("GPU-a", 1, {"0", "1", "all"}) == "1"
    assert cdi_device_name("GPU-a", 1, {"0", "all"}) is None
    assert cdi_device_name("GPU-a", 1, None) == "GPU-a"


def test_cdi_yaml_spec_as_nvidia_ctk_writes_it(tmp_path: Path) -> None:
    (tmp_path / "nvidia.yaml").write_text(
        "---\ncdiVersion: 0.5.0\ncontainerEdits:\n  deviceNodes:\n  - path: /dev/nvidiactl\n"
        "devices:\n- containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n  name: \"0\"\n"
        "- containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n"
        "  name: GPU-3f6c1111-2222\n- name: all\n  containerEdits:\n    deviceNodes:\n"
        "    - path: /dev/nvidia0\nkind: nvidia.com/gpu\n")
    (tmp_path / "other.json").write_text(json.dumps({"kind": "vendor.com/fpga",
                                                     "devices": [{"name": "x"}]}))
    (tmp_path / "broken.json").write_text("{")
    names, read = cdi.gpu_names((tmp_path, tmp_path / "missing"))
    assert names == {"0", "GPU-3f6c1111-2222", "all"}
    assert sorted(Path(p).name for p in read) == ["nvidia.yaml", "other.json"]


# The layout `nvidia-ctk cdi generate` writes (NVIDIA/nvidia-container-toolkit,
# cmd/nvidia-ctk/cdi/generate/generate_test.go: a `---` first, sequences indented by four,
# `name: "0"` quoted, `all` plain, containerEdits beside each name and at the top), with
# --device-name-strategy=index and uuid both present, a MIG device, and comments.
NVIDIA_CTK_YAML = """---
# generated by nvidia-ctk cdi generate
cdiVersion: 0.5.0
kind: nvidia.com/gpu   # the kind podman's --device names
devices:
    - name: "0"
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
              hostPath: /dev/nvidia0
    - name: GPU-3f6c1111-2222-3333-4444-555566667777
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
    # a MIG device, by index
    - name: '0:1'
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia-caps/nvidia-cap12
    - name: all
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
        hooks:
            - hookName: createContainer
              path: /usr/bin/nvidia-cdi-hook
              args:
                - nvidia-cdi-hook
                - chmod
                - --mode
                - "755"
              env:
                - NVIDIA_CTK_DEBUG=false
containerEdits:
    env:
        - NVIDIA_VISIBLE_DEVICES=void
    deviceNodes:
        - path: /dev/nvidiactl
    hooks:
        - hookName: createContainer
          path: /usr/bin/nvidia-cdi-hook
          args:
            - nvidia-cdi-hook
            - update-ldcache
    mounts:
        - hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
          containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
          options:
            - ro
            - nosuid
"""


def test_cdi_spec_in_nvidia_ctks_layout() -> None:
    assert cdi.parse_spec(NVIDIA_CTK_YAML, "nvidia.yaml") == (
        "nvidia.com/gpu", ["0", "GPU-3f6c1111-2222-3333-4444-555566667777", "0:1", "all"])
    # the same spec as JSON (CDI allows .json; nvidia-ctk --format=json), and JSON in a .yaml
    as_json = json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [
        {"name": n, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}
        for n in ("0", "GPU-a", "all")], "containerEdits": {"env": ["A=1"]}}, indent=2)
    assert cdi.parse_spec(as_json, "nvidia.json") == ("nvidia.com/gpu", ["0", "GPU-a", "all"])
    assert cdi.parse_spec(as_json, "nvidia.yaml") == ("nvidia.com/gpu", ["0", "GPU-a", "all"])
    # a device's keys in another order, quoted keys, `-` alone on its line, no devices at all
    assert cdi.parse_spec('kind: "vendor.com/x"\ndevices:\n  -\n    "name": a\n  - '
                          'annotations:\n      k: v\n    name: b  # two\n', "x.yml") == \
        ("vendor.com/x", ["a", "b"])
    assert cdi.parse_spec("kind: nvidia.com/gpu\ndevices: []\n", "x.yaml") == \
        ("nvidia.com/gpu", [])
    # ` #` inside quotes is no comment; after them it is
    assert cdi.parse_spec("kind: 'k/x #y' # z\ndevices:\n- name: \"a\" # b\n", "x.yaml") == \
        ("k/x #y", ["a"])


# Valid YAML that nvidia-ctk does not write but a hand-edited or another tool's spec may hold;
# podman's CDI library reads all of it, so gpud must too.
FLOW_STYLE_YAML = """\
{cdiVersion: 0.5.0, kind: nvidia.com/gpu,
 devices: [{name: '0', containerEdits: {deviceNodes: [{path: /dev/nvidia0}]}},
           {name: all, containerEdits: {deviceNodes: [{path: /dev/nvidia0}]}}],
 containerEdits: {env: [NVIDIA_VISIBLE_DEVICES=void]}}
"""
ANCHORS_YAML = """\
---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
    - &gpu0
      name: "0"
      containerEdits: &edits0
        deviceNodes:
            - path: /dev/nvidia0
    - <<: *gpu0
      name: GPU-3f6c1111-2222-3333-4444-555566667777
    - name: all
      containerEdits:
        <<: *edits0
        env: [A=1]
"""
MULTI_DOCUMENT_YAML = """\
%YAML 1.1
---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
    - name: "1"
      containerEdits: {deviceNodes: [{path: /dev/nvidia1}]}
---
# a second document: CDI's parser reads the first, and so does gpud
kind: vendor.com/other
devices: [{name: x}]
"""


@pytest.mark.parametrize(("text", "names"), [
    (FLOW_STYLE_YAML, ["0", "all"]),
    (ANCHORS_YAML, ["0", "GPU-3f6c1111-2222-3333-4444-555566667777", "all"]),
    (MULTI_DOCUMENT_YAML, ["1"]),
    ("kind: nvidia.com/gpu\ndevices:\n- name: |-\n    a\n", ["a"]),
], ids=["flow-style", "anchors", "multi-document", "block-scalar"])
def test_cdi_yaml_beyond_nvidia_ctks_layout_is_read(text: str, names: list[str]) -> None:
    assert cdi.parse_spec(text, "nvidia.yaml") == ("nvidia.com/gpu", names)


def test_cdi_flow_style_spec_offers_its_gpus(tmp_path: Path) -> None:
    (tmp_path / "nvidia.yaml").write_text(FLOW_STYLE_YAML)
    found = cdi.scan((tmp_path,))
    assert (found.names, found.problems) == ({"0", "all"}, [])


@pytest.mark.parametrize(("text", "why"), [
    ("kind: nvidia.com/gpu\ndevices: [{name: '0'}\n", "line 3: not valid YAML"),
    ("kind: nvidia.com/gpu\ndevices:\n\t- name: a\n", "line 3: not valid YAML"),
    ("kind: nvidia.com/gpu\ndevices:\n- name: *nowhere\n", "line 3: not valid YAML"),
    ("kind: nvidia.com/gpu\ndevices:\n- name: !!python/name:os.system a\n", "not valid YAML"),
    ("kind: nvidia.com/gpu\ndevices:\n- containerEdits:\n    env: []\n", 'devices[0] has no "name" string'),
    ("kind: nvidia.com/gpu\ndevices:\n- name: 0\n", "(0 unquoted is not a string in YAML)"),
    ("kind: nvidia.com/gpu\ndevices:\n- name: a b\n", "not a CDI device name"),
    ("kind: nvidia.com/gpu\ndevices:\n- name: |\n    a\n", "not a CDI device name"),
    ("kind: nvidia.com/gpu\ndevices:\n- name: a\n  name: b\n", "line 4: not valid YAML: 'name' a second time"),
    ("kind: nvidia.com/gpu\nkind: x/y\n", "line 2: not valid YAML: 'kind' a second time"),
    ("kind: nvidia.com/gpu\ndevices: {a: 1}\n", '"devices" is not a list'),
    ("devices:\n- name: a\n", 'no "kind" string'),
    ("- kind: nvidia.com/gpu\n", "not a mapping"),
    ("kind nvidia.com/gpu\n", "not a mapping"),
    ("", "not a mapping"),
])
def test_cdi_yaml_gpud_cannot_read_is_refused_with_its_line(text: str, why: str) -> None:
    with pytest.raises(cdi.SpecError, match=re.escape(why)):
        cdi.parse_spec(text, "nvidia.yaml")


@pytest.mark.parametrize(("text", "why"), [
    ("{", "not valid JSON"), ("[]", "not a mapping"), ('{"devices": []}', '"kind"'),
    ('{"kind": "nvidia.com/gpu", "devices": {}}', '"devices" is not a list'),
    ('{"kind": "nvidia.com/gpu", "devices": [{"nam": "0"}]}', 'devices[0] has no "name"'),
    ('{"kind": "nvidia.com/gpu", "devices": [{"name": "-x"}]}', "not a CDI device name"),
])
def test_cdi_json_gpud_cannot_read_is_refused(text: str, why: str) -> None:
    with pytest.raises(cdi.SpecError, match=re.escape(why)):
        cdi.parse_spec(text, "nvidia.json")


def test_an_unreadable_spec_is_named_where_gpud_reports_cdi(tmp_path: Path) -> None:
    (tmp_path / "nvidia.yaml").write_text("kind: nvidia.com/gpu\ndevices: [{name: '0'}\n")
    found = cdi.scan((tmp_path,))
    assert found.names == set() and found.read == []
    assert found.problems == [f"{tmp_path / 'nvidia.yaml'}: line 3: not valid YAML: expected ',' "
                              "or ']', but got '<stream end>'"]
    cfg = parse_config(_toml({"role": "r", "vram_mib": 1024, "vllm": {"model": "m"},
                              "container": {"image": DIGEST}}), "t")
    warned = _warnings(cfg, (tmp_path,))
    assert any(str(tmp_path / "nvidia.yaml") in w and "not valid YAML" in w for w in warned), warned
    assert any("no CDI spec offers nvidia.com/gpu" in w for w in warned), warned
    # beside a spec that reads, the one that does not is still said
    (tmp_path / "other.json").write_text(json.dumps({"kind": "nvidia.com/gpu",
                                                     "devices": [{"name": "0"}]}))
    warned = _warnings(cfg, (tmp_path,))
    assert [w for w in warned if "CDI" in w] == [
        f"container serves: CDI spec {found.problems[0]}"], warned


def test_the_image_is_part_of_the_fingerprint() -> None:
    bare = ServeConfig.model_validate({"role": "r", "vram_mib": 1024, "vllm": {"model": "m"}})
    a = _serve()
    b = ServeConfig.model_validate({**a.model_dump(), "container": {
        "image": DIGEST.replace("0123", "4567")}})
    assert len({fingerprint(bare), fingerprint(a), fingerprint(b)}) == 3
    # what does not change the memory behaviour keeps the calibration
    c = ServeConfig.model_validate({**a.model_dump(), "container": {
        "image": DIGEST, "volumes": ["/x:/y"]}})
    assert fingerprint(c) == fingerprint(a)


def test_a_container_unit_is_notify_with_delegation() -> None:
    spec = UnitSpec(serve="fast", argv=("/usr/bin/podman", "run"), device_index=0,
                    description="d", container=True)
    props = {name: v.value for name, v in build_properties(spec, 252)}
    assert (props["Type"], props["NotifyAccess"], props["Delegate"]) == ("notify", "all", True)
    assert props["KillMode"] == "mixed"
    plain = {name for name, _ in build_properties(
        UnitSpec(serve="fast", argv=("/bin/x",), device_index=0, description="d"), 252)}
    assert not plain & {"NotifyAccess", "Delegate"}


@pytest.mark.parametrize(("text", "serve", "container"), [
    (f"0::/gpud.slice/gpud-serve-fast.service/libpod-payload-{LIBPOD_ID}\n", "fast",
     "libpod-payload-3f2a1b4c5d6e"),
    (f"0::/machine.slice/libpod-{LIBPOD_ID}.scope/container\n", None, "libpod-3f2a1b4c5d6e"),
    (f"0::/system.slice/docker-{LIBPOD_ID}.scope\n", None, "docker-3f2a1b4c5d6e"),
    (f"12:memory:/docker/{LIBPOD_ID}\n0::/\n", None, "docker-3f2a1b4c5d6e"),
    ("0::/user.slice/user-1000.slice/session-2.scope\n", None, None),
    ("0::/gpud.slice/gpud-serve-ocr.service\n", "ocr", None),
])
def test_container_processes_are_told_apart(text: str, serve: str | None,
                                            container: str | None) -> None:
    assert serve_of_cgroup_file(text) == serve
    found = container_of_cgroup_file(text)
    assert (found[0] if found else None) == container


def _fake_proc(root: Path, pid: str, pidns: int, nspid: str | None = None,
               started: int = 777) -> None:
    (root / pid / "ns").mkdir(parents=True)
    # readlink of /proc/P/ns/pid gives "pid:[INODE]": a dangling symlink reads the same
    os.symlink(f"pid:[{pidns}]", root / pid / "ns" / "pid")
    (root / pid / "status").write_text(f"Name:\tx\nNSpid:\t{pid}\t{nspid or pid}\n")
    (root / pid / "stat").write_text(f"{pid} (x) S " + " ".join(["0"] * 18) + f" {started} 0\n")


def test_a_containers_registration_is_reported_by_host_pid(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _fake_proc(proc, "self", 100)
    _fake_proc(proc, "4242", 200, nspid="2")   # PID 2 inside the container
    _fake_proc(proc, "4243", 300, nspid="2", started=555)   # another container's PID 2
    procs = tmp_path / "sim-procs"
    inside = tmp_path / "inside"               # the container's own /proc
    _fake_proc(inside, "2", 200)
    path = register_process(procs, 2, "GPU-sim-0", 7000, proc_root=inside, host_pidns=100)
    assert path.name == "2.ns200.json"
    # the same PID in the host's namespace keeps the plain name
    assert register_process(procs, 4243, "GPU-sim-0", 10, proc_root=proc,
                            host_pidns=300).name == "4243.json"
    # gpud.service cannot read a container process's /proc/P/ns/pid (no ptrace access): the
    # host PID is found from what anyone can read
    os.unlink(proc / "4242" / "ns" / "pid")
    (tmp_path / "sim.json").write_text("{}")
    sim = SimulatedBackend([SimulatedDevice("GPU-sim-0", 32607)], tmp_path / "sim.json",
                           procs_dir=procs, proc_root=proc)
    obs = sim.sample()
    assert obs.devices[0].processes == (ProcessDraw(4242, 7000), ProcessDraw(4243, 10))
    assert sim.environment_for("GPU-sim-0")["GPUD_SIM_PIDNS"] == "100"


def test_what_a_container_runs_needs_root() -> None:
    from gpud.core.authority import needs_root

    old = parse_config(_toml({"role": "r", "vram_mib": 1024, "vllm": {"model": "m"},
                              "container": {"image": DIGEST}}), "t")
    new = parse_config(_toml({"role": "r", "vram_mib": 2048, "vllm": {"model": "m"},
                              "container": {"image": DIGEST.replace("0123", "4567"),
                                            "volumes": ["/:/host:rw"]}}), "t")
    assert needs_root(old, new) == ["serves.s.container.image", "serves.s.container.volumes"]
