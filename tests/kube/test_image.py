"""The workload image (scripts/build-image.sh, ./Containerfile) in a pod of the kube-local node, locked
down as the run's manifests lock every workload container (uid 1000, read-only root, every
capability dropped, /tmp an emptyDir): the project is installed in the image's venv, not editable,
and every entry point the manifests run imports, vLLM's CPU build and torch included.

Needs the node (``POSTTRAIN_KUBE_NODE=1``, tests/kube/test_node.py) and the image imported into it: the
``images`` fixture builds it (``bash scripts/build-image.sh``, about 4.5 GB) when the tests started the
node, as CI does; on a node started by hand without the image the test is skipped, saying so.
"""

from __future__ import annotations

import json

from tests.kube.test_node import IMAGES, images, node, wait_phase  # noqa: F401  (the node and images fixtures)
from training.planner import k8s

IMAGE = "posttrain.local/posttrain:local"  # the image of scripts/build-image.sh, as the images fixture has it
assert IMAGE in IMAGES

PROBE = r"""
import importlib, json, os, sys
for module in ("training.__main__", "serving.replica", "serving.router", "serving.capture", "sandboxes.pool",
               "serving.engines.vllm_server"):
    importlib.import_module(module)
import torch, vllm, training
try:
    open("/opt/posttrain/written-by-the-pod", "w")
    writable = True
except OSError:
    writable = False
print(json.dumps({"uid": os.getuid(), "python": sys.executable, "training": training.__file__, "torch": torch.__version__,
                  "vllm": vllm.__version__, "root_writable": writable, "cwd": os.getcwd()}))
"""


def test_the_image_runs_every_entry_point_as_uid_1000_from_its_own_venv(admin, namespace, images):  # noqa: F811
    from kubernetes import client

    core = client.CoreV1Api(admin)
    core.create_namespaced_pod(namespace, {"metadata": {"name": "image"}, "spec": {
        "restartPolicy": "Never", "automountServiceAccountToken": False, "securityContext": dict(k8s.POD_SECURITY),
        "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never", "command": ["python", "-c", PROBE],
                        "workingDir": k8s.DATA_MOUNT, "env": [{"name": "HOME", "value": "/tmp/home"}],
                        "securityContext": dict(k8s.CONTAINER_SECURITY), "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}],
        "volumes": [{"name": "tmp", "emptyDir": {}}]}})
    done = wait_phase(core, namespace, "image", ("Succeeded", "Failed"), timeout_s=600)
    log = core.read_namespaced_pod_log("image", namespace, _preload_content=False).data.decode()
    print(log)
    assert done.status.phase == "Succeeded", log
    seen = json.loads(log.strip().splitlines()[-1])
    assert seen["uid"] == 1000 and seen["cwd"] == k8s.DATA_MOUNT and not seen["root_writable"]
    assert seen["python"] == "/opt/posttrain/bin/python"
    assert seen["training"].startswith("/opt/posttrain/lib/python3.11/site-packages/training/")  # installed, not a checkout
    assert seen["torch"].startswith("2.13.0") and seen["vllm"]
    core.delete_namespaced_pod("image", namespace, grace_period_seconds=0)
