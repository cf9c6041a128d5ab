"""The Ray Serve application: engine replicas behind one OpenAI-compatible ingress.

`ruvllm serve PKG --ray [ADDRESS] --replicas N` builds it with `build_app` and runs it; `serve run
runtime.serve.scaleout.app:app_builder package=PKG replicas=N` (or a Serve config file naming
`app_builder`) does the same from Ray's own CLI. The ingress is the same FastAPI app as the
single-process server, over a `RemoteEngine` instead of an AsyncEngine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ray import serve

from runtime.serve.api_keys import ApiKeys
from runtime.serve.scaleout.client import RemoteEngine
from runtime.serve.scaleout.replica import EngineReplica

ROUTINGS = ("prefix", "pow2")


@dataclass
class ScaleOptions:
    """How many engine replicas, how requests reach them, and how Ray Serve keeps them healthy."""

    replicas: int = 1
    min_replicas: int | None = None  # min/max: autoscale between them (Ray Serve's autoscaler)
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # per replica, what the autoscaler aims at
    routing: str = "prefix"  # "prefix": RuvLLM's prefix-aware router; "pow2": Ray Serve's default
    imbalance: int = 8  # queue length a prefix holder may exceed the shortest by and still win
    replica_cpus: float = 1.0
    max_ongoing_requests: int = 64  # per replica; more wait in the router
    ingress_max_ongoing_requests: int = 4096
    health_check_period_s: float = 5.0
    routing_stats_period_s: float = 2.0

    def deployment_options(self) -> dict:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {self.routing!r}")
        opts: dict = {"max_ongoing_requests": self.max_ongoing_requests,
                      "health_check_period_s": self.health_check_period_s,
                      "ray_actor_options": {"num_cpus": self.replica_cpus}}
        if self.min_replicas is not None or self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else 1
            auto = {"min_replicas": low, "max_replicas": max(self.max_replicas or low, low),
                    "initial_replicas": max(low, min(self.replicas, self.max_replicas or self.replicas))}
            if self.target_ongoing_requests is not None:
                auto["target_ongoing_requests"] = self.target_ongoing_requests
            opts["autoscaling_config"] = auto
        else:
            opts["num_replicas"] = self.replicas
        if self.routing == "prefix":
            from ray.serve.config import RequestRouterConfig

            opts["request_router_config"] = RequestRouterConfig(
                request_router_class="runtime.serve.scaleout.router:PrefixAwareRouter",
                request_router_kwargs={"imbalance": self.imbalance},
                request_routing_stats_period_s=self.routing_stats_period_s)
        return opts


@dataclass
class ServeOptions:
    """The single-process server's settings, for the ingress."""

    keys: ApiKeys | None = None  # named API keys (None: none asked for)
    max_queue: int | None = None
    max_request_bytes: int | None = None  # None: from the package's context
    lora_roots: list[str] | None = None  # runtime adapter loading from these folders (None: off)
    defaults: dict | None = None  # sampling defaults for requests that leave a field out
    shutdown_timeout: float = 30.0
    engine_options: dict = field(default_factory=dict)


class Ingress:
    """The OpenAI-compatible HTTP front: tokenizes, routes to replicas, streams back."""

    def __init__(self, engine, package: str, adapters: dict[str, str], options: ServeOptions) -> None:
        from runtime.serve.server import ServedModel, create_app

        client = RemoteEngine(engine, package, options.engine_options)
        for name, path in adapters.items():
            client.add_adapter(name, path)
        name = client.model_name
        self.client = client
        self._app = create_app({name: ServedModel(name, client, int(time.time()))}, keys=options.keys,
                               max_queue=options.max_queue, shutdown_timeout=options.shutdown_timeout,
                               defaults=options.defaults, max_request_bytes=options.max_request_bytes,
                               lora_roots=options.lora_roots)

    def __serve_build_asgi_app__(self):
        return self._app


def build_app(package: str, *, device: str = "cpu", threads: int | None = None, adapters: dict[str, str] | None = None,
              scale: ScaleOptions | None = None, options: ServeOptions | None = None):
    """The application: a `RuvLLMEngine` deployment of engine replicas and a `RuvLLMIngress` in front."""
    scale, options, adapters = scale or ScaleOptions(), options or ServeOptions(), dict(adapters or {})
    engine_options = {k: v for k, v in options.engine_options.items()}
    engine_options.setdefault("max_num_seqs", scale.max_ongoing_requests)
    replicas = serve.deployment(EngineReplica, name="RuvLLMEngine", **scale.deployment_options())
    # the ingress only relays: Ray Serve's default of 5 requests in flight per replica would throttle every engine
    ingress = serve.deployment(serve.ingress()(Ingress), name="RuvLLMIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=scale.ingress_max_ongoing_requests)
    return ingress.bind(replicas.bind(package, device, threads, engine_options, adapters), package, adapters, options)


def app_builder(args: dict):
    """For `serve run runtime.serve.scaleout.app:app_builder package=PKG replicas=2 routing=prefix ...`."""
    args = dict(args)
    if "package" not in args:
        raise ValueError("the application needs package=PATH (a model package folder on every node)")
    package = str(args.pop("package"))
    adapters = {}
    for item in str(args.pop("lora_modules", "") or "").split(","):
        if item:
            name, _, path = item.partition("=")
            adapters[name] = path
    num = {"replicas": int, "min_replicas": int, "max_replicas": int, "target_ongoing_requests": float,
           "imbalance": int, "replica_cpus": float, "max_ongoing_requests": int}
    scale = ScaleOptions(**{k: num[k](args.pop(k)) for k in list(args) if k in num},
                         routing=str(args.pop("routing", "prefix")))
    threads = int(args.pop("threads")) if "threads" in args else None
    device = str(args.pop("device", "cpu"))
    if args:
        raise ValueError(f"unknown application arguments: {', '.join(sorted(args))}")
    return build_app(package, device=device, threads=threads, adapters=adapters, scale=scale)


def serve_on_ray(package: str, address: str | None, host: str, port: int, *, device: str = "cpu",
                 threads: int | None = None, adapters: dict[str, str] | None = None, scale: ScaleOptions | None = None,
                 options: ServeOptions | None = None, blocking: bool = True) -> None:
    """Connect to a Ray cluster (address: "auto", "ray://host:10001", ...; "local" or None starts a new one
    on this machine), deploy, and serve HTTP on host:port until interrupted."""
    import ray

    local = address in (None, "local")
    ray.init(address="local" if local else address, include_dashboard=False, log_to_driver=True)
    serve.start(http_options={"host": host, "port": port})
    app = build_app(package, device=device, threads=threads, adapters=adapters, scale=scale, options=options)
    serve.run(app, name="ruvllm", route_prefix="/")
    if not blocking:
        return
    import signal

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # as the single-process server: SIGTERM stops it like Ctrl-C
    signal.signal(signal.SIGINT, stop)  # also when started in the background, with SIGINT ignored
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
