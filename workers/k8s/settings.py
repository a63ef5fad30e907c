"""What ``conveyor k8s`` is told, as plain data: the Redis KEDA must read, per-stage scaling, the rest.

Kept apart from the manifests so that the choices (which KEDA figure, how long a stop may take, how
many replicas) are made and checked in one place, with their reasons, and the manifests are a pure
function of them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

from broker.connection import CLUSTER_SCHEMES, RedisURLError, check_redis_url
from broker.numbers import MAX_TIMEOUT_S, count_problem, number_problem, written_problem
from workers.pipeline import Pipeline, StageSpec

__all__ = ["DEFAULT_SECRET", "INT32_MAX", "INT64_MAX", "KEDA_FIELDS", "METRICS", "K8sError", "K8sSettings",
           "Overrides", "RedisTarget", "StageScaling", "batch_bound_s", "default_target", "grace_seconds", "k8s_int",
           "parse_overrides", "stage_scaling"]

# The KEDA redis-streams figures conveyor can be scaled on (pkg/scalers/redis_streams_scaler.go):
# "length" = XLEN of the stage stream (no consumerGroup in the trigger), which conveyor keeps equal to
# its backlog + pending at every commit (workers delete what they ack); "lag" = the group's XINFO GROUPS
# lag (Redis >= 7), which Redis cannot tell once an entry past the group's last read was deleted and
# KEDA then reads as -1 (docs/deployment.md); "pending" = XPENDING's count, the entries workers hold.
METRICS = ("length", "lag", "pending")
KEDA_FIELDS = {"length": "streamLength", "lag": "lagCount", "pending": "pendingEntriesCount"}
DEFAULT_SECRET = "conveyor-redis"
DEFAULT_TIMEOUT_S = 30.0  # the gateway's default request deadline (conveyor gateway --timeout-s)
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$")  # a memory quantity, as the API server takes it
TARGET_BATCHES = 4  # default target: this many batches of entries per worker (see default_target)
# What the API server takes for the integers conveyor writes (it refuses the object at apply past them): replicas,
# minReplicaCount, maxReplicaCount, pollingInterval and cooldownPeriod are int32 fields; terminationGracePeriodSeconds
# is an int64, and so are KEDA's figures (lagCount, activationLagCount: strconv.ParseInt(s, 10, 64)).
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


class K8sError(ValueError):
    """A setting the manifests cannot be made from: said in one line, with what to do."""


# What a rediss:// URL's options (redis-py's, read by every pod) ask that KEDA must be told as well: its Redis scalers
# verify the server's certificate against the system's CAs unless the trigger says ``unsafeSsl``, and take a private
# CA, or a client certificate and key, only as TriggerAuthentication parameters (PEM text from a Secret), not paths.
TLS_AUTH_PARAMS = {"ssl_ca_certs": ("ca",), "ssl_ca_path": ("ca",), "ssl_ca_data": ("ca",),
                   "ssl_certfile": ("cert", "key"), "ssl_keyfile": ("cert", "key"), "ssl_password": ("keyPassword",)}
_FALSE = ("0", "F", "FALSE", "N", "NO")  # what redis-py's URL parser reads as false (redis.connection.to_bool)


@dataclass(frozen=True)
class RedisTarget:
    """Where KEDA reaches Redis, read from the URL the pods use; its password is never kept.

    ``version`` decides whether ``lagCount`` can be read at all (Redis >= 7); ``cluster`` picks the
    ``redis-cluster-streams`` scaler, whose client follows the slots as conveyor's does. With TLS, what the
    URL's options ask of the pods' client, for KEDA's: ``verify`` False for ``ssl_cert_reqs=none``
    (``unsafeSsl``), ``tls_params`` the TriggerAuthentication parameters that carry the URL's CA and client
    certificate files (``ca``, ``cert``, ``key``, ``keyPassword``), ``check_hostname`` False for
    ``ssl_check_hostname=false``, which KEDA cannot do (it checks the name whenever it verifies)."""

    cluster: bool
    addresses: tuple[str, ...]
    tls: bool = False
    database: int = 0
    username: str | None = None
    version: tuple[int, int, int] | None = None
    verify: bool = True
    tls_params: tuple[str, ...] = ()
    check_hostname: bool = True

    @classmethod
    def from_url(cls, url: str, version: tuple[int, int, int] | None = None) -> RedisTarget:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme in ("unix", "redis+unix"):
            raise K8sError(f"--redis {scheme}://...: a Unix socket cannot be reached from pods or from KEDA; give the "
                           "URL of the Redis Service (redis://HOST:6379/0)")
        plain = CLUSTER_SCHEMES.get(scheme, scheme)
        if plain not in ("redis", "rediss"):
            raise K8sError(f"--redis must be redis://, rediss://, redis+cluster:// or rediss+cluster://, "
                           f"got {scheme!r}")
        try:  # what the pods' clients would refuse (a port that is no number), said before they crash-loop
            check_redis_url(url)
        except RedisURLError as exc:
            raise K8sError(f"--redis: {exc}") from None
        userinfo, _, hosts = parts.netloc.rpartition("@")
        addresses = tuple(_address(h.strip()) for h in hosts.split(",") if h.strip())
        if not addresses:
            raise K8sError(f"--redis {plain}://: no host in the URL")
        cluster = scheme in CLUSTER_SCHEMES
        if not cluster and len(addresses) > 1:
            raise K8sError("several hosts are a Redis Cluster's seeds: write the URL redis+cluster://h1:p1,h2:p2")
        user = unquote(userinfo.partition(":")[0]) if userinfo else ""
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise K8sError(f"--redis: the database must be a number, got {path!r}")
        if cluster and path not in ("", "0"):
            raise K8sError("a Redis Cluster has one database: no /N path in a redis+cluster:// URL")
        options: dict[str, str] = {}
        for name, value in parse_qsl(parts.query):  # redis-py takes the first of a repeated option
            options.setdefault(name, value)
        database = int(options.get("db") or path or 0)  # redis-py: ?db=N wins over the path
        if plain != "rediss":
            return cls(cluster, addresses, False, database, user or None, version)
        verify = options.get("ssl_cert_reqs") != "none"
        params = [p for option, names in TLS_AUTH_PARAMS.items() if options.get(option) for p in names
                  if verify or p != "ca"]
        check_hostname = options.get("ssl_check_hostname", "true").upper() not in _FALSE
        return cls(cluster, addresses, True, database, user or None, version, verify, tuple(dict.fromkeys(params)),
                   check_hostname)

    @property
    def has_lag(self) -> bool | None:
        """Whether ``XINFO GROUPS`` has ``lag`` (Redis >= 7); None when the version is unknown."""
        return None if self.version is None else self.version >= (7, 0, 0)


def _address(host: str) -> str:
    """``host:port``, the default port added; an IPv6 literal keeps its brackets (what go-redis takes)."""
    if host.startswith("["):
        close = host.find("]")
        return host if host[close + 1:].startswith(":") else host + ":6379"
    return host if ":" in host else host + ":6379"


@dataclass(frozen=True)
class StageScaling:
    """One stage's replicas (one worker each) and the KEDA figures it scales on."""

    min_replicas: int
    max_replicas: int
    target: int
    activation: int


# Per-stage overrides from the command line: None for "every stage", else a stage's name.
Overrides = Mapping[str | None, int]


@dataclass(frozen=True)
class K8sSettings:
    """Everything but the pipeline that the manifests depend on."""

    app: str
    image: str
    namespace: str | None = None
    secret: str = DEFAULT_SECRET
    prefix: str | None = None  # --prefix given to `conveyor k8s`, passed on to every command
    keda: bool = True
    metric: str = "length"
    redis: RedisTarget | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    drain_s: float = 30.0  # the gateway's drain on SIGTERM (conveyor gateway --drain-timeout-s)
    gateway_replicas: int = 1
    port: int = 8000
    memory: str | None = None  # a worker pod's memory request and limit, e.g. "2Gi"
    polling_s: int = 15
    cooldown_s: int = 300
    min_replicas: Overrides = field(default_factory=dict)
    max_replicas: Overrides = field(default_factory=dict)
    target: Overrides = field(default_factory=dict)
    activation: Overrides = field(default_factory=dict)

    def check(self, pipeline: Pipeline) -> None:
        """What cannot work, refused before anything is printed."""
        if self.memory is not None and not QUANTITY.fullmatch(self.memory):
            raise K8sError(f"--memory must be a Kubernetes quantity (512Mi, 2Gi, 1G), got {self.memory!r}")
        if self.metric not in METRICS:
            raise K8sError(f"--metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        self._check_numbers()
        names = {s.name for s in pipeline.stages}
        for option, values in (("--min", self.min_replicas), ("--max", self.max_replicas),
                               ("--target", self.target), ("--activation", self.activation)):
            unknown = sorted(str(k) for k in values if k is not None and k not in names)
            if unknown:
                raise K8sError(f"{option}: pipeline {pipeline.name} has no stage {', '.join(unknown)} "
                               f"(stages: {', '.join(s.name for s in pipeline.stages)})")
        if not self.keda:
            return
        if self.redis is None:
            raise K8sError("KEDA reads the stage streams itself: give --redis URL (the URL the pods use; its password "
                           "is not printed) or --no-keda")
        if self.metric == "lag" and self.redis.has_lag is False:
            have = ".".join(map(str, self.redis.version or ()))
            raise K8sError(f"--metric lag needs Redis >= 7 (XINFO GROUPS lag); this Redis is {have}: use --metric "
                           "length (any version) or pending")


    def _check_numbers(self) -> None:
        """The numbers written into the manifests, within what the gateway and Kubernetes take (the command line
        refuses them at start; a library caller's K8sSettings are checked here)."""
        problems = {"--drain-timeout-s": number_problem(self.drain_s, 0, MAX_TIMEOUT_S)}  # the gateway's own limit
        for option, value, low, high in (("--gateway-replicas", self.gateway_replicas, 1, INT32_MAX),
                                         ("--port", self.port, 1, 65535), ("--polling-interval", self.polling_s, 1,
                                                                           INT32_MAX),
                                         ("--cooldown-period", self.cooldown_s, 0, INT32_MAX)):
            problems[option] = count_problem(value, low, high)
        for option, problem in problems.items():
            if problem is not None:
                raise K8sError(f"{option} {problem}")


def parse_overrides(values: Iterable[str], option: str, minimum: int,
                    maximum: int = INT32_MAX) -> dict[str | None, int]:
    """``N`` (every stage) or ``STAGE=N`` (one stage), repeatable; the last one given wins. At most ``maximum``:
    what Kubernetes or KEDA takes in the field the number is written to."""
    out: dict[str | None, int] = {}
    for value in values:
        name, sep, number = value.rpartition("=")
        problem = written_problem(number)
        if problem is not None:
            raise K8sError(f"{option}: {problem}")
        try:
            n = int(number)
        except ValueError:
            raise K8sError(f"{option} takes N or STAGE=N, got {value!r}") from None
        if not minimum <= n <= maximum:
            raise K8sError(f"{option} must be from {minimum} to {maximum} (what Kubernetes takes), got {value!r}")
        out[name if sep else None] = n
    return out


def _pick(values: Overrides, stage: str, default: int) -> int:
    return values.get(stage, values.get(None, default))


def batch_bound_s(spec: StageSpec, timeout_s: float) -> float:
    """The longest one batch of ``spec`` can hold a worker: ``max_run_s`` where set; else until conveyor
    itself gives up on it, ``stuck_grace_s`` after its items' deadlines (``timeout_s`` from their arrival,
    the gateway's default deadline). A worker waits this long for its batch on SIGTERM (``--grace-s``)."""
    if spec.max_run_s is not None:
        return float(spec.max_run_s)
    return timeout_s + (spec.stuck_grace_s or 0.0)


def default_target(spec: StageSpec) -> int:
    """Entries per worker before KEDA adds one: ``TARGET_BATCHES`` batches (at least 5, KEDA's default).

    A worker that keeps up holds up to two batches (one in ``predict``, one read ahead), so its share
    of the stream length is about ``2 x batch_size`` at full use; ``4 x batch_size`` adds a worker once
    about two more batches wait per worker, i.e. once an entry waits about two batch durations."""
    return max(5, TARGET_BATCHES * spec.batch_size)


def stage_scaling(spec: StageSpec, settings: K8sSettings) -> StageScaling:
    """Replicas (one worker each), unless told otherwise: the stage's own ``workers`` range ``(min, max)``,
    or from its ``workers`` (the floor) to four times it; the target and activation for KEDA."""
    low = _pick(settings.min_replicas, spec.name, spec.workers)
    high = _pick(settings.max_replicas, spec.name, max(low, spec.max_workers or 4 * spec.workers, 1))
    if high < max(low, 1):
        raise K8sError(f"stage {spec.name}: --max {high} is below --min {low} (and KEDA needs max >= 1)")
    target = _pick(settings.target, spec.name, default_target(spec))
    activation = _pick(settings.activation, spec.name, 0)
    for field_name, value, most in (("minReplicaCount", low, INT32_MAX), ("maxReplicaCount", high, INT32_MAX),
                                    ("target", target, INT64_MAX), ("activation", activation, INT64_MAX)):
        k8s_int(value, f"stage {spec.name}: {field_name}", most)  # a Pipeline's workers are not bounded
    if low == 0 and settings.metric == "pending":
        raise K8sError(f"stage {spec.name}: --min 0 with --metric pending would never scale up again (no worker, "
                       "nothing pending); use --metric length, or --min 1")
    return StageScaling(low, high, target, activation)


def k8s_int(value: int, what: str, most: int) -> int:
    """``value``, refused (K8sError naming ``what``) past ``most``: what the API server takes in that field."""
    if value > most:
        shown = str(value) if value < 10**20 else f"{float(value):.3g}"  # a 1e300 grace period: not 301 digits
        raise K8sError(f"{what} {shown} is more than Kubernetes takes (at most {most})")
    return value


def grace_seconds(bound_s: float, margin_s: int, what: str = "terminationGracePeriodSeconds") -> int:
    """``terminationGracePeriodSeconds``: the batch bound, rounded up, plus a margin; within an int64, which
    Kubernetes refuses past (a stage's max_run_s of 1e300 is finite, and was taken)."""
    return k8s_int(math.ceil(bound_s) + margin_s, what, INT64_MAX)
