"""Ray Serve's environment flags for each front, for every process of a cluster: Ray reads them
when it is first imported in a process, so they are set before Ray is (cli/serve_ray.py sets them
on the local cluster it starts). Imports nothing of Ray."""

HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
"""Ray Serve's HAProxy mode: HAProxy (Ray's bundled binary) listens on Serve's HTTP port and sends
each request straight to a replica of the application's HTTP-facing deployment (front=ingress: an
`Ingress` replica, which serves HTTP itself: Serve's "direct ingress"). Without it, Serve's Python
proxy takes the request and calls the ingress through Ray, and the ingress fetches the body by a
call back to the proxy (benchmarks/bench_ray_ingress.py measures both; docs/benchmarks.md)."""

DIRECT_ENV = {**HAPROXY_ENV, "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}
"""The direct front (direct.py): HAProxy mode, and HAProxy forwarding each POST's body to the
router (off by default in Ray: a router that routes on headers alone does not need it; the prefix
key does)."""
