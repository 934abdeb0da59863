"""shmbroker behind Ray Serve (``pip install 'shmbroker[ray]'``): one replica on each node, each a client of its
node's broker, so a cluster serves what one machine's broker cannot, with Ray's HTTP proxy, routing and replica
health on top.

``node_broker`` is the deployment (``NodeBroker`` replicas, one a node: shmbroker.ray.deployment), ``build_app``
its application builder (``serve run shmbroker.ray:build_app nodes=N``), ``BrokerHandle`` the caller's side of a
handle (numpy in, numpy out, the client's typed errors). Over HTTP a replica speaks KServe v2 as ``shmbroker
http`` does (shmbroker.ray.http). Nothing else in shmbroker imports this package, so only this extra needs Ray.
"""

try:
    import ray.serve  # noqa: F401 -- the extra's one dependency, named when missing
except ImportError as exc:
    raise ImportError(f"shmbroker.ray needs Ray Serve, which is not installed ({exc}): pip install "
                      "'shmbroker[ray]'") from exc

from shmbroker.ray.deployment import NAME, NODE_RESOURCE, build_app, node_broker
from shmbroker.ray.handle import BrokerHandle
from shmbroker.ray.http import NODE_HEADER
from shmbroker.ray.node import BrokerNotReady, Call, NodeBroker

__all__ = ["NAME", "NODE_HEADER", "NODE_RESOURCE", "BrokerHandle", "BrokerNotReady", "Call", "NodeBroker", "build_app",
           "node_broker"]
