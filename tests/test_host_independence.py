"""The suite does not lean on the host it runs on (issue 49).

A test reads only what it sets or what `make test` installs: the njs module and nginx of Debian's
`nginx` and `libnginx-mod-http-js`, which every host that runs the router has, must neither make
a test pass nor fail. The tests that check a config against the host (the njs module, the front's
nginx, the router's keys) run here twice in a mount namespace of their own, over an overlay of
`/usr` (the host's files untouched): once with Debian's files at their default paths, once with
them absent. Both runs must pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NGINX = REPO / ".venv" / "bin" / "nginx"
NJS = REPO / ".venv" / "lib" / "nginx" / "modules" / "ngx_http_js_module.so"
# Debian's paths: what `apt-get install nginx libnginx-mod-http-js` puts there
HOST_NJS = "/usr/lib/nginx/modules/ngx_http_js_module.so"
HOST_NGINX = "/usr/sbin/nginx"

# The tests that check a config against the host's files. Each sets the paths it means.
HOST_READERS = (
    "tests/test_router.py::test_a_router_that_cannot_run_is_left_out_and_the_fronts_go_on",
    "tests/test_router.py::test_check_config_refuses_a_router_that_would_be_dark",
    "tests/test_router.py::test_names_default_to_what_the_serve_answers_to",
    "tests/test_front.py::test_check_config_warns_when_a_fronted_serve_has_no_nginx_or_front_user",
    "tests/test_launch.py::test_check_config_names_the_removed_option",
    "tests/test_launch.py::test_check_config_refuses_a_user_the_host_lacks",
    "tests/test_launch.py::test_show_commands_prints_what_would_run",
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare(1) to lay an overlay over /usr in a mount namespace")


def _script(present: bool, layer: Path) -> str:
    """Shell run in a private mount namespace: /usr overlaid (writes to a tmpfs), Debian's
    nginx and njs module placed at or removed from their default paths, then the tests."""
    place = (f"mkdir -p {Path(HOST_NJS).parent} && cp {NJS} {HOST_NJS} && "
             f"cp {NGINX} {HOST_NGINX}") if present else f"rm -f {HOST_NJS} {HOST_NGINX}"
    nodes = " ".join(HOST_READERS)
    return (f"set -e; mount -t tmpfs tmpfs {layer}; mkdir {layer}/up {layer}/work; "
            f"mount -t overlay overlay -o lowerdir=/usr,upperdir={layer}/up,"
            f"workdir={layer}/work /usr; {place}; "
            f"test {'-e' if present else '! -e'} {HOST_NJS}; "
            f"exec {sys.executable} -m pytest -q -p no:cacheprovider -o addopts= {nodes}")


@pytest.mark.parametrize("present", [True, False], ids=["debian-nginx-present", "absent"])
def test_the_tests_that_check_against_the_host_pass_with_its_nginx_present_or_absent(
        tmp_path: Path, present: bool) -> None:
    layer = tmp_path / "layer"
    layer.mkdir()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", _script(present, layer)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert f"{len(HOST_READERS)} passed" in done.stdout, tail
