"""The Ray Serve deployment of ``NodeBroker``: one replica on each node that runs a broker, and the application
builder for ``serve run`` and Serve config files.

A replica asks for a sliver of the custom resource ``shmbroker`` (``NODE_RESOURCE``), which only the nodes that
run a broker declare (``ray start --resources='{"shmbroker": 1}'``), and ``max_replicas_per_node=1`` keeps two
replicas off one node: with ``num_replicas`` equal to the number of such nodes, each has one. The health check
runs every second (Ray Serve takes a replica out after three failures in a row), so a node whose broker died
stops getting requests within seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve

from shmbroker.ray.node import DEFAULT_SLOTS, STARTUP_WAIT_S, NodeBroker

NAME = "shmbroker"  # the deployment's name: serve.get_deployment_handle(NAME, app_name)
NODE_RESOURCE = "shmbroker"  # the custom resource of the nodes that run a broker
OPTIONS: dict[str, Any] = {
    "name": NAME,
    "max_replicas_per_node": 1,
    "max_ongoing_requests": DEFAULT_SLOTS,  # Ray calls at once; each may carry several requests (BrokerHandle)
    "health_check_period_s": 1.0,
    "health_check_timeout_s": 10.0,
    "graceful_shutdown_timeout_s": 10.0,
    "ray_actor_options": {"num_cpus": 1, "resources": {NODE_RESOURCE: 0.01}},
    "logging_config": {"enable_access_log": False},  # a log line per request would cost more than the request
}
node_broker = serve.deployment(**OPTIONS)(NodeBroker)
ARGS = {"nodes": int, "runtime_dir": str, "slots": int, "max_items": int, "startup_wait_s": float}


def build_app(args: Mapping[str, object]) -> Any:
    """``serve run shmbroker.ray:build_app nodes=N [runtime_dir=DIR] [slots=N] [max_items=N] [startup_wait_s=S]``
    (or a config file's ``import_path`` and ``args``): the application of ``nodes`` replicas, one a node.
    ValueError names an unknown or malformed argument."""
    unknown = sorted(set(args) - set(ARGS))
    if unknown:
        raise ValueError(f"shmbroker.ray:build_app: unknown argument(s) {unknown}; expected {sorted(ARGS)}")
    values: dict[str, Any] = {}
    for key, value in args.items():
        try:
            values[key] = ARGS[key](str(value))
        except ValueError:
            raise ValueError(f"shmbroker.ray:build_app: {key}={value!r}: expected {ARGS[key].__name__}") from None
    least = {"nodes": 1, "slots": 1, "max_items": 0}  # checked here, at deploy time: a replica that cannot
    for key, low in least.items():  # start would be retried by Serve forever
        if key in values and values[key] < low:
            raise ValueError(f"shmbroker.ray:build_app: {key}={values[key]}: expected at least {low}")
    if "startup_wait_s" in values and not values["startup_wait_s"] > 0:
        raise ValueError(f"shmbroker.ray:build_app: startup_wait_s={values['startup_wait_s']}: expected seconds, "
                         "more than 0")
    nodes = values.pop("nodes", 1)
    kwargs = {"slots": DEFAULT_SLOTS, "max_items": 0, "startup_wait_s": STARTUP_WAIT_S, **values}
    return node_broker.options(num_replicas=nodes).bind(**kwargs)
