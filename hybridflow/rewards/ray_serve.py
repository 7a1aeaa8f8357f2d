"""A rule reward behind Ray Serve, for rewards that outgrow one machine.

Each replica serves ``rewards.server.make_app`` for the rule, so the contract is the one of
``hybridflow serve-reward`` (``POST /score``: the same request validation, body and nesting
limits, JSON-only replies, a 500 for a rule that raises or gives a score not finite in
float32), and a graph's remote reward source points its ``url`` at Serve's HTTP proxy
unchanged. Serve's proxy owns the connections (headers, timeouts, backlog) and spreads
requests over the replicas; each replica imports the rule itself from its ``module:function``
name, so the rule's module must be importable on every node. Two ways to start it::

    hybridflow serve-reward MODULE:FUNCTION --ray-serve --replicas 4 [--address ADDR] [--port P]
    serve run hybridflow.rewards.ray_serve:build_app rule=MODULE:FUNCTION replicas=4
"""

from __future__ import annotations

import signal
import time

from ray import serve

from hybridflow.rewards.rule import load_rule
from hybridflow.rewards.server import ServerLimits, make_app

APP_NAME = "hybridflow-reward"


@serve.deployment
@serve.ingress()
class RewardDeployment:
    """One replica: ``make_app`` for ``rule``, built once the replica has started."""

    def __init__(self, rule: str, max_request_bytes: int = ServerLimits.max_request_bytes) -> None:
        self.rule = rule
        self.limits = ServerLimits(max_request_bytes=max_request_bytes)

    def __serve_build_asgi_app__(self):
        return make_app(load_rule(self.rule), self.limits)


def reward_app(rule: str, replicas: int = 1, num_cpus: float = 1.0,
               max_request_bytes: int = ServerLimits.max_request_bytes) -> serve.Application:
    """The Serve application scoring with ``rule`` on ``replicas`` replicas of ``num_cpus``."""
    deployment = RewardDeployment.options(num_replicas=replicas, ray_actor_options={"num_cpus": num_cpus})
    return deployment.bind(rule, max_request_bytes)


def build_app(args: dict[str, str]) -> serve.Application:
    """Serve's application builder: ``serve run hybridflow.rewards.ray_serve:build_app
    rule=M:F [replicas=N] [num_cpus=C] [max_request_bytes=B]``."""
    unknown = set(args) - {"rule", "replicas", "num_cpus", "max_request_bytes"}
    if "rule" not in args or unknown:
        raise ValueError(f"build_app needs rule=MODULE:FUNCTION; unknown arguments {sorted(unknown)}")
    return reward_app(args["rule"], int(args.get("replicas", 1)), float(args.get("num_cpus", 1.0)),
                      int(args.get("max_request_bytes", ServerLimits.max_request_bytes)))


def serve_on_ray(rule: str, host: str, port: int, replicas: int, num_cpus: float, address: str | None,
                 max_request_bytes: int) -> None:
    """``hybridflow serve-reward RULE --ray-serve``: serve ``rule`` on Ray Serve (a local Ray, or
    the cluster at ``address``) until interrupted (Ctrl-C, or SIGTERM as ``kill`` and container
    runtimes send it), then delete the application from the cluster, or stop the local Ray."""
    import ray

    ray.init(address=address, include_dashboard=False)
    # After ray.init, which installs a SIGTERM handler that only dumps the stack and dies.
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the same clean exit as Ctrl-C
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(reward_app(rule, replicas, num_cpus, max_request_bytes), name=APP_NAME, route_prefix="/")
        print(f"serve-reward: {rule} on Ray Serve, {replicas} replica(s), http://{host}:{port}", flush=True)
        while True:
            time.sleep(3600)
    finally:
        if address is not None:  # on a local Ray, Serve and its replicas end with it
            serve.delete(APP_NAME)
        ray.shutdown()
