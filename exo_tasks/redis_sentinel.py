"""Redis behind Sentinels: where the master is, asked of the Sentinels, in the three forms its
users take it.

- Our own clients (the store, stream readers, recovery, feeder, runners) get one URL,
  `redis+sentinel://[:SENTINEL_PASSWORD@]h1:p1,h2:p2/MASTER_NAME/DB?password=PASSWORD` (the form
  of the `redis-sentinel-url` package), so it crosses to a runner as the plain URL does, and
  `exo_tasks.store.client.connect` builds a client on it that asks the Sentinels again on every
  new connection: after a failover the next command reaches the new master.
- Celery's broker (kombu's `sentinel://` transport) and result backend (Celery's `sentinel://`
  backend) take `sentinel://:PASSWORD@h1:p1/DB;sentinel://:PASSWORD@h2:p2/DB` and the master's
  name and the Sentinels' own credentials in their transport options. Both pass
  `sentinel_kwargs` as is to redis-py's Sentinel, so without socket timeouts there a Sentinel
  host that stops answering would hang every lookup (celery 5.7 defaults them to none).
- Flower reads the broker's URL and its transport options (flower.utils.broker.RedisSentinel).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
from pydantic import BaseModel, SecretStr
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from exo_tasks.sentinel_addresses import parse_addresses

SCHEME = "redis+sentinel"
# A Sentinel that does not answer within this is skipped for the next one.
SENTINEL_TIMEOUT_S = 1.0


class Sentinels(BaseModel, frozen=True):
    """The Sentinels that know the master `master_name`, and the passwords of each."""

    addresses: list[tuple[str, int]]
    master_name: str
    password: SecretStr | None = None  # the master's (and its replicas')
    sentinel_password: SecretStr | None = None
    db: int = 0

    # --- our clients ---

    def url(self) -> str:
        auth = f":{_quoted(self.sentinel_password)}@" if self.sentinel_password else ""
        hosts = ",".join(f"{host}:{port}" for host, port in self.addresses)
        query = f"?password={_quoted(self.password)}" if self.password else ""
        return f"{SCHEME}://{auth}{hosts}/{quote(self.master_name, safe='')}/{self.db}{query}"

    @classmethod
    def from_url(cls, url: str) -> Sentinels:
        parts = urlsplit(url)
        if parts.scheme != SCHEME:
            raise ValueError(f"not a {SCHEME}:// URL")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        master_name, _, db = parts.path.strip("/").partition("/")
        password = parse_qs(parts.query).get("password", [None])[0]
        sentinel_password = unquote(userinfo.partition(":")[2]) if userinfo else None
        return cls(
            addresses=parse_addresses(hosts),
            master_name=unquote(master_name),
            password=SecretStr(password) if password else None,
            sentinel_password=SecretStr(sentinel_password) if sentinel_password else None,
            db=int(db or 0),
        )

    def describe(self) -> str:
        """Where, without a password: for errors and logs."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.addresses)
        return f"the master {self.master_name!r} of the Sentinels {hosts}"

    def sentinel_kwargs(self) -> dict[str, Any]:
        return {
            "password": _secret(self.sentinel_password),
            "socket_timeout": SENTINEL_TIMEOUT_S,
            "socket_connect_timeout": SENTINEL_TIMEOUT_S,
            # One try, then the next Sentinel: redis-py's default retries a Sentinel that is
            # gone 10 times with backoff (measured: 4.2 s per lookup with the first one dead).
            "retry": Retry(NoBackoff(), 0),
        }

    def master(self, options: dict[str, Any], max_connections: int | None) -> redis.Redis:
        """A client of the current master, with `options` for its connections; a blocking
        pool of `max_connections` if given (a command waits for a free connection)."""
        sentinel = Sentinel(self.addresses, sentinel_kwargs=self.sentinel_kwargs())  # type: ignore[no-untyped-call]
        pool_options: dict[str, Any] = {"password": _secret(self.password), "db": self.db}
        if max_connections is not None:
            pool_options.update(
                connection_pool_class=BlockingSentinelPool,
                max_connections=max_connections,
                timeout=options["socket_timeout"],
            )
        client: redis.Redis = sentinel.master_for(self.master_name, **options, **pool_options)  # type: ignore[no-untyped-call]
        return client

    # --- Celery, kombu and Flower ---

    def kombu_url(self) -> str:
        auth = f":{_quoted(self.password)}@" if self.password else ""
        return ";".join(f"sentinel://{auth}{h}:{p}/{self.db}" for h, p in self.addresses)

    def transport_options(self) -> dict[str, Any]:
        return {"master_name": self.master_name, "sentinel_kwargs": self.sentinel_kwargs()}


class BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's Sentinel pool, which opens a connection per caller without bound, made to
    wait for a free one as the API's plain pool does (thousands of greenlets share it)."""


def _secret(value: SecretStr | None) -> str | None:
    return None if value is None else value.get_secret_value()


def _quoted(value: SecretStr) -> str:
    return quote(value.get_secret_value(), safe="")


def is_sentinel_url(url: str) -> bool:
    return url.startswith(f"{SCHEME}://")
