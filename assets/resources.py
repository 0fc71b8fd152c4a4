"""Resources: where a deployment keeps its files, and how it launches workloads.

``PosttrainStorage`` is the one root under which every asset and run writes (a local folder by
default, a shared volume on a cluster). ``WorkloadLauncher`` runs a workload module (the trainer,
an engine, the router, the sandbox pool) either as a local subprocess or as a Kubernetes pod, both
through Dagster Pipes so the workload's logs, metadata and progress reach the Dagster UI.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import dagster as dg

from assets.partitions import parse_checkpoint_partition_key
from sandboxes.home import default_home
from sandboxes.httpserver.auth import process_credential
from training.checkpoint import checkpoint_path, run_path, runs_root
from training.planner import TRAINER_MODULE, k8s, runner, trainer_args


class PosttrainStorage(dg.ConfigurableResource):
    """The root folder of a posttrain deployment and the layout beneath it (a run's own folder is
    laid out by :mod:`training.checkpoint`)."""

    root: str | None = None  # None: $POSTTRAIN_HOME, else ./posttrain-data, read when used

    @property
    def path(self) -> Path:
        return Path(self.root).expanduser().resolve() if self.root else default_home()

    def datasets_dir(self) -> Path:
        return self.path / "datasets"

    def images_dir(self) -> Path:
        return self.path / "images"

    def curriculum_dir(self) -> Path:
        return self.path / "curriculum"

    def runs_dir(self) -> Path:
        return runs_root(self.path)

    def run_dir(self, run_name: str) -> Path:
        return run_path(self.path, run_name)

    def checkpoint_dir(self, partition_key: str) -> Path:
        """The folder of the checkpoint named by a ``checkpoints`` partition key."""
        run_name, step = parse_checkpoint_partition_key(partition_key)
        return checkpoint_path(self.run_dir(run_name), step)

    def evals_dir(self) -> Path:
        return self.path / "evals"

    def reports_dir(self) -> Path:
        return self.path / "reports"


TARGET_VARIABLE = "POSTTRAIN_TARGET"


class WorkloadLauncher(dg.ConfigurableResource):
    """Runs a workload module as a local subprocess or a Kubernetes pod, through Dagster Pipes.

    ``target="local"`` (the embedded default) runs ``python -m MODULE ARGS`` on this machine.
    ``target="k8s"`` runs the same command in a pod of ``image`` in ``namespace``; the wait for the
    pod has no deadline, since training runs last hours or days.

    A run (:meth:`run_trainer`) on ``k8s`` is the plan's workloads, not one pod: every manifest of
    ``posttrain run --target k8s`` (:func:`training.planner.k8s.build_manifests`) is applied
    server-side, the engines, router and sandbox pool are waited for (``fleet_ready_timeout_s``),
    then the trainer Job runs with the Pipes context in its environment and its pod's log read for
    Pipes messages. When it ends (success, failure, a cancelled Dagster run) the workloads are
    deleted, unless the run file's ``[kubernetes] keep_fleet`` is true (then only the Job goes);
    the run volume and the plan ConfigMap stay.
    """

    target: Literal["local", "k8s"] = "local"
    namespace: str = "posttrain"
    image: str = "posttrain:latest"
    service_account: str | None = None
    load_incluster_config: bool | None = None
    kubeconfig_file: str | None = None
    # SGLang engines load a model for up to an hour (the startup probe's allowance)
    fleet_ready_timeout_s: float = 3600.0
    poll_interval_s: float = 5.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "WorkloadLauncher":
        """The launcher a code location starts with: ``POSTTRAIN_TARGET`` (``local``, the default, or
        ``k8s``), and on ``k8s`` the cluster of ``KUBECONFIG`` (else the in-cluster configuration,
        where Dagster itself runs in a pod). The same variables as ``kubectl``'s and ``posttrain
        run --target``'s, read once here."""
        env = os.environ if environ is None else environ
        target = env.get(TARGET_VARIABLE, "local") or "local"
        if target not in ("local", "k8s"):
            raise ValueError(f"{TARGET_VARIABLE}={target!r}: expected 'local' or 'k8s'")
        if target == "local":
            return cls()
        kubeconfig = env.get("KUBECONFIG") or None
        return cls(target="k8s", kubeconfig_file=kubeconfig, load_incluster_config=kubeconfig is None)

    def run_trainer(self, context: dg.AssetExecutionContext, plan: Any, plan_path: Path, run_dir: Path, *,
                    on_message: Callable[[Any], None] | None = None) -> dg.PipesClientCompletedInvocation:
        """The trainer of ``plan`` to its end: ``python -m training`` here (its engines, router and
        sandboxes as local processes), or on ``k8s`` the plan's workloads and the trainer Job."""
        if self.target == "local":
            return self.run(context, TRAINER_MODULE, trainer_args(plan_path, run_dir), extras={"run_dir": str(run_dir)},
                            on_message=on_message)
        return self._run_plan_on_k8s(context, plan, on_message)

    def _run_plan_on_k8s(self, context: dg.AssetExecutionContext, plan: Any,
                         on_message: Callable[[Any], None] | None) -> dg.PipesClientCompletedInvocation:
        # heavy: dagster_k8s and kubernetes (over 1,000 modules); only a run on Kubernetes needs them
        from dagster_k8s import PipesK8sPodLogsMessageReader
        from kubernetes import client as k8s_client


        api = self._api_client()
        manifests = k8s.build_manifests(plan)
        job = manifests[-1]
        if job["kind"] != "Job":
            raise RuntimeError(f"the plan's last manifest is {job['kind']}, not the trainer Job (training/planner/k8s.py)")
        fleet, name, ns = manifests[:-1], job["metadata"]["name"], job["metadata"]["namespace"]
        keep_fleet = bool(plan.run_file.kubernetes.keep_fleet)
        reader = PipesK8sPodLogsMessageReader()
        try:
            for applied in runner.apply_k8s(fleet, api_client=api):
                context.log.info(f"k8s: {applied}")
            self._wait_fleet(context, fleet, api)
            with dg.open_pipes_session(context, context_injector=dg.PipesEnvContextInjector(),
                                       message_reader=tap_custom_messages(reader, on_message),
                                       extras={"run_dir": k8s.run_dir_in_pod(plan)}) as session:
                container = job["spec"]["template"]["spec"]["containers"][0]
                container["env"] = [*container.get("env", []),
                                    *({"name": k, "value": v} for k, v in session.get_bootstrap_env_vars().items())]
                # the plan ConfigMap owns the Job too: apply it with the rest's owner
                for applied in runner.apply_k8s([next(m for m in fleet if runner.is_plan(m)), job], api_client=api):
                    context.log.info(f"k8s: {applied}")
                core = k8s_client.CoreV1Api(api)
                followed: set[str] = set()
                while True:
                    outcome = runner.job_outcome(runner.read_object(api, job))
                    for pod in core.list_namespaced_pod(ns, label_selector=f"job-name={name}").items:
                        phase = pod.status.phase if pod.status else None
                        if pod.metadata.name not in followed and phase in ("Running", "Succeeded", "Failed"):
                            followed.add(pod.metadata.name)  # blocks until the pod's log ends
                            context.log.info(f"k8s: reading Pipes messages from pod {pod.metadata.name}")
                            reader.consume_pod_logs(context=context, core_api=core, pod_name=pod.metadata.name,
                                                    namespace=ns)
                    if outcome is not None:
                        break
                    time.sleep(self.poll_interval_s)
                if outcome != "succeeded":
                    raise RuntimeError(f"trainer Job {ns}/{name} failed (kubectl -n {ns} describe job {name}; "
                                       f"checkpoints and the rollout store stay on the run volume)")
                return dg.PipesClientCompletedInvocation(session)
        finally:
            # success, failure or a cancelled run alike; the run volume and the plan stay
            keep = runner.UNOWNED_KINDS + (tuple({m["kind"] for m in fleet}) if keep_fleet else ())
            deleted = runner.delete_k8s(manifests, api_client=api, keep_kinds=keep)
            context.log.info(f"k8s: deleted {', '.join(deleted) or 'nothing'}"
                             + ("; the fleet stays ([kubernetes] keep_fleet)" if keep_fleet else ""))

    def _wait_fleet(self, context: dg.AssetExecutionContext, fleet: list[dict[str, Any]], api: Any) -> None:
        runner.wait_fleet(fleet, api, timeout_s=self.fleet_ready_timeout_s, poll_s=self.poll_interval_s,
                          log=lambda line: context.log.info(f"k8s: {line}"), setting="launcher fleet_ready_timeout_s")

    def _api_client(self) -> Any:
        # heavy: kubernetes (over 1,000 modules); only a run on Kubernetes needs it
        from kubernetes import client, config

        configuration = client.Configuration()
        if self.load_incluster_config:
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=self.kubeconfig_file, client_configuration=configuration)
        return client.ApiClient(configuration)

    def command(self, module: str, args: Sequence[str]) -> list[str]:
        python = sys.executable if self.target == "local" else "python"
        return [python, "-m", module, *args]

    def run(
        self,
        context: dg.AssetExecutionContext,
        module: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        extras: Mapping[str, Any] | None = None,
        pod_spec: Mapping[str, Any] | None = None,
        pod_meta: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        on_message: Callable[[Any], None] | None = None,
    ) -> dg.PipesClientCompletedInvocation:
        """Run the workload to its end. ``on_message`` is called with each custom Pipes message
        (``report_custom_message``) as it arrives, on the message reader's thread, while the
        workload runs (the completed invocation also lists them all at the end). On ``k8s``,
        ``pod_spec`` and ``pod_meta`` are the pod's (its first container's image, when set, is used
        instead of ``image``), in ``namespace`` (default: the launcher's)."""
        command = self.command(module, args)
        context.log.info(f"launching {' '.join(command)} on {self.target}")
        if self.target == "local":
            reader = dg.PipesTempFileMessageReader()
            # the workload shares this process's trainer credential, given explicitly (never exported)
            return dg.PipesSubprocessClient(env=process_credential().environment(), message_reader=tap_custom_messages(reader, on_message)).run(
                context=context, command=command, env=dict(env or {}), extras=dict(extras or {})
            )
        # heavy: dagster_k8s and kubernetes (over 1,000 modules); only a run on Kubernetes needs them
        from dagster_k8s import PipesK8sClient, PipesK8sPodLogsMessageReader

        client = PipesK8sClient(
            load_incluster_config=self.load_incluster_config,
            kubeconfig_file=self.kubeconfig_file,
            poll_interval=5.0,
            message_reader=tap_custom_messages(PipesK8sPodLogsMessageReader(), on_message),
        )
        base_pod_spec: dict[str, Any] = dict(pod_spec or {})
        if self.service_account:
            base_pod_spec.setdefault("serviceAccountName", self.service_account)
        containers = base_pod_spec.get("containers") or [{}]
        return client.run(
            context=context,
            image=None if containers[0].get("image") else self.image,
            command=command,
            namespace=namespace or self.namespace,
            base_pod_meta=dict(pod_meta or {}) or None,
            env=dict(env or {}),
            extras=dict(extras or {}),
            base_pod_spec=base_pod_spec or None,
            # Training runs outlast any fixed deadline: wait for the pod for as long as it runs.
            pod_wait_timeout=0,
        )


def tap_custom_messages(reader: dg.PipesMessageReader, on_message: Callable[[Any], None] | None) -> dg.PipesMessageReader:
    """``reader``, which also hands each custom message's payload to ``on_message`` as it is read.

    Dagster queues custom messages until the workload ends; a trainer's per-step message is wanted
    while it runs. The message handler of the session is wrapped, so every other message (logs,
    materializations, the closing message) is handled exactly as before, and first."""
    if on_message is None:
        return reader
    read_messages = reader.read_messages

    @contextmanager
    def tapped_read_messages(handler: Any):
        handle = handler.handle_message

        def handle_message(message: Any) -> None:
            handle(message)
            if message.get("method") == "report_custom_message":
                on_message((message.get("params") or {}).get("payload"))

        handler.handle_message = handle_message
        with read_messages(handler) as params:
            yield params

    reader.read_messages = tapped_read_messages  # type: ignore[method-assign]
    return reader
