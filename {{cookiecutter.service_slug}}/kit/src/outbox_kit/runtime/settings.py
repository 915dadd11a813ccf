"""Every runtime knob of a service, read from the environment (nested with ``__``, no prefix)
and ``.env``: the root, :class:`ServiceSettings`, and the sections the kit does not keep beside
the component they configure (the database's, the bus's and the relay's are in
``persistence.database``, ``transports.settings`` and ``processor.settings``).

A service derives its ``Settings`` from :class:`ServiceSettings`, names itself
(``service_slug``, ``service_name``, ``description``) and may add sections of its own. Reading
the settings imports no HTTP server.

Defaults (polling 2 s, processing delay 5 s, lease 300 s, five retries, backoff base 10 s, batch
100, retention 7 days). The embedded default is a SQLite file and the in-process transport, so a
fresh checkout runs with no server at all. ``MESSAGE_BUS__ENABLE_OUTBOX`` and
``MESSAGE_BUS__ENABLE_INBOX`` are tri-state: unset resolves ON for a broker transport and OFF for
the in-process one; code reads the resolved ``outbox_enabled`` / ``inbox_enabled`` only.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any, ClassVar, Self
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox_kit.application.handlers import ContextSource
from outbox_kit.persistence.database import DatabaseSettings
from outbox_kit.processor.settings import InboxSettings, OutboxSettings
from outbox_kit.runtime.time_limits import fit_to_the_lease, without_empty_limits
from outbox_kit.transports.settings import (
    EXAMPLE_SIGNING_SECRET,
    MIN_PRODUCTION_KEY_LENGTH,
    MessageBusSettings,
)


class Environment(StrEnum):
    """Development allows conveniences (dev tokens, default secrets); production refuses them."""

    DEVELOPMENT = "development"
    PRODUCTION = "production"


class ApplicationSettings(BaseModel):
    """Identity of the running service."""

    namespace: str = Field(default="", description="Prefix for broker names; the slug when empty")
    instance_id: str = Field(default="", description="Processor id in leases; host:pid when empty")


class WorkerSettings(BaseModel):
    """Where ``worker`` serves ``/livez``, ``/readyz`` and ``/metrics``, and when it is stalled.

    Without a port the worker serves nothing, so several workers can share a host; give each its
    own port (``WORKER__PORT`` or ``--port``) to scrape and probe it.
    """

    host: str = "127.0.0.1"
    port: int | None = Field(default=None, ge=0, le=65535)
    liveness_timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        description="A processor loop silent this long fails /livez; unset = lease + 3 idle intervals",
    )

    @field_validator("port", "liveness_timeout_seconds", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """``WORKER__PORT=`` (as ``.env.example`` has it) means no port, not an error."""
        return None if value == "" else value


class LoggingSettings(BaseModel):
    """Plain text for people, JSON lines for machines."""

    level: str = "INFO"
    json_format: bool = False


class TracingBackend(StrEnum):
    """``none``: no spans (nothing imported); ``otel``: OpenTelemetry, exported over OTLP."""

    NONE = "none"
    OTEL = "otel"


class TelemetrySettings(BaseModel):
    """Tracing (metrics are always on, at ``/metrics``). The OTLP endpoint, service name and
    sampling come from OpenTelemetry's own ``OTEL_*`` variables."""

    tracing: TracingBackend = TracingBackend.NONE


class ErrorTrackingSettings(BaseModel):
    """Sentry, off unless ``SENTRY__DSN`` is set (extra ``[sentry]``): unhandled errors and ERROR
    log records become events carrying the tenant, user and correlation id, secrets scrubbed."""

    dsn: SecretStr = SecretStr("")
    environment: str = ""  # default: ENVIRONMENT
    release: str = ""
    sample_rate: float = Field(default=1.0, ge=0, le=1)


DEV_JWT_SECRET = "dev-only-secret-change-me-0123456789abcdef"  # noqa: S105 (refused in production)

# RFC 7518 section 3.2: an HMAC key at least as long as the hash output.
MIN_JWT_SECRET_BYTES = {"HS256": 32, "HS384": 48, "HS512": 64}


# What an OpenID Connect provider signs with; the HMAC ones need a shared secret and ``none``
# verifies nothing, so neither is accepted from a provider.
PROVIDER_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)


class AuthSettings(BaseModel):
    """Bearer JWTs. Without a provider: HS256 tokens signed with ``AUTH__JWT_SECRET`` (``python -m
    <package> token`` mints them). With ``AUTH__JWKS_URL`` or ``AUTH__OIDC_ISSUER``: the tokens of
    an OpenID Connect provider, verified with the keys it publishes, while shared-secret tokens
    stay a development convenience for loopback callers. The claims naming the user, tenant and
    roles are settings, because every provider names them its own way."""

    jwt_secret: SecretStr = SecretStr(DEV_JWT_SECRET)
    jwt_algorithm: str = "HS256"
    jwt_issuer: str = ""
    jwt_audience: str = ""
    token_ttl_minutes: int = Field(default=60, ge=1)
    admin_role: str = "outbox-admin"
    operator_role: str = "outbox-operator"
    # The provider: its JWKS endpoint, or its issuer URL (the JWKS comes from the discovery
    # document at <issuer>/.well-known/openid-configuration; the issuer also becomes the `iss`
    # every token must carry unless AUTH__JWT_ISSUER says otherwise).
    jwks_url: str = ""
    oidc_issuer: str = ""
    jwt_algorithms: str = "RS256"  # comma-separated, e.g. RS256,ES256
    user_claim: str = "sub"
    tenant_claim: str = "tenant"
    roles_claim: str = "roles"  # a dotted path reaches a nested claim: realm_access.roles
    jwks_cache_seconds: float = Field(default=300, gt=0)
    # A whole fetch of the provider's keys (discovery document included), not one read of it.
    jwks_timeout_seconds: float = Field(default=5, gt=0)
    # A token naming a key not cached fetches the keys again unless the last fetch began sooner.
    jwks_refetch_seconds: float = Field(default=1, gt=0)

    @field_validator("jwt_algorithm")
    @classmethod
    def _shared_secret_algorithm(cls, value: str) -> str:
        """Only the HMAC algorithms verify with a shared secret (``none`` verifies nothing)."""
        if value not in MIN_JWT_SECRET_BYTES:
            msg = (
                "AUTH__JWT_ALGORITHM must be HS256, HS384 or HS512 (tokens signed with the shared "
                f"secret), got {value!r}"
            )
            raise ValueError(msg)
        return value

    @field_validator("jwt_algorithms")
    @classmethod
    def _provider_algorithms(cls, value: str) -> str:
        names = [name.strip() for name in value.split(",") if name.strip()]
        unknown = [name for name in names if name not in PROVIDER_ALGORITHMS]
        if not names or unknown:
            msg = (
                f"AUTH__JWT_ALGORITHMS must list the provider's signing algorithms among "
                f"{', '.join(sorted(PROVIDER_ALGORITHMS))}, got {value!r}"
            )
            raise ValueError(msg)
        return ",".join(names)

    @field_validator("jwks_url", "oidc_issuer")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if value and urlsplit(value).scheme not in {"http", "https"}:
            msg = f"the provider's URL must be http(s)://..., got {value!r}"
            raise ValueError(msg)
        return value  # as written: an issuer is compared with `iss` exactly (Auth0's ends in /)

    @field_validator("user_claim", "tenant_claim", "roles_claim")
    @classmethod
    def _claim_name(cls, value: str) -> str:
        if not value.strip(" ."):
            msg = "a claim name must not be empty"
            raise ValueError(msg)
        return value

    @model_validator(mode="after")
    def _a_provider_names_who_its_tokens_are_for(self) -> Self:
        """A provider signs tokens for many applications: without an issuer and an audience to
        check, a token it issued for another application would be accepted here."""
        if self.uses_provider:
            if not self.expected_issuer:
                msg = "AUTH__JWT_ISSUER (or AUTH__OIDC_ISSUER) must be set with AUTH__JWKS_URL"
                raise ValueError(msg)
            if not self.jwt_audience:
                msg = (
                    "AUTH__JWT_AUDIENCE must be set with an identity provider "
                    "(the client id or API identifier its tokens name in `aud`)"
                )
                raise ValueError(msg)
        return self

    @property
    def uses_provider(self) -> bool:
        return bool(self.jwks_url or self.oidc_issuer)

    @property
    def expected_issuer(self) -> str:
        return self.jwt_issuer or self.oidc_issuer

    @property
    def provider_algorithms(self) -> tuple[str, ...]:
        return tuple(self.jwt_algorithms.split(","))

    def refuse_in_production(self) -> None:
        """Without a provider: the development secret, a key shorter than its hash, or tokens not
        bound to an issuer and an audience (any service sharing the secret could mint ours) are
        refused. With one: its keys must come over HTTPS (shared-secret tokens are then refused
        in production, so the secret is not checked)."""
        if self.uses_provider:
            for name, url in (("JWKS_URL", self.jwks_url), ("OIDC_ISSUER", self.oidc_issuer)):
                if url and urlsplit(url).scheme != "https":
                    msg = f"AUTH__{name} must be an https:// URL in production, got {url!r}"
                    raise ValueError(msg)
            return
        secret = self.jwt_secret.get_secret_value()
        if secret == DEV_JWT_SECRET:
            msg = "AUTH__JWT_SECRET must be set in production"
            raise ValueError(msg)
        minimum = MIN_JWT_SECRET_BYTES[self.jwt_algorithm]
        if len(secret.encode()) < minimum:
            msg = (
                f"AUTH__JWT_SECRET must be at least {minimum} bytes for {self.jwt_algorithm}, "
                f"got {len(secret.encode())} (RFC 7518 3.2)"
            )
            raise ValueError(msg)
        for name, value in (("jwt_issuer", self.jwt_issuer), ("jwt_audience", self.jwt_audience)):
            if not value:
                msg = f"AUTH__{name.upper()} must be set in production (every token is checked against it)"
                raise ValueError(msg)


class ApiSettings(BaseModel):
    """Where `run` and `api` listen, the largest request body they read, the time limits of their
    HTTP server (the worker's probe server takes the same) and how long an ``Idempotency-Key``
    is remembered."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=1_048_576, ge=1)
    idempotency_key_retention_hours: float = Field(
        default=24.0,
        ge=0,
        le=24 * 366,
        description="How long an Idempotency-Key answers its first answer; 0 keeps keys for ever",
    )
    # A request head (request line and headers) not complete this long after its first byte, or
    # after the connection opened, closes the connection (408 when a head was begun).
    header_read_timeout_seconds: float = Field(default=10.0, gt=0, le=3600)
    # A request body not fully received this long after the application starts reading it: 408,
    # connection closed (a client sending a byte now and then held a request for ever).
    body_read_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    # An idle kept-alive connection is closed after this long (uvicorn's timeout_keep_alive).
    keep_alive_timeout_seconds: int = Field(default=5, ge=1, le=3600)
    shutdown_timeout_seconds: float = Field(
        default=10.0, gt=0, description="After SIGTERM, requests still running this long are cancelled"
    )
    readiness_timeout_seconds: float = Field(
        default=2.0, gt=0, description="A /readyz check (database, bus) not answering this long fails"
    )


class ServiceSettings(BaseSettings):
    """The root of every setting; the container builds one per process. A service derives its
    own and names itself: ``service_slug`` (the default namespace and tracing's service name),
    ``service_name`` and ``description`` (the OpenAPI and AsyncAPI documents, the command line)."""

    service_slug: ClassVar[str] = "outbox-service"
    service_name: ClassVar[str] = "Outbox service"
    description: ClassVar[str] = "A service with a transactional outbox and inbox."

    model_config = SettingsConfigDict(
        env_file=".env",
        env_file_encoding="utf-8",
        env_nested_delimiter="__",
        extra="ignore",
    )

    environment: Environment = Environment.DEVELOPMENT
    application: ApplicationSettings = ApplicationSettings()
    database: DatabaseSettings = DatabaseSettings()
    message_bus: MessageBusSettings = MessageBusSettings()
    outbox: OutboxSettings = OutboxSettings()
    inbox: InboxSettings = InboxSettings()
    auth: AuthSettings = AuthSettings()
    api: ApiSettings = ApiSettings()
    worker: WorkerSettings = WorkerSettings()
    logging: LoggingSettings = LoggingSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    sentry: ErrorTrackingSettings = ErrorTrackingSettings()
    sources: dict[str, ContextSource] = Field(default_factory=dict)
    """A bounded context's own storage, by context name (``SOURCES__NOTIFICATIONS__SCHEMA=notes``)."""

    @model_validator(mode="before")
    @classmethod
    def _an_empty_time_limit_is_unset(cls, data: Any) -> Any:  # noqa: ANN401 (the sources' input)
        return without_empty_limits(data)

    @model_validator(mode="after")
    def _time_limits_follow_the_lease(self) -> Self:
        """Unset time limits derived from the lease; every explicit contradiction refused at
        once (``time_limits``)."""
        self.outbox, self.message_bus = fit_to_the_lease(self.outbox, self.message_bus)
        return self

    @model_validator(mode="after")
    def _namespace_defaults_to_the_slug(self) -> Self:
        if not self.application.namespace:
            self.application = self.application.model_copy(update={"namespace": self.service_slug})
        return self

    @property
    def is_production(self) -> bool:
        return self.environment is Environment.PRODUCTION

    @property
    def liveness_timeout_seconds(self) -> float:
        """How long a processor loop may go without a turn before ``/livez`` fails. The longest
        cycle is the lease, or a batch whose every delivery runs handlers and hangs to its time
        limit: those run a pool's worth at a time (``source.py``), so ``ceil(batch / room)``
        rounds of ``OUTBOX__DELIVERY_TIMEOUT_SECONDS`` (600 s at the defaults: a worker merely
        busy with hung handlers must not be restarted for it). Between cycles a loop sleeps at
        most its idle interval; three of those leave room for a slow database."""
        outbox = self.outbox
        idle = max(outbox.polling_interval_seconds, outbox.idle_polling_interval_seconds)
        room = min(outbox.delivery_concurrency, self.database.pool_size)
        longest_cycle = max(
            outbox.lease_seconds, math.ceil(outbox.batch_size / room) * outbox.delivery_timeout_seconds
        )
        return self.worker.liveness_timeout_seconds or longest_cycle + 3 * idle

    @model_validator(mode="after")
    def _refuse_a_liveness_shorter_than_a_sleep(self) -> Self:
        """An idle loop sleeps up to its idle interval: a shorter liveness timeout would fail
        ``/livez`` on every idle worker and have the orchestrator restart it for nothing."""
        timeout, outbox = self.worker.liveness_timeout_seconds, self.outbox
        longest_sleep = max(outbox.polling_interval_seconds, outbox.idle_polling_interval_seconds)
        if timeout is not None and timeout <= longest_sleep:
            msg = (
                f"WORKER__LIVENESS_TIMEOUT_SECONDS ({timeout:g}) must be longer than the longest sleep "
                f"of a processor loop ({longest_sleep:g} s: OUTBOX__IDLE_POLLING_INTERVAL_SECONDS and "
                "OUTBOX__POLLING_INTERVAL_SECONDS)"
            )
            raise ValueError(msg)
        return self

    @model_validator(mode="after")
    def _refuse_unsafe_combinations(self) -> Self:
        bus = self.message_bus
        if bus.is_broker and bus.enable_outbox is False:
            msg = (
                f"MESSAGE_BUS__ENABLE_OUTBOX=false is refused with the {bus.transport} transport: "
                "integration events would bypass the outbox and be lost on a crash"
            )
            raise ValueError(msg)
        if bus.signing_key_id and bus.signing_key_id not in bus.signing_keys:
            msg = f"MESSAGE_BUS__SIGNING_KEY_ID {bus.signing_key_id!r} is not in SIGNING_KEYS"
            raise ValueError(msg)
        if self.is_production:
            self.auth.refuse_in_production()
            if bus.is_broker and not bus.signing_keys and not bus.allow_unsigned:
                msg = (
                    "MESSAGE_BUS__SIGNING_KEYS must be set for a broker transport in production "
                    "(or set MESSAGE_BUS__ALLOW_UNSIGNED=true to accept unsigned context headers)"
                )
                raise ValueError(msg)
            weak = sorted(
                kid
                for kid, secret in bus.signing_keys.items()
                if secret.get_secret_value() == EXAMPLE_SIGNING_SECRET
                or len(secret.get_secret_value()) < MIN_PRODUCTION_KEY_LENGTH
            )
            if weak:
                msg = (
                    f"MESSAGE_BUS__SIGNING_KEYS {', '.join(weak)}: the example key or shorter than "
                    f"{MIN_PRODUCTION_KEY_LENGTH} characters is refused in production"
                )
                raise ValueError(msg)
        return self


def secret_values(settings: BaseModel) -> set[str]:
    """Every secret the settings hold, as text: each ``SecretStr`` (the JWT secret, each signing
    key, the Sentry DSN) and the password of each URL (the databases', the bus's), percent-encoded
    as written and decoded as a driver receives it. Error tracking replaces them wherever they
    appear (``outbox_kit.application.scrubbing``)."""
    found: set[str] = set()
    _collect_secrets(settings, found)
    return {secret for secret in found if secret}


def _collect_secrets(value: object, found: set[str]) -> None:
    if isinstance(value, SecretStr):
        found.add(value.get_secret_value())
        _collect_secrets(value.get_secret_value(), found)
    elif isinstance(value, str):
        found.update(_url_password(value))
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            _collect_secrets(getattr(value, name), found)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_secrets(item, found)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            _collect_secrets(item, found)


def _url_password(text: str) -> set[str]:
    if "://" not in text:
        return set()
    try:
        password = urlsplit(text).password
    except ValueError:  # not a URL after all (an unbalanced IPv6 bracket, a bad port)
        return set()
    return {password, unquote(password)} if password else set()
